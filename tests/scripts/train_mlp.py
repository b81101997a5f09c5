"""Tiny elastic job for the integration tests.

    elastrain run -n 4 tests/scripts/train_mlp.py -- --steps 40 [--mismatch]

On completion each member writes its final parameters to
<run_dir>/final/<member>.npy (numpy, no pickle) for the equivalence test.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 4096, d: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, d, generator=g)
        w = torch.randn(d, 1, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    # The script's own directory (tests/scripts); here, because tests also load this
    # file as a module for its dataset, from elsewhere.
    import checkpoint_gate

    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--hang-floor", type=float, default=3.0, help="watchdog floor (s)")
    ap.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pace: at least this long per committed step (caps the step rate on fast machines)",
    )
    ap.add_argument(
        "--pace-file",
        default=None,
        help="a file holding the pace in seconds, read every step; while it exists and "
        "parses it overrides --min-step-s (a test slows the job while it injects faults, "
        "then lets it run to the end at full speed)",
    )
    checkpoint_gate.add_argument(ap)
    ap.add_argument(
        "--reduce-dtype", default="float64", help="TrainerConfig.reduce_dtype (float64, native)"
    )
    ap.add_argument(
        "--mismatch", action="store_true", help="build a different model (must be refused)"
    )
    ap.add_argument("--num-workers", type=int, default=0, help="TrainerConfig.num_workers")
    ap.add_argument("--prefetch-steps", type=int, default=0, help="TrainerConfig.prefetch_steps")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    hidden = args.hidden + (1 if args.mismatch else 0)
    model = nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = TrainerConfig(
        global_batch_size=32,
        micro_batch_size=4,
        total_steps=args.steps,
        seed=7,
        hang_timeout_floor_s=args.hang_floor,
        reduce_dtype=args.reduce_dtype,
        num_workers=args.num_workers,
        prefetch_steps=args.prefetch_steps,
    )
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, cfg)
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    gate = checkpoint_gate.CheckpointGate(args.await_checkpoint, run_dir)
    last = time.monotonic()
    for result in trainer.steps():
        gate.after(trainer, result.step)
        pace = args.min_step_s
        if args.pace_file:
            try:
                pace = float(Path(args.pace_file).read_text())
            except (OSError, ValueError):
                pass
        if pace > 0:
            time.sleep(max(0.0, pace - (time.monotonic() - last)))
        last = time.monotonic()
    if run_dir and trainer.holds_final_state:
        out = Path(run_dir) / "final"
        out.mkdir(exist_ok=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.save(out / f"{trainer.member}.npy", flat, allow_pickle=False)


if __name__ == "__main__":
    main()

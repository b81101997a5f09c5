"""The loop real users write, as an elastic job for the integration tests.

    elastrain run -n 3 tests/scripts/train_loop.py -- --clip 0.5 --sched cosine --poison-step 12

Clipping (`TrainerConfig.max_grad_norm`), a cosine LR scheduler registered with
the trainer and stepped after each committed step, optionally fp16 autocast
with a GradScaler, optionally a compiled model (--compile BACKEND, on the
members --compile-members names), and optionally one poisoned sample (inf
features; with --amp, 1e5, which overflows fp16) that makes one step's gradient
non-finite.
After each committed step every member appends what decides the next step to
<run_dir>/loop/<member>.jsonl: step, lr, the state hash, a hash of the model's
and optimizer's tensors alone, grad_norm, skipped, the GradScaler's scale. On completion each member writes its final parameters
to <run_dir>/final/<member>.npy (numpy, no pickle). With --eval-every K the
model is evaluated (`trainer.evaluate_every`) on a held-out set after every K
steps: the record of the step that follows carries the evaluation's sums, and
the one after the last step goes to <run_dir>/final/<member>.eval.json.
--await-checkpoint N@S: see checkpoint_gate.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import checkpoint_gate  # tests/scripts: the script's own directory
import numpy as np
import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig
from elastrain.data import GlobalOrder
from elastrain.transfer.dtypes import cpu_bytes
from elastrain.transfer.flatten import flatten_state

B, MB, SEED, N = 24, 4, 7, 2048
EVAL_N, EVAL_B = 200, 16


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, poison: int | None, poison_value: float, n: int = N) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, 16, generator=g)
        w = torch.randn(16, 1, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(n, 1, generator=g)
        if poison is not None:
            self.x[poison] = poison_value

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def tensors_hash(model: nn.Module, opt: torch.optim.Optimizer) -> str:
    """The model's and the optimizer's tensors only (not the learning rate)."""
    h = hashlib.sha256()
    for _, t in flatten_state(model, opt).tensors:
        h.update(cpu_bytes(t).numpy().data)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--clip", type=float, default=None, help="TrainerConfig.max_grad_norm")
    ap.add_argument("--sched", choices=["none", "cosine"], default="cosine")
    ap.add_argument(
        "--no-register", action="store_true", help="build the scheduler, do not register it"
    )
    ap.add_argument("--poison-step", type=int, default=None, help="this step's gradient is inf")
    ap.add_argument("--amp", action="store_true", help="fp16 autocast with a GradScaler")
    ap.add_argument(
        "--min-step-s", type=float, default=0.0, help="pace: at least this long per step"
    )
    checkpoint_gate.add_argument(ap)
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate after every K steps")
    ap.add_argument("--compile", metavar="BACKEND", help="model.compile(backend=BACKEND)")
    ap.add_argument("--compile-members", help="comma-separated members that compile (default: all)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    poison = None
    if args.poison_step is not None:
        # The first sample of that step in the job's global order.
        poison = GlobalOrder(N, SEED).ids(args.poison_step * B, args.poison_step * B + 1)[0]
    data = Regression(poison, 1e5 if args.amp else float("inf"))

    def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16, enabled=args.amp):
            out = m(x)
        return nn.functional.mse_loss(out.float(), y)

    cfg = TrainerConfig(
        global_batch_size=B,
        micro_batch_size=MB,
        total_steps=args.steps,
        seed=SEED,
        max_grad_norm=args.clip,
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if args.amp else None
    trainer = ElasticTrainer(model, opt, data, loss_fn, cfg, grad_scaler=scaler)
    if args.eval_every:
        # Held-out samples (the tail of a longer draw), in batches of EVAL_B (the last
        # one shorter).
        held_out = Regression(None, 0.0, N + EVAL_N)
        held_out.x, held_out.y = held_out.x[N:], held_out.y[N:]

        def eval_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
            x, y = batch
            err = m(x) - y
            return {
                "sq": err.square().sum(),
                "abs": err.abs().sum(),
                "n_big": (err.abs() > 0.5).sum(),
            }

        trainer.evaluate_every(args.eval_every, eval_fn, held_out, batch_size=EVAL_B)

    if args.compile and trainer.member in (args.compile_members or trainer.member).split(","):
        # In place, after the trainer was built: the trainer compiles it before joining.
        model.compile(backend=args.compile)
        print(f"{trainer.member}: compiled with {args.compile}", flush=True)
    sched = None
    if args.sched == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
        if not args.no_register:
            trainer.register("sched", sched)
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    log = None
    if run_dir:
        (Path(run_dir) / "loop").mkdir(exist_ok=True)
        log = (Path(run_dir) / "loop" / f"{trainer.member}.jsonl").open("a")
    gate = checkpoint_gate.CheckpointGate(args.await_checkpoint, run_dir)
    last = time.monotonic()
    for result in trainer.steps():
        if sched is not None:
            sched.step()
        if log is not None:
            rec = {
                "step": result.step,
                "lr": opt.param_groups[0]["lr"],
                "hash": trainer.backend.state_hash(),
                "tensors": tensors_hash(model, opt),
                "grad_norm": result.grad_norm,
                "skipped": result.skipped,
                "scale": scaler.get_scale() if scaler is not None else None,
            }
            if result.evaluation is not None:
                rec["eval"] = result.evaluation.to_json()
            log.write(json.dumps(rec) + "\n")
            log.flush()
        gate.after(trainer, result.step)
        if args.min_step_s > 0:
            time.sleep(max(0.0, args.min_step_s - (time.monotonic() - last)))
            last = time.monotonic()
    if run_dir and trainer.holds_final_state:
        out = Path(run_dir) / "final"
        out.mkdir(exist_ok=True)
        if trainer.last_evaluation is not None:
            # The evaluation after the last step (no step result carries it).
            last = json.dumps(trainer.last_evaluation.to_json())
            (out / f"{trainer.member}.eval.json").write_text(last)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.save(out / f"{trainer.member}.npy", flat, allow_pickle=False)


if __name__ == "__main__":
    main()

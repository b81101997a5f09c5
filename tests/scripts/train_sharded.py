"""A small residual network with a block list, for the sharded-model tests.

    elastrain run -n 4 --shard-size 2 tests/scripts/train_sharded.py -- --steps 30

The same script runs replicated (no --shard-size): the tests compare the two
loss curves. Its blocks sit in an `nn.ModuleList`, so each one is an FSDP2 unit;
dims are chosen so that some parameters do not split evenly (padded shards).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 2048, d: int = 12, seed: int = 99) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        self.y = torch.sin(self.x[:, :3].sum(1, keepdim=True)) + 0.05 * torch.randn(
            n, 1, generator=g
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(torch.tanh(self.up(self.norm(h)))))


class Net(nn.Module):
    def __init__(self, d_in: int = 12, d: int = 37, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)
        # Not persistent, not a parameter: must reach every FSDP2 wrapper intact.
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def evaluate(model: nn.Module | None, data: Regression, step: int) -> None:
    """What a user runs between steps: a forward without backward (which leaves
    FSDP2's root unsharded) over fixed held-out batches, printed per member."""
    if model is None:
        return
    model.eval()
    with torch.no_grad():
        total = sum(
            float(loss_fn(model, (data.x[i : i + 6], data.y[i : i + 6]))) for i in (0, 6, 12, 18)
        )
    model.train()
    print(f"eval step {step}: {total!r}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--shard-size", type=int, default=1, help="TrainerConfig.shard_size")
    ap.add_argument("--ckpt-every", type=int, default=0, help="TrainerConfig.checkpoint_every")
    ap.add_argument("--hang-floor", type=float, default=3.0, help="watchdog floor (s)")
    ap.add_argument(
        "--reduce-dtype", default="float64", help="TrainerConfig.reduce_dtype (float64, native)"
    )
    ap.add_argument(
        "--pace-file",
        default=None,
        help="a file holding a minimum step time in seconds, read every step (a test slows "
        "the job while it injects a fault and waits for the replacement)",
    )
    ap.add_argument(
        "--meta-members",
        default="",
        help="comma-separated member ids that build the model on the meta device (their "
        "state comes from a checkpoint or from their twins' heal)",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="every this many steps, evaluate inside trainer.pause() on trainer.model (eval "
        "mode, a no_grad forward over held-out batches, train mode again); 0: never",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if os.environ.get("ELASTRAIN_MEMBER_ID", "") in args.meta_members.split(","):
        with torch.device("meta"):
            model = Net()
        print(f"{os.environ['ELASTRAIN_MEMBER_ID']}: model built on the meta device", flush=True)
    else:
        model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    cfg = TrainerConfig(
        global_batch_size=24,
        micro_batch_size=3,
        total_steps=args.steps,
        seed=5,
        shard_size=args.shard_size,
        checkpoint_every=args.ckpt_every,
        hang_timeout_floor_s=args.hang_floor,
        reduce_dtype=args.reduce_dtype,
    )
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, cfg)
    held_out = Regression(n=24, seed=7)
    last = time.monotonic()
    for r in trainer.steps():
        if args.eval_every and r.step % args.eval_every == args.eval_every - 1:
            with trainer.pause():
                evaluate(trainer.model, held_out, r.step)
        if args.pace_file:
            try:
                pace = float(Path(args.pace_file).read_text())
            except (OSError, ValueError):
                pace = 0.0
            time.sleep(max(0.0, pace - (time.monotonic() - last)))
        last = time.monotonic()


if __name__ == "__main__":
    main()

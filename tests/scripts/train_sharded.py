"""A small residual network with a block list, for the sharded-model tests.

    elastrain run -n 4 --shard-size 2 tests/scripts/train_sharded.py -- --steps 30

The same script runs replicated (no --shard-size): the tests compare the two
loss curves. The network, its data and the trainer arguments are the sharded
scripts' own (job_common.py): each block is an FSDP2 unit; dims are chosen so
that some parameters do not split evenly (padded shards).
"""

from __future__ import annotations

import argparse
import os

import torch
from job_common import (
    Net,
    Pace,
    Regression,
    loss_fn,
    sharded_arguments,
    sharded_config,
    sharded_model,
    wait_at_gate,
)
from torch import nn

from elastrain import ElasticTrainer

__all__ = ["Net", "Regression", "loss_fn"]  # what the tests import from this script


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
    sharded_arguments(ap, steps=30)
    ap.set_defaults(reduce_dtype="float64")
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
    wait_at_gate(args)
    on_meta = os.environ.get("ELASTRAIN_MEMBER_ID", "") in args.meta_members.split(",")
    model, opt = sharded_model(on_meta)
    if on_meta:
        print(f"{os.environ['ELASTRAIN_MEMBER_ID']}: model built on the meta device", flush=True)
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, sharded_config(args))
    held_out = Regression(n=24, seed=7)
    pace = Pace(args.pace_file)
    for r in trainer.steps():
        if args.eval_every and r.step % args.eval_every == args.eval_every - 1:
            with trainer.pause():
                evaluate(trainer.model, held_out, r.step)
        pace.wait()


if __name__ == "__main__":
    main()

"""The sharded-model test network with the loop of a real recipe: clipping, a
GradScaler, autocast and a `before_step` hook (issue 41).

    elastrain run -n 4 --shard-size 2 tests/scripts/train_sharded_step.py -- --max-grad-norm 0.05

The same script runs replicated (no --shard-size): tests/test_sharded_step.py
compares the loss curves, the grad norms and what the hook saw.
"""

from __future__ import annotations

import argparse
import os

import torch
from job_common import Pace, Regression, loss_fn, sharded_arguments, sharded_config, sharded_model

from elastrain import ElasticTrainer
from elastrain.runtime.update import Decision, StepGrads


def main() -> None:
    ap = argparse.ArgumentParser()
    sharded_arguments(ap, steps=30)
    ap.set_defaults(reduce_dtype="float64")
    ap.add_argument("--max-grad-norm", type=float, default=None)
    ap.add_argument("--scaler-init", type=float, default=0.0, help="GradScaler init_scale; 0: none")
    ap.add_argument("--autocast", choices=["none", "bfloat16", "float16"], default="none")
    ap.add_argument("--hook", action="store_true", help="a before_step hook (see below)")
    args = ap.parse_args()
    model, opt = sharded_model()
    cfg = sharded_config(args, max_grad_norm=args.max_grad_norm)
    member = os.environ.get("ELASTRAIN_MEMBER_ID", "?")

    def hook(g: StepGrads) -> Decision | None:
        # Decides from its inputs only: the step, the norm, the optimizer.
        print(
            f"hook {g.step} {g.grad_norm.hex()} {g.finite} {g.clipped} {len(g.params)}", flush=True
        )
        for group in g.optimizer.param_groups:
            group["lr"] = 3e-3 * (1.0 - 0.5 * g.step / args.steps)
        return Decision.SKIP if g.step % 9 == 4 else None

    dtype = None if args.autocast == "none" else getattr(torch, args.autocast)

    def loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if dtype is None:
            return loss_fn(model, batch)
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(model, batch)

    scaler = (
        torch.amp.GradScaler("cpu", init_scale=args.scaler_init, growth_interval=5)
        if args.scaler_init
        else None
    )
    trainer = ElasticTrainer(
        model,
        opt,
        Regression(),
        loss,
        cfg,
        grad_scaler=scaler,
        before_step=hook if args.hook else None,
    )
    pace = Pace(args.pace_file)
    for r in trainer.steps():
        scale = scaler.get_scale() if scaler is not None else None
        print(f"{member} step {r.step} norm {r.grad_norm!r} skipped {r.skipped} scale {scale}",
              flush=True)  # fmt: skip
        pace.wait()


if __name__ == "__main__":
    main()

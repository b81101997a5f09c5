"""The sharded scripts' model (job_common.py) with what a team's loop carries: a
warm-up + cosine `LambdaLR` and an evaluation every K steps (tests/test_sharded_carry.py).

    elastrain run -n 4 --shard-size 2 tests/scripts/train_sharded_carry.py -- --eval-every 5

The same script runs replicated (no --shard-size). After each committed step
every member appends to <run_dir>/loop/<member>.jsonl: the step, its loss, the
learning rate the optimizer that steps now holds (the next step's), the
scheduler's step count and, on the step after an evaluated count, the
evaluation. The evaluation after the last step goes to
<run_dir>/final/<member>.eval.json. --carry says how the scheduler travels:
``register`` (`trainer.register`), ``extra`` (the older
``extra_state=``/``load_extra_state=``), or ``none`` (built, not carried: the
trainer refuses it at start).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from job_common import (  # tests/scripts: the script's own directory
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

HORIZON, WARMUP = 40, 5
"""The schedule's length and warm-up in steps (fixed: a resumed run has the same)."""
EVAL_N, EVAL_B = 30, 4


def lr_factor(step: int) -> float:
    """Linear warm-up over WARMUP steps, then cosine to zero at HORIZON."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1.0 + math.cos(math.pi * min(step - WARMUP, HORIZON) / HORIZON))


def eval_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    x, y = batch
    err = model(x) - y
    return {"sq": err.square().sum(), "abs": err.abs().sum()}


def main() -> None:
    ap = argparse.ArgumentParser()
    sharded_arguments(ap, steps=20)
    ap.add_argument("--eval-every", type=int, default=0, help="evaluate after every K steps")
    ap.add_argument("--carry", choices=["register", "extra", "none"], default="register")
    args = ap.parse_args()
    wait_at_gate(args)
    model, opt = sharded_model()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    extra: dict[str, Any] = {}
    if args.carry == "extra":
        extra = {
            "extra_state": lambda: {"sched": sched.state_dict()},
            "load_extra_state": lambda s: sched.load_state_dict(s["sched"]),
        }
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, sharded_config(args), **extra)
    if args.carry == "register":
        trainer.register("sched", sched)
    if args.eval_every:
        trainer.evaluate_every(args.eval_every, eval_fn, Regression(n=EVAL_N, seed=7),
                               batch_size=EVAL_B)  # fmt: skip
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    log = None
    if run_dir:
        (Path(run_dir) / "loop").mkdir(exist_ok=True)
        log = (Path(run_dir) / "loop" / f"{trainer.member}.jsonl").open("a")
    pace = Pace(args.pace_file)
    for r in trainer.steps():
        sched.step()
        if log is not None:
            rec = {
                "step": r.step,
                "loss": r.loss,
                "lr": trainer.optimizer.param_groups[0]["lr"],
                "sched_step": sched.last_epoch,
            }
            if r.evaluation is not None:
                rec["eval"] = r.evaluation.to_json()
            log.write(json.dumps(rec) + "\n")
            log.flush()
        pace.wait()
    if run_dir and trainer.last_evaluation is not None:
        out = Path(run_dir) / "final"
        out.mkdir(exist_ok=True)
        (out / f"{trainer.member}.eval.json").write_text(
            json.dumps(trainer.last_evaluation.to_json())
        )


if __name__ == "__main__":
    main()

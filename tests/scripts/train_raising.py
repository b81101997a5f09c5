"""The sharded scripts' model and data (job_common.py), with a bug planted in the
script: the issue-40 tests' job (a script error is not a hardware failure).

    elastrain run -n 4 tests/scripts/train_raising.py -- --raise-at 3 --raise-on w0

`--raise-at STEP`: after the step STEP commits (and, with `--repeat`, after every
later one), a member named in `--raise-on` (member ids, or `leader`: rank 0; all of
them when empty) raises `ValueError` from the line marked below. `--once FILE`:
only the first member to get there raises (it creates FILE), so the error is
transient, not repeated. Without `--raise-at` it trains like train_sharded.py, the
same loss curve bit for bit.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from job_common import Regression, loss_fn, sharded_arguments, sharded_config, sharded_model

from elastrain import ElasticTrainer

BUG_LINE = "raise ValueError"
"""The text of the line the tests expect the job's report to name."""


def should_raise(step: int, rank: int, args: argparse.Namespace) -> bool:
    me = os.environ.get("ELASTRAIN_MEMBER_ID", "")
    if args.raise_at is None or step < args.raise_at or (step > args.raise_at and not args.repeat):
        return False
    who = args.raise_on.split(",") if args.raise_on else []
    if who and me not in who and not ("leader" in who and rank == 0):
        return False
    if args.once:
        try:
            Path(args.once).touch(exist_ok=False)
        except FileExistsError:
            return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser()
    sharded_arguments(ap, steps=30)
    ap.add_argument("--raise-at", type=int, default=None)
    ap.add_argument("--raise-on", default="")
    ap.add_argument("--repeat", action="store_true")
    ap.add_argument("--once", default="")
    args = ap.parse_args()
    model, opt = sharded_model()
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, sharded_config(args))
    for r in trainer.steps():
        if should_raise(r.step, r.rank, args):
            raise ValueError(f"grad norm is None at step {r.step}")  # the planted bug


if __name__ == "__main__":
    main()

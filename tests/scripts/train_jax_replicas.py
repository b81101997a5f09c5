"""Tiny JAX job of multi-process replicas for tests/test_jax_multiproc.py.

    elastrain run -n 4 --replica-procs 2 tests/scripts/train_jax_replicas.py -- --steps 20

The soak's JAX MLP (dropout: the per-micro-batch keys matter); with 2
processes a replica, w1, b1 and w2 are split by rows over the replica's mesh
and b2 (one element) is replicated. On completion each process writes its part
of the parameters to <run_dir>/final/<member>.npy and its place to
<run_dir>/final/<member>.place (twins' parts must be equal).
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elastrain.chaos.soak_job_jax import init, loss_fn  # noqa: E402
from elastrain.chaos.soak_jobs import Regression, save_final  # noqa: E402
from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pace: at least this long per committed step, so that a rebuilt replica "
        "(JAX import, runtime, compile: ~15 s on a busy machine) joins before the end",
    )
    args = ap.parse_args()
    params = init(jax.random.PRNGKey(0), 16, args.hidden)
    data = Regression(n=4096, d=16, seed=1234)
    cfg = TrainerConfig(
        global_batch_size=24, micro_batch_size=4, total_steps=args.steps, seed=7, replica_procs=2
    )
    trainer = JaxElasticTrainer(params, optax.adam(1e-2), data, loss_fn, cfg)
    last = time.monotonic()
    for _ in trainer.steps():
        if args.min_step_s > 0:
            time.sleep(max(0.0, args.min_step_s - (time.monotonic() - last)))  # the pace
        last = time.monotonic()
    if trainer.holds_final_state:
        leaves = jax.tree_util.tree_leaves(trainer.params)
        save_final(trainer.member, np.concatenate([np.asarray(x).reshape(-1) for x in leaves]))
        run_dir = os.environ["ELASTRAIN_RUN_DIR"]
        place = f"{os.environ['ELASTRAIN_REPLICA']} {os.environ['ELASTRAIN_REPLICA_PROC']}"
        (Path(run_dir) / "final" / f"{trainer.member}.place").write_text(place)


if __name__ == "__main__":
    main()

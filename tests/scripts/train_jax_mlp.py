"""Tiny elastic JAX job for tests/test_jax.py.

    elastrain run -n 3 tests/scripts/train_jax_mlp.py -- --steps 30

The soak's JAX model (`elastrain.chaos.soak_job_jax`: a two-layer MLP with
dropout, so the per-micro-batch PRNG keys matter) on a smaller fixed
regression set, optax Adam. On completion each member writes its final
parameters to <run_dir>/final/<member>.npy (numpy, no pickle).
"""

from __future__ import annotations

import os

# One XLA CPU thread per worker: several workers share two cores here.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elastrain.chaos.soak_job_jax import init, loss_fn  # noqa: E402
from elastrain.chaos.soak_jobs import Regression, save_final  # noqa: E402
from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pace: at least this long per committed step (a checkpoint commits in the "
        "background; a test that kills the job after one needs the steps not to outrun it)",
    )
    args = ap.parse_args()
    params = init(jax.random.PRNGKey(0), 16, args.hidden)
    data = Regression(n=4096, d=16, seed=1234)
    cfg = TrainerConfig(global_batch_size=24, micro_batch_size=4, total_steps=args.steps, seed=7)
    trainer = JaxElasticTrainer(params, optax.adam(1e-2), data, loss_fn, cfg)
    last = time.monotonic()
    for _ in trainer.steps():
        if args.min_step_s > 0:
            time.sleep(max(0.0, args.min_step_s - (time.monotonic() - last)))  # the pace
        last = time.monotonic()
    if trainer.holds_final_state:
        leaves = jax.tree_util.tree_leaves(trainer.params)
        save_final(trainer.member, np.concatenate([np.asarray(x).reshape(-1) for x in leaves]))


if __name__ == "__main__":
    main()

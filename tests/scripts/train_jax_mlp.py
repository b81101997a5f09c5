"""Tiny elastic JAX job for tests/test_jax.py.

    elastrain run -n 3 tests/scripts/train_jax_mlp.py -- --steps 30

The soak's JAX model (`elastrain.chaos.soak_job_jax`: a two-layer MLP with
dropout, so the per-micro-batch PRNG keys matter) on a smaller fixed
regression set, optax Adam (job_common.py's `jax_mlp_job`). On completion each
member writes its final parameters to <run_dir>/final/<member>.npy (numpy, no
pickle).
"""

from __future__ import annotations

import argparse

from job_common import jax_arguments, jax_mlp_job


def main() -> None:
    ap = argparse.ArgumentParser()
    jax_arguments(
        ap,
        steps=30,
        hidden=64,
        pace_why="(a checkpoint commits in the background; a test that kills the job after "
        "one needs the steps not to outrun it)",
    )
    jax_mlp_job(ap.parse_args())


if __name__ == "__main__":
    main()

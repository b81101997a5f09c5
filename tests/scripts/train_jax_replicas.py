"""Tiny JAX job of multi-process replicas for tests/test_jax_multiproc.py.

    elastrain run -n 4 --replica-procs 2 tests/scripts/train_jax_replicas.py -- --steps 20

The soak's JAX MLP (job_common.py's `jax_mlp_job`; dropout: the per-micro-batch
keys matter); with 2 processes a replica, w1, b1 and w2 are split by rows over
the replica's mesh and b2 (one element) is replicated. On completion each
process writes its part of the parameters to <run_dir>/final/<member>.npy and
its place to <run_dir>/final/<member>.place (twins' parts must be equal).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from job_common import jax_arguments, jax_mlp_job


def main() -> None:
    ap = argparse.ArgumentParser()
    jax_arguments(
        ap,
        steps=20,
        hidden=32,
        pace_why="so that a rebuilt replica (JAX import, runtime, compile: ~15 s on a busy "
        "machine) joins before the end",
    )
    trainer = jax_mlp_job(ap.parse_args(), replica_procs=2)
    if trainer.holds_final_state:
        run_dir = os.environ["ELASTRAIN_RUN_DIR"]
        place = f"{os.environ['ELASTRAIN_REPLICA']} {os.environ['ELASTRAIN_REPLICA_PROC']}"
        (Path(run_dir) / "final" / f"{trainer.member}.place").write_text(place)


if __name__ == "__main__":
    main()

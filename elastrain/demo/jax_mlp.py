"""The training script of `elastrain demo --jax`: the soak's JAX MLP as replicas of 2 processes.

    elastrain run -n 4 --replica-procs 2 elastrain/demo/jax_mlp.py -- --steps 30

The soak's MLP (`elastrain.chaos.soak_job_jax`: d -> hidden, tanh, dropout,
-> 1; optax Adam) on a fixed regression set. Each replica is 2 processes of
one `jax.distributed` runtime; w1, b1 and w2 are split by rows over the
replica's mesh (process k of every replica holds the same rows: twins), b2
(one element) is whole. A small model starts fast (JAX import, runtime,
compile): the demo's rebuilt replica must join before the job ends. The
steps are paced by `--pace-file`, which the demo's driver sets
(`elastrain.demo.pace`).
"""

from __future__ import annotations

import os

# One XLA CPU thread per process: 4 processes share a few cores.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
import time  # noqa: E402

from elastrain.data import GlobalOrder  # noqa: E402
from elastrain.demo.pace import read_pace  # noqa: E402

D, HIDDEN, DATASET, DATA_SEED, SEED = 16, 64, 4096, 1234, 7
BATCH, MICRO, LR, PROCS = 24, 4, 1e-2, 2


def expected_ids(step: int) -> list[int]:
    """The sample ids step `step` must train on (for the exactly-once check)."""
    return GlobalOrder(DATASET, SEED).ids(step * BATCH, (step + 1) * BATCH)


def state_bytes() -> int:
    """What a replicated heal would move: the trainer's whole state, counted from
    the model's shapes (`soak_job_jax.init`: w1 D x HIDDEN, b1 HIDDEN, w2 HIDDEN x 1,
    b2 1, float32), times 3 (the parameters and Adam's two moments), plus Adam's
    int32 count and the uint32[2] PRNG key. Arithmetic, not `jax.eval_shape`: the
    demo's driver prints it without importing JAX (seconds on a busy machine)."""
    params = D * HIDDEN + HIDDEN + HIDDEN * 1 + 1
    return 3 * params * 4 + 4 + 2 * 4


def main(argv: list[str] | None = None) -> None:
    import jax
    import optax

    from elastrain.chaos.soak_job_jax import init, loss_fn
    from elastrain.chaos.soak_jobs import Regression
    from elastrain.jax import JaxElasticTrainer, TrainerConfig

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--pace-file", default=None, help="a minimum step time, read every step")
    args = ap.parse_args(argv)
    cfg = TrainerConfig(
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        total_steps=args.steps,
        seed=SEED,
        replica_procs=PROCS,
    )
    params = init(jax.random.PRNGKey(0), D, HIDDEN)
    data = Regression(n=DATASET, d=D, seed=DATA_SEED)
    trainer = JaxElasticTrainer(params, optax.adam(LR), data, loss_fn, cfg)
    for r in trainer.steps():
        pace = read_pace(args.pace_file, 0.0)
        if r.step_s < pace:
            time.sleep(pace - r.step_s)  # the pace, not a synchronisation


if __name__ == "__main__":
    main()

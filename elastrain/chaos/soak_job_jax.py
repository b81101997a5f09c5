"""The soak's JAX job: the PyTorch soak job (`soak_job.py`) in JAX and optax.

    elastrain run -n 3 elastrain/chaos/soak_job_jax.py

Started by `elastrain chaos soak --job jax` (see elastrain.chaos.soak), once
under faults and once as the failure-free reference. The same MLP shape,
dropout, Adam, data, data order (`expected_ids`), checkpoint period and final
output as the PyTorch job: the soak jobs' shared contract
(`elastrain.chaos.soak_jobs`). Dropout draws from the per-micro-batch PRNG key
the engine hands `loss_fn`, so the randomness does not depend on membership.
"""

from __future__ import annotations

import os

# One XLA CPU thread per worker: several workers share a few cores.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elastrain.chaos.soak_jobs import (  # noqa: E402
    BATCH,
    CHECKPOINT_EVERY,
    DIM,
    DROPOUT,
    HIDDEN,
    LR,
    MICRO,
    SEED,
    TOTAL_STEPS,
    Regression,
    expected_ids,
    save_final,
)
from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402

__all__ = ["expected_ids", "main"]


def init(key: jax.Array) -> dict[str, jax.Array]:
    """The MLP's parameters: DIM -> HIDDEN (tanh, dropout) -> 1."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (DIM, HIDDEN)) / jnp.sqrt(DIM),
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, 1)) / jnp.sqrt(HIDDEN),
        "b2": jnp.zeros(1),
    }


def loss_fn(params: dict[str, jax.Array], batch: Any, key: jax.Array) -> jax.Array:
    """Mean squared error of one micro-batch, with inverted dropout keyed by `key`."""
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, 1.0 - DROPOUT, h.shape)
    h = jnp.where(keep, h / (1.0 - DROPOUT), 0.0)
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def main() -> None:
    cfg = TrainerConfig(
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        total_steps=TOTAL_STEPS,
        seed=SEED,
        checkpoint_every=CHECKPOINT_EVERY,
    )
    trainer = JaxElasticTrainer(
        init(jax.random.PRNGKey(0)), optax.adam(LR), Regression(), loss_fn, cfg
    )
    for _ in trainer.steps():
        pass
    if trainer.holds_final_state:
        leaves = jax.tree_util.tree_leaves(trainer.params)
        save_final(trainer.member, np.concatenate([np.asarray(x).reshape(-1) for x in leaves]))


if __name__ == "__main__":
    main()

"""The soak's JAX job: the PyTorch soak job (`soak_job.py`) in JAX and optax.

    elastrain run -n 3 elastrain/chaos/soak_job_jax.py

Started by `elastrain chaos soak --job jax` (see elastrain.chaos.soak), once
under faults and once as the failure-free reference. The same MLP shape,
dropout, Adam, data, data order (`expected_ids`), configuration (a checkpoint
every 20 steps) and final output as the PyTorch job: the soak jobs' shared
contract (`elastrain.chaos.soak_jobs`). Dropout draws from the per-micro-batch
PRNG key the engine hands `loss_fn`, so the randomness does not depend on
membership. `init` and `loss_fn` are also the model of
tests/scripts/train_jax_mlp.py.
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

from elastrain.chaos import soak_jobs  # noqa: E402
from elastrain.jax import JaxElasticTrainer  # noqa: E402

expected_ids = soak_jobs.expected_ids


def init(
    key: jax.Array, d: int = soak_jobs.DIM, hidden: int = soak_jobs.HIDDEN
) -> dict[str, jax.Array]:
    """The MLP's parameters: d -> hidden (tanh, dropout) -> 1."""
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d, hidden)) / jnp.sqrt(d),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden),
        "b2": jnp.zeros(1),
    }


def loss_fn(params: dict[str, jax.Array], batch: Any, key: jax.Array) -> jax.Array:
    """Mean squared error of one micro-batch, with inverted dropout keyed by `key`."""
    x, y = batch
    keep_p = 1.0 - soak_jobs.DROPOUT
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, keep_p, h.shape)
    h = jnp.where(keep, h / keep_p, 0.0)
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def main() -> None:
    params, opt = init(jax.random.PRNGKey(0)), optax.adam(soak_jobs.LR)
    trainer = JaxElasticTrainer(
        params, opt, soak_jobs.Regression(), loss_fn, soak_jobs.trainer_config()
    )
    for _ in trainer.steps():
        pass
    if trainer.holds_final_state:
        leaves = jax.tree_util.tree_leaves(trainer.params)
        flat = np.concatenate([np.asarray(x).reshape(-1) for x in leaves])
        soak_jobs.save_final(trainer.member, flat)


if __name__ == "__main__":
    main()

"""Tiny elastic JAX job for tests/test_jax.py.

    elastrain run -n 3 tests/scripts/train_jax_mlp.py -- --steps 30

A two-layer MLP with dropout (so the per-micro-batch PRNG keys matter) on a
fixed regression set, optax Adam. On completion each member writes its final
parameters to <run_dir>/final/<member>.npy (numpy, no pickle).
"""

from __future__ import annotations

import os

# One XLA CPU thread per worker: several workers share two cores here.
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402


class Regression:
    def __init__(self, n: int = 4096, d: int = 16) -> None:
        g = np.random.default_rng(1234)
        self.x = g.standard_normal((n, d), dtype=np.float32)
        w = g.standard_normal((d, 1), dtype=np.float32)
        noise = 0.05 * g.standard_normal((n, 1), dtype=np.float32)
        self.y = (np.tanh(self.x @ w) + noise).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.x[i], self.y[i]


def init(key: jax.Array, d: int, hidden: int) -> dict[str, jax.Array]:
    k1, k2 = jax.random.split(key)
    return {
        "w1": jax.random.normal(k1, (d, hidden)) / jnp.sqrt(d),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, 1)) / jnp.sqrt(hidden),
        "b2": jnp.zeros(1),
    }


def loss_fn(params: dict[str, jax.Array], batch: Any, key: jax.Array) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    keep = jax.random.bernoulli(key, 0.9, h.shape)
    h = jnp.where(keep, h / 0.9, 0.0)
    pred = h @ params["w2"] + params["b2"]
    return jnp.mean((pred - y) ** 2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    params = init(jax.random.PRNGKey(0), 16, args.hidden)
    cfg = TrainerConfig(global_batch_size=24, micro_batch_size=4, total_steps=args.steps, seed=7)
    trainer = JaxElasticTrainer(params, optax.adam(1e-2), Regression(), loss_fn, cfg)
    for _ in trainer.steps():
        pass
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    if run_dir and trainer.holds_final_state:
        out = Path(run_dir) / "final"
        out.mkdir(exist_ok=True)
        leaves = jax.tree_util.tree_leaves(trainer.params)
        flat = np.concatenate([np.asarray(x).reshape(-1) for x in leaves])
        np.save(out / f"{trainer.member}.npy", flat, allow_pickle=False)


if __name__ == "__main__":
    main()

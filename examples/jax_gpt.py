"""A small GPT in plain JAX + optax, trained elastically on the demo's corpus.

    pip install 'elastrain[jax]'
    elastrain run -n 4 examples/jax_gpt.py -- --steps 60
    elastrain run -n 4 --fault kill@20 examples/jax_gpt.py -- --steps 60

The corpus is the one `elastrain demo` uses (the Python standard library's
top-level `.py` files, read as bytes; vocabulary 256), cut into blocks of
`--block` bytes. The model is a pre-norm decoder-only transformer written as
pure functions over a dict of arrays; `loss_fn(params, batch, key)` is all
the trainer needs (it jits `value_and_grad` itself). Dropout uses the key the
trainer hands each micro-batch, derived from (seed, step, micro-batch), so a
run with failures follows the failure-free loss curve.
"""

from __future__ import annotations

import os

# One XLA CPU thread per worker process (several workers share the cores).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from elastrain.demo.gpt import stdlib_corpus  # noqa: E402
from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402

Params = dict[str, Any]


class ByteBlocks:
    """Sample i: the `block` bytes at offset i*block (inputs) and the same shifted by one."""

    def __init__(self, data: bytes, block: int) -> None:
        self.data = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        s = i * self.block
        chunk = self.data[s : s + self.block + 1]
        return chunk[:-1], chunk[1:]


def init_params(key: jax.Array, vocab: int, block: int, d: int, layers: int) -> Params:
    keys = iter(jax.random.split(key, 3 + 4 * layers))

    def dense(n_in: int, n_out: int) -> jax.Array:
        return jax.random.normal(next(keys), (n_in, n_out)) * 0.02

    def norm() -> dict[str, jax.Array]:
        return {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    return {
        "tok": dense(vocab, d),
        "pos": dense(block, d),
        "blocks": [
            {
                "ln1": norm(),
                "qkv": dense(d, 3 * d),
                "proj": dense(d, d) / math.sqrt(2 * layers),
                "ln2": norm(),
                "fc": dense(d, 4 * d),
                "fc_b": jnp.zeros(4 * d),
                "out": dense(4 * d, d) / math.sqrt(2 * layers),
                "out_b": jnp.zeros(d),
            }
            for _ in range(layers)
        ],
        "ln": norm(),
        "head": dense(d, vocab),
    }


def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def dropout(x: jax.Array, rate: float, key: jax.Array) -> jax.Array:
    if rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def forward(params: Params, idx: jax.Array, key: jax.Array, heads: int, rate: float) -> jax.Array:
    b, t = idx.shape
    x = params["tok"][idx] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    keys = jax.random.split(key, len(params["blocks"]))
    for blk, k in zip(params["blocks"], keys, strict=True):
        h = layer_norm(x, blk["ln1"])
        q, kk, v = jnp.split(h @ blk["qkv"], 3, axis=-1)
        d = q.shape[-1] // heads
        q, kk, v = (a.reshape(b, t, heads, d).transpose(0, 2, 1, 3) for a in (q, kk, v))
        att = (q @ kk.transpose(0, 1, 3, 2)) / math.sqrt(d)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        a = (att @ v).transpose(0, 2, 1, 3).reshape(b, t, heads * d)
        x = x + dropout(a @ blk["proj"], rate, k)
        h = layer_norm(x, blk["ln2"])
        x = x + jax.nn.gelu(h @ blk["fc"] + blk["fc_b"]) @ blk["out"] + blk["out_b"]
    return layer_norm(x, params["ln"]) @ params["head"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    def loss_fn(params: Params, batch: Any, key: jax.Array) -> jax.Array:
        x, y = batch
        logits = forward(params, x, key, args.heads, args.dropout)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    # Identical initial params on every member (same seed); a replacement's are
    # overwritten by the heal anyway.
    params = init_params(jax.random.PRNGKey(args.seed), 256, args.block, args.dim, args.layers)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, weight_decay=0.01))
    cfg = TrainerConfig(
        global_batch_size=args.batch,
        micro_batch_size=args.micro,
        total_steps=args.steps,
        seed=args.seed,
    )
    trainer = JaxElasticTrainer(
        params, optimizer, ByteBlocks(stdlib_corpus(), args.block), loss_fn, cfg
    )
    for r in trainer.steps():
        if r.rank == 0 and (r.step % 10 == 0 or r.step == trainer.config.total_steps - 1):
            print(
                f"step {r.step} loss {r.loss:.4f} ppl {math.exp(r.loss):.1f} "
                f"members {r.members} gen {r.gen}",
                flush=True,
            )


if __name__ == "__main__":
    main()

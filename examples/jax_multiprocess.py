"""The small GPT of `jax_gpt.py`, its parameters sharded over a 2-process mesh in each replica.

    pip install 'elastrain[jax]'
    elastrain run -n 4 --replica-procs 2 examples/jax_multiprocess.py -- --steps 60
    elastrain run -n 4 --replica-procs 2 --fault kill@20 examples/jax_multiprocess.py -- --steps 60

As MaxText runs a slice of several hosts: each replica is 2 processes of one
`jax.distributed` runtime (elastrain starts them and hands them its
coordinator address), every weight split by rows over the replica's ``fsdp``
axis (the default partition; pass ``specs=`` for your own), one micro-batch
per process per round. Replicas are data parallel: process k of each replica
holds the same rows (twins), and their gradients are summed across replicas.
Kill a process and its replica is rebuilt as 2 fresh processes, healed shard by
shard from their twins, while the other replica trains on (docs/guide/jax.md).

The update runs on each process's rows alone, so the optimizer is an
element-wise one (adamw) and the gradient is clipped by the trainer
(``max_grad_norm``, ``--clip``): by the global norm over every shard of the
replica, summed with the step's commit vote, the same on every process.
``optax.clip_by_global_norm`` in the chain would clip each shard by its own norm.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import argparse  # noqa: E402
import math  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import optax  # noqa: E402
from jax_gpt import ByteBlocks, Params, forward, init_params  # noqa: E402

from elastrain.demo.gpt import stdlib_corpus  # noqa: E402
from elastrain.jax import JaxElasticTrainer, TrainerConfig  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--clip", type=float, default=1.0, help="max global gradient norm (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--procs", type=int, default=2, help="processes per replica (--replica-procs)")
    args = ap.parse_args(argv)

    def loss_fn(params: Params, batch: Any, key: jax.Array) -> jax.Array:
        x, y = batch
        logits = forward(params, x, key, args.heads, args.dropout)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    params = init_params(jax.random.PRNGKey(args.seed), 256, args.block, args.dim, args.layers)
    cfg = TrainerConfig(
        global_batch_size=args.batch,
        micro_batch_size=args.micro,
        total_steps=args.steps,
        seed=args.seed,
        replica_procs=args.procs,
        max_grad_norm=args.clip or None,
    )
    trainer = JaxElasticTrainer(
        params,
        optax.adamw(args.lr, weight_decay=0.01),
        ByteBlocks(stdlib_corpus(), args.block),
        loss_fn,
        cfg,
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

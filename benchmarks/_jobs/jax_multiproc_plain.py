"""The steady step of a plain multi-process JAX run (no elastrain), for comparison
with `elastrain run -n 2 --replica-procs 2 examples/jax_multiprocess.py`.

    .venv/bin/python benchmarks/_jobs/jax_multiproc_plain.py [--procs 2] [--steps 30]

Starts `--procs` processes of one `jax.distributed` runtime (gloo CPU
collectives) training examples/jax_multiprocess.py's GPT with the same
layout (every leaf's rows over the ``fsdp`` axis), batch (global 32,
micro-batch 4, one micro-batch per process per round) and adamw: per round
one jitted value-and-grad over the sharded params, summed over the rounds
inside the jitted round, then one jitted update of the global arrays. Prints the median
step time over the steps after the first 5 (compile). Not a record of the
benchmark harness: its numbers are quoted in docs/guide/jax.md.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def worker(proc: int, procs: int, address: str, steps: int) -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=procs, process_id=proc)
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    sys.path.insert(0, str(ROOT / "examples"))
    from jax_gpt import ByteBlocks, forward, init_params

    from elastrain.demo.gpt import stdlib_corpus

    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    params = init_params(jax.random.PRNGKey(0), 256, 64, 64, 2)

    def spec(x: Any) -> PartitionSpec:
        return PartitionSpec("fsdp") if x.shape and x.shape[0] % procs == 0 else PartitionSpec()

    specs = jax.tree_util.tree_map(spec, params)
    shard = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)

    def place(x: Any, sh: NamedSharding) -> Any:
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sh, lambda i: host[i])

    params = jax.tree_util.tree_map(place, params, shard)
    opt = optax.adamw(3e-3, weight_decay=0.01)
    opt_state = jax.jit(opt.init)(params)
    data = ByteBlocks(stdlib_corpus(), 64)
    rows = NamedSharding(mesh, PartitionSpec("fsdp"))

    def loss_fn(p, batch, key):  # type: ignore[no-untyped-def]
        x, y = batch
        logits = forward(p, x, key, 4, 0.1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    replicated = NamedSharding(mesh, PartitionSpec())

    @partial(jax.jit, out_shardings=(replicated, shard))
    def grad_round(p, batches, keys, total):  # type: ignore[no-untyped-def]
        def one(b, k):  # type: ignore[no-untyped-def]
            return jax.value_and_grad(loss_fn)(p, b, k)

        losses, grads = jax.vmap(one)(batches, keys)
        return losses.sum() * 4, jax.tree_util.tree_map(lambda t, g: t + g.sum(0) * 4, total, grads)

    step_key = jax.jit(lambda step, i: jax.random.key_data(
        jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(0), step), i)))  # fmt: skip
    zeros = jax.jit(lambda p: jax.tree_util.tree_map(jax.numpy.zeros_like, p), out_shardings=shard)

    @partial(jax.jit, out_shardings=(shard, None))
    def update(p, s, g):  # type: ignore[no-untyped-def]
        g = jax.tree_util.tree_map(lambda x: x / 32, g)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s

    rounds = 32 // 4 // procs
    times = []
    for step in range(steps):
        t = time.monotonic()
        total = zeros(params)
        for r in range(rounds):
            i = (step * rounds + r) * procs + proc
            xs = np.stack([data[i * 4 + j][0] for j in range(4)])[None]
            ys = np.stack([data[i * 4 + j][1] for j in range(4)])[None]
            key = np.asarray(step_key(step, i))
            batches = tuple(jax.make_array_from_process_local_data(rows, a) for a in (xs, ys))
            keys = jax.make_array_from_process_local_data(rows, key[None])
            _, total = grad_round(params, batches, keys, total)
        params, opt_state = update(params, opt_state, total)
        jax.block_until_ready(params)
        times.append(time.monotonic() - t)
    if proc == 0:
        print(f"plain {procs}-process JAX: median step {statistics.median(times[5:]):.4f} s "
              f"over {steps - 5} steps", flush=True)  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--address", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.procs, args.address, args.steps)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(k),
                "--procs",
                str(args.procs),
                "--steps",
                str(args.steps),
                "--address",
                address,
            ],
            env=env,
        )  # fmt: skip
        for k in range(args.procs)
    ]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())

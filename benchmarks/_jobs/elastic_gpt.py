"""The elastrain side of benchmarks/recovery.py: one ElasticTrainer worker.

Started by the launcher (`Launcher(LaunchConfig(script=this, ...))`); the
launcher's `steps` sets the number of steps. Shape arguments must match the
DDP baseline's (benchmarks/_jobs/ddp_gpt.py); recovery.py passes the same ones.
With BENCH_GATE set, the worker pauses between blocks of steps so that the
benchmark can interleave it with the DDP baseline (see common.Gate).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from common import Gate, add_shape_arguments, build, loss_fn, shape_of  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    add_shape_arguments(ap)
    ap.add_argument(
        "--reduce-dtype", default="float64", help="TrainerConfig.reduce_dtype (float64, native)"
    )
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = shape_of(a)
    model, opt, data = build(shape)
    cfg = TrainerConfig(
        global_batch_size=shape.global_batch,
        micro_batch_size=shape.micro_batch,
        total_steps=a.steps,
        seed=shape.seed,
        reduce_dtype=a.reduce_dtype,
    )
    trainer = ElasticTrainer(model, opt, data, loss_fn, cfg)
    gate = None
    if os.environ.get("BENCH_GATE"):
        # "host:port,warmup,block,blocks": take turns with the DDP baseline (see Gate).
        addr, w, b, n = os.environ["BENCH_GATE"].split(",")
        gate = Gate(addr, "E", int(os.environ.get("BENCH_WORLD", "4")), int(w), int(b), int(n))
    for r in trainer.steps():
        if gate is not None:
            gate.after_step(r.step + 1)
        if r.rank == 0 and r.step % 10 == 0:
            print(f"step {r.step} loss {r.loss:.4f} members {r.members} gen {r.gen}", flush=True)


if __name__ == "__main__":
    main()

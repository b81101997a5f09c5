"""The elastrain side of benchmarks/sharded.py: one ElasticTrainer worker, sharded or not.

Started by the launcher (`Launcher(LaunchConfig(script=this, shard_size=S, ...))`):
the launcher's `shard_size` sets `TrainerConfig.shard_size` (over this script's
--shard-size, 1) and its `steps` the number of steps. Shape arguments must
match the HSDP baseline's (benchmarks/_jobs/hsdp_gpt.py); sharded.py passes
the same ones.

Environment (all optional):
  BENCH_GATE     "host:port,warmup,block,blocks": pause between blocks of steps
                 so that the benchmark can interleave this job with the
                 baselines (common.Gate); BENCH_SIDE names this side (E, N),
                 BENCH_WORLD the workers that report to the gate (4).
  BENCH_RSS_DIR  at a clean end, write <member>.json there: resident size
                 after the imports, after building the full model, and the
                 process's peak (VmHWM), in kB (common.proc_status_kb), and
                 the bytes of the full model's parameters still held (the
                 storage of every parameter the script built that is still
                 alive: a sharded member keeps the Parameter objects but
                 frees their storage).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import weakref

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed.device_mesh  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
from common import Gate, add_shape_arguments, build, loss_fn, proc_status_kb, shape_of  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402


def main() -> None:
    # The baseline: torch, FSDP2 and elastrain imported, nothing of this job allocated
    # yet. (The sharded trainer imports FSDP2 only when it builds its first wrapper;
    # importing it here gives every side of sharded.py the same libraries in its
    # baseline, hsdp_gpt.py included.)
    rss_imports = proc_status_kb("VmRSS")
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--shard-size", type=int, default=1, help="TrainerConfig.shard_size")
    ap.add_argument(
        "--reduce-dtype", default="float64", help="TrainerConfig.reduce_dtype (float64, native)"
    )
    ap.add_argument("--clip", type=float, default=None, help="TrainerConfig.max_grad_norm")
    add_shape_arguments(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = shape_of(a)
    # Every member starts from the same full, materialised model (the sharded
    # trainer needs one today); it keeps only its shard's rows after its first
    # generation.
    model, opt, data = build(shape)
    rss_built = proc_status_kb("VmRSS")
    cfg = TrainerConfig(
        global_batch_size=shape.global_batch,
        micro_batch_size=shape.micro_batch,
        total_steps=a.steps,
        seed=shape.seed,
        shard_size=a.shard_size,
        reduce_dtype=a.reduce_dtype,
        max_grad_norm=a.clip,
    )
    trainer = ElasticTrainer(model, opt, data, loss_fn, cfg)
    # This script's own references would keep the full parameters alive; what
    # stays resident after this is what the trainer itself holds on to. The probes
    # tell, at the end, how many bytes of the full model's parameters anything
    # still holds (a sharded member needs only its shard's rows after its first
    # generation).
    probes = [weakref.ref(p) for p in model.parameters()]
    del model, opt
    gate = None
    if os.environ.get("BENCH_GATE"):
        addr, w, b, n = os.environ["BENCH_GATE"].split(",")
        side = os.environ.get("BENCH_SIDE", "E")
        world = int(os.environ.get("BENCH_WORLD", "4"))
        gate = Gate(addr, side, world, int(w), int(b), int(n))
    for r in trainer.steps():
        if gate is not None:
            gate.after_step(r.step + 1)
        if r.rank == 0 and r.step % 10 == 0:
            print(f"step {r.step} loss {r.loss:.4f} members {r.members} gen {r.gen}", flush=True)
    rss_dir = os.environ.get("BENCH_RSS_DIR")
    if rss_dir:
        gc.collect()
        out = {
            "member": trainer.member,
            "pid": os.getpid(),
            "shard_size": trainer.config.shard_size,
            "rss_imports_kb": rss_imports,
            "rss_built_kb": rss_built,
            "rss_end_kb": proc_status_kb("VmRSS"),
            "hwm_kb": proc_status_kb("VmHWM"),
            "full_params_bytes": sum(
                p.untyped_storage().nbytes() for p in (r() for r in probes) if p is not None
            ),
        }
        with open(os.path.join(rss_dir, f"{trainer.member}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

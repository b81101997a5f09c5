"""The job of benchmarks/meta_start.py: one sharded ElasticTrainer worker on the demo GPT,
its model built on the meta device or materialised whole.

Started by the launcher (`Launcher(LaunchConfig(script=this, shard_size=S, ...))`;
the launcher's shard size sets `TrainerConfig.shard_size`, its `steps` the steps).

--build meta   `with torch.device("meta"): GPT(...)`: the trainer initialises only
               this member's rows, module by module (elastrain.runtime.meta_init);
--build whole  the same GPT materialised whole in every process, from the same seed
               (what a fresh sharded job needed before), and freed once the shard is
               taken.

At a clean end it writes <member>.json into BENCH_RSS_DIR: the resident size
after the imports and after building the model, the peak (VmHWM) when the
first forward begins (the start: construction, rendezvous, taking the shard,
the first FSDP2 wrapper; read in the loss function's first call on real tensors,
before it computes), after the first step and at the end, in kB, with the member's slot.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed.device_mesh  # noqa: E402, F401
import torch.distributed.fsdp  # noqa: E402, F401
from common import add_shape_arguments, build, loss_fn, proc_status_kb, shape_of  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402
from elastrain.demo.gpt import GPT, ByteBlocks, stdlib_corpus  # noqa: E402
from elastrain.runtime.sharded import ShardedBackend  # noqa: E402


def main() -> None:
    rss_imports = proc_status_kb("VmRSS")
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--shard-size", type=int, default=2)
    ap.add_argument("--build", choices=["meta", "whole"], required=True)
    add_shape_arguments(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = shape_of(a)
    if a.build == "whole":
        model, opt, data = build(shape)
    else:
        with torch.device("meta"):
            model = GPT(block=shape.block, d=shape.dim, layers=shape.layers, heads=shape.heads)
        opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)
        data = ByteBlocks(stdlib_corpus(), shape.block)
    rss_built = proc_status_kb("VmRSS")
    cfg = TrainerConfig(
        global_batch_size=shape.global_batch,
        micro_batch_size=shape.micro_batch,
        total_steps=a.steps,
        seed=shape.seed,
        shard_size=a.shard_size,
    )
    first: list[int] = []

    def timed_loss(m: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        # The trainer counts the step's FLOPs on the meta device before the rendezvous
        # (a call with meta tensors): the start ends at the first real forward.
        if not first and batch[0].device.type != "meta":
            first.append(proc_status_kb("VmHWM"))
        return loss_fn(m, batch)

    trainer = ElasticTrainer(model, opt, data, timed_loss, cfg)
    del model, opt
    hwm_first = -1
    for r in trainer.steps():
        if hwm_first < 0:
            hwm_first = proc_status_kb("VmHWM")
        if r.rank == 0:
            print(f"step {r.step} loss {r.loss:.4f} step_s {r.step_s:.2f}", flush=True)
    rss_dir = os.environ.get("BENCH_RSS_DIR")
    if rss_dir:
        backend = trainer.backend
        assert isinstance(backend, ShardedBackend)
        out = {
            "member": trainer.member,
            "build": a.build,
            "shard_size": backend.shard_size,
            "shard": backend.shard,
            "rss_imports_kb": rss_imports,
            "rss_built_kb": rss_built,
            "hwm_start_kb": first[0] if first else -1,
            "hwm_first_step_kb": hwm_first,
            "rss_end_kb": proc_status_kb("VmRSS"),
            "hwm_kb": proc_status_kb("VmHWM"),
        }
        with open(os.path.join(rss_dir, f"{trainer.member}.json"), "w") as f:
            json.dump(out, f)


if __name__ == "__main__":
    main()

"""The baseline side of benchmarks/sharded.py: plain FSDP2 HSDP on gloo, no elastrain.

    python hsdp_gpt.py RANK WORLD STORE_PORT OUT_JSON --shard-size S --warmup-steps W
        --block-steps B --blocks N [--scatter-every-micro] [--reduce-fp64] [shape args]

The parent (sharded.py) hosts a TCPStore; every rank joins it with
`init_process_group("gloo", store=PrefixStore("hsdp-SIDE", store))` (no
torch.distributed.run), builds `init_device_mesh("cpu", (WORLD // S, S),
mesh_dim_names=("replicate", "shard"))` and wraps every transformer block, then
the root, with `fully_shard` on that mesh: FSDP2's hybrid sharding (shards
inside a replica group, gradients all-reduced across groups). It takes turns
with the elastrain job through the same store (common.Gate): W warm-up steps,
then N blocks of B steps.

Each step runs elastrain's data pipeline: the step's micro-batches come from
the same seeded global order and `assign_microbatches` over the WORLD ranks,
each micro-batch under the same forked, reseeded RNG. Gradient accumulation
across a rank's micro-batches is FSDP2's usual one: `set_requires_gradient_sync
(False)` on all but the rank's last micro-batch (unsharded gradients accumulate
locally; one reduce-scatter and one all-reduce per step), float32 reduction.
With --scatter-every-micro every micro-batch's backward reduce-scatters inside
the replica group (FSDP2 accumulates the sharded gradients) and only the last
one all-reduces across the groups (`set_requires_all_reduce`); with
--reduce-fp64 the reductions run in float64. Together: the communication of
elastrain's sharded step (a float64 reduce-scatter per micro-batch, one float64
all-reduce of the shard's sum over the twins per step), for attribution. The loss
is scaled so that FSDP2's mean over the WORLD ranks gives the same
sum/global-batch gradient as elastrain. AdamW with the same hyperparameters is
built over the sharded parameters after `fully_shard`.

Writes to OUT_JSON: per step step_s (step start to after optimizer.step), end_t,
local_loss, last_microbatch_s (the last micro-batch: forward, backward and the
step's reduction) and opt_s; resident size after the imports, after building
the full model, after sharding, and the peak (VmHWM), in kB.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from common import Gate, accumulate, add_shape_arguments, build, proc_status_kb, shape_of  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches  # noqa: E402


def main() -> None:
    rss_imports = proc_status_kb("VmRSS")
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("port", type=int)
    ap.add_argument("out")
    ap.add_argument("--shard-size", type=int, required=True)
    ap.add_argument("--warmup-steps", type=int, required=True)
    ap.add_argument("--block-steps", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    add_shape_arguments(ap)
    ap.add_argument("--scatter-every-micro", action="store_true")
    ap.add_argument("--reduce-fp64", action="store_true")
    ap.add_argument("--side", default="H", help="this baseline's name for the gate (H)")
    ap.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this norm")
    a = ap.parse_args()
    if a.world % a.shard_size:
        ap.error(f"world {a.world} is not a multiple of --shard-size {a.shard_size}")
    torch.set_num_threads(1)
    shape = shape_of(a)
    B, W = shape.global_batch, a.world
    mbs_per_step = len(step_microbatches(0, B, shape.micro_batch))
    if mbs_per_step % W:
        # FSDP2's collectives pair up per micro-batch: every rank needs as many.
        ap.error(f"{mbs_per_step} micro-batches per step do not split evenly over {W} ranks")
    gate = Gate(f"127.0.0.1:{a.port}", a.side, W, a.warmup_steps, a.block_steps, a.blocks)
    store = dist.TCPStore(
        "127.0.0.1", a.port, W, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"hsdp-{a.side}", store), rank=a.rank, world_size=W,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    mesh = init_device_mesh(
        "cpu", (W // a.shard_size, a.shard_size), mesh_dim_names=("replicate", "shard")
    )
    # The same full initial model as elastrain's members (build() seeds it); the
    # optimizer it returns holds the unsharded parameters, so it is dropped and a
    # new one built over the sharded ones.
    model, opt, data = build(shape)
    del opt
    rss_built = proc_status_kb("VmRSS")
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float64 if a.reduce_fp64 else None)
    for blk in model.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)
    rss_sharded = proc_status_kb("VmRSS")
    order = GlobalOrder(len(data), shape.seed, shuffle=True)
    step_s: list[float] = []
    end_t: list[float] = []
    losses: list[float] = []
    last_s: list[float] = []
    opt_s: list[float] = []

    def sync(last: bool) -> contextlib.nullcontext[None]:
        # Only the rank's last micro-batch reduce-scatters (or, with
        # --scatter-every-micro, every one does and only the last all-reduces).
        if a.scatter_every_micro:
            model.set_requires_all_reduce(last)  # type: ignore[operator]
        else:
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    for s in range(gate.total_steps):
        t0 = time.monotonic()
        mbs = step_microbatches(s, B, shape.micro_batch)
        mine = assign_microbatches(len(mbs), W, a.rank)
        model.train()
        loss_sum, t_last = accumulate(model, data, order, shape, s, mbs, mine, W, sync)
        t_opt = time.monotonic()
        if a.clip is not None:  # the global norm: FSDP2's DTensor gradients over the mesh
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.monotonic()
        last_s.append(t_opt - t_last)
        opt_s.append(t1 - t_opt)
        step_s.append(t1 - t0)
        end_t.append(time.time())
        losses.append(loss_sum / max(1, sum(len(mbs[i]) for i in mine)))
        gate.after_step(s + 1)
    dist.barrier()
    with open(a.out, "w") as f:
        json.dump(
            {"rank": a.rank, "step_s": step_s, "end_t": end_t, "local_loss": losses,
             "last_microbatch_s": last_s, "opt_s": opt_s, "pid": os.getpid(),
             "rss_imports_kb": rss_imports, "rss_built_kb": rss_built,
             "rss_sharded_kb": rss_sharded, "rss_end_kb": proc_status_kb("VmRSS"),
             "hwm_kb": proc_status_kb("VmHWM")},
            f,
        )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""The baseline side of benchmarks/recovery.py: plain DistributedDataParallel on gloo.

    python ddp_gpt.py RANK WORLD STORE_PORT OUT_JSON --warmup-steps W --block-steps B
        --blocks N [shape args]

The parent (recovery.py) hosts a TCPStore; every rank joins it with
`init_process_group("gloo", store=PrefixStore("ddp-SIDE", store))` (no
torch.distributed.run) and takes turns with the elastrain job through the same
store (common.Gate): W warm-up steps, then N blocks of B steps. Each step
runs exactly elastrain's data pipeline: the step's micro-batches come from the
same seeded global order and `assign_microbatches`, each micro-batch under the
same forked, reseeded RNG; backward under `no_sync()` for all but this rank's
last micro-batch, then `optimizer.step()`. The loss is scaled so that DDP's
mean over ranks gives the same sum/global-batch gradient as elastrain.
Writes per-step timings to OUT_JSON: step_s (step start to after
optimizer.step), end_t (wall time at the end of each step), last_microbatch_s
(the synchronising micro-batch: forward, backward and DDP's all-reduce) and
opt_s (optimizer step).
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
from common import Gate, accumulate, add_shape_arguments, build, shape_of  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("rank", type=int)
    ap.add_argument("world", type=int)
    ap.add_argument("port", type=int)
    ap.add_argument("out")
    ap.add_argument("--warmup-steps", type=int, required=True)
    ap.add_argument("--block-steps", type=int, required=True)
    ap.add_argument("--blocks", type=int, required=True)
    add_shape_arguments(ap)
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP bucket_cap_mb")
    ap.add_argument("--grad-as-bucket-view", action="store_true")
    ap.add_argument("--side", default="D", help="this baseline's name for the gate (D)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    shape = shape_of(a)
    gate = Gate(f"127.0.0.1:{a.port}", a.side, a.world, a.warmup_steps, a.block_steps, a.blocks)
    store = dist.TCPStore(
        "127.0.0.1", a.port, a.world, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"ddp-{a.side}", store), rank=a.rank, world_size=a.world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    model, opt, data = build(shape)
    kw: dict[str, object] = {}
    if a.bucket_cap_mb is not None:
        kw["bucket_cap_mb"] = a.bucket_cap_mb
    if a.grad_as_bucket_view:
        kw["gradient_as_bucket_view"] = True
    ddp = DDP(model, **kw)  # type: ignore[arg-type]
    order = GlobalOrder(len(data), shape.seed, shuffle=True)
    B, W = shape.global_batch, a.world
    step_s: list[float] = []
    end_t: list[float] = []
    losses: list[float] = []
    sync_s: list[float] = []
    opt_s: list[float] = []
    for s in range(gate.total_steps):
        t0 = time.monotonic()
        mbs = step_microbatches(s, B, shape.micro_batch)
        mine = assign_microbatches(len(mbs), W, a.rank)
        ddp.train()
        loss_sum, t_last = accumulate(
            ddp, data, order, shape, s, mbs, mine, W,
            lambda last: contextlib.nullcontext() if last else ddp.no_sync(),
        )  # fmt: skip
        t_opt = time.monotonic()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.monotonic()
        sync_s.append(t_opt - t_last)
        opt_s.append(t1 - t_opt)
        step_s.append(t1 - t0)
        end_t.append(time.time())
        losses.append(loss_sum / max(1, sum(len(mbs[i]) for i in mine)))
        gate.after_step(s + 1)
    dist.barrier()
    with open(a.out, "w") as f:
        json.dump(
            {"rank": a.rank, "step_s": step_s, "end_t": end_t, "local_loss": losses,
             "last_microbatch_s": sync_s, "opt_s": opt_s},
            f,
        )  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

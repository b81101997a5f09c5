"""The baseline side of benchmarks/data.py: plain DDP under torchrun, loading with
a `torch.utils.data.DataLoader(num_workers=K)`.

    python -m torch.distributed.run --standalone --nproc-per-node W ddp_data.py \
        --out FILE --steps S --num-workers K [settings]

The data is exactly the elastrain job's: the same dataset, the same seeded
global order (elastrain's default kind), step s's micro-batches split over the
ranks by `assign_microbatches`. The DataLoader gets this rank's micro-batches
of every step, in order, as its batch sampler, so its workers load ahead the
way DataLoader users run it (prefetch_factor 2 per worker). Each step:
backward under `no_sync()` for all but this rank's last micro-batch, then
`optimizer.step()`; the loss is scaled so that DDP's mean over ranks is the
sum over the global batch divided by its size (elastrain's math). Rank 0
writes the wall time at the end of each step, and the time each step waited
for its batches, to FILE (JSON).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from decode import Settings, build, loss_fn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches  # noqa: E402


class RankMicroBatches(torch.utils.data.Sampler[list[int]]):
    """This rank's micro-batches of steps 0..steps-1, as lists of sample ids."""

    def __init__(self, order: GlobalOrder, s: Settings, steps: int, rank: int, world: int):
        self.order, self.s, self.steps, self.rank, self.world = order, s, steps, rank, world

    def plan(self, step: int) -> list[int]:
        n = self.s.batch // self.s.micro
        return assign_microbatches(n, self.world, self.rank)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.steps):
            mbs = step_microbatches(step, self.s.batch, self.s.micro)
            for i in self.plan(step):
                yield self.order.ids(mbs[i].start, mbs[i].stop)

    def __len__(self) -> int:
        return self.steps * len(self.plan(0))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--num-workers", type=int, default=2)
    Settings.add_arguments(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)
    s = Settings.of(a)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt, data = build(s)
    ddp = DDP(model)
    sampler = RankMicroBatches(GlobalOrder(len(data), s.seed), s, a.steps, rank, world)
    kw = {"prefetch_factor": 2, "persistent_workers": True} if a.num_workers else {}
    loader = torch.utils.data.DataLoader(
        data, batch_sampler=sampler, num_workers=a.num_workers, **kw
    )
    it = iter(loader)
    per_step = len(sampler.plan(0))
    end_t: list[float] = []
    wait_s: list[float] = []
    for _ in range(a.steps):
        waited = 0.0
        for k in range(per_step):
            t0 = time.monotonic()
            batch = next(it)
            waited += time.monotonic() - t0
            last = k == per_step - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = loss_fn(ddp, batch)
                (loss * (len(batch[0]) * world / s.batch)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        end_t.append(time.time())
        wait_s.append(waited)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"end_t": end_t, "data_s": wait_s}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

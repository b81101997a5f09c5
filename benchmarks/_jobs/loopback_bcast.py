"""The reference rate for a heal in benchmarks/recovery.py and sharded.py: a plain gloo broadcast over loopback.

    python loopback_bcast.py RANK STORE_PORT NBYTES REPS OUT_JSON

Two processes (RANK 0 sends, RANK 1 receives) join the parent's TCPStore with
`init_process_group("gloo", store=PrefixStore("bcast", store))` and broadcast
one float32 tensor of NBYTES (rounded down to whole floats) from rank 0: one
untimed warm-up, then REPS timed broadcasts, each after a barrier so that both
ranks start it together. No sealing, no manifest, no striping: the bare
transport a heal runs over. Then REPS more into a freshly allocated tensor on
rank 1 each time, as a heal's receiver lands its state in memory it has not
touched yet (the first-touch page faults cost the receiver about as much as
the copy). Rank 1 writes the per-broadcast seconds of both and the bytes to
OUT_JSON.
"""

from __future__ import annotations

import datetime
import json
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank, port, nbytes, reps, out = (
        int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5],
    )  # fmt: skip
    torch.set_num_threads(1)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("bcast", store), rank=rank, world_size=2,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    n = max(1, nbytes // 4)
    t = torch.randn(n) if rank == 0 else torch.empty(n)
    dist.broadcast(t, src=0)  # warm-up: connections, first-touch of the pages
    seconds = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.monotonic()
        dist.broadcast(t, src=0)
        seconds.append(time.monotonic() - t0)
    fresh = []
    for _ in range(reps):
        u = t if rank == 0 else torch.empty(n)
        dist.barrier()
        t0 = time.monotonic()
        dist.broadcast(u, src=0)
        fresh.append(time.monotonic() - t0)
        del u
    if rank == 1:
        with open(out, "w") as f:
            json.dump({"bytes": n * 4, "seconds": seconds, "fresh_seconds": fresh}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

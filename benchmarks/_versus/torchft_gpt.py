"""The torchft side of benchmarks/versus.py: one replica group of one process.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT python torchft_gpt.py --out DIR --group G \
        --groups 4 --mode ddp|flat --gate HOST:PORT [--join] [shape]

Set up the way torchft's own example (train_ddp.py) runs it on CPU: a
`torchft.Manager` with `min_replica_size=1`, `ProcessGroupGloo(timeout=5 s)`,
a manager timeout of 30 s, the default HTTP checkpoint transport for healing,
`torchft.Optimizer` around AdamW, and either torchft's own
`DistributedDataParallel` wrapper (--mode ddp) or, instead of the wrapper, one
flat `manager.allreduce(...)` of all gradients after backward (--mode flat).
Every replica starts from the same seeded weights (`init_sync=False`, as
torchft's docs advise for that case). The replica group's own TCPStore is
hosted by this process.

Data: step-based, as torchft advises with faults: step s (the manager's
current step) takes positions [s*B, (s+1)*B) of elastrain's seeded global
order; replica group G of the fixed 4 computes the micro-batches
`assign_microbatches(M, 4, G)`, with the same reseeded RNG per micro-batch and
its gradient scaled to the mean over its share, so that torchft's average
over the participating groups is sum / global batch when all 4 take part.
When fewer take part (one is dead, or healing), the step is committed over
fewer samples (torchft's default WorldSizeMode.DYNAMIC divides by the number
of participants): the missing group's share of that step is never trained on.

The first replicas wait at a start gate (a key count in the benchmark's
TCPStore) so that the first quorum has all of them, as elastrain's and
torchrun's rendezvous do; a replacement (--join) skips it and heals from a
peer. Runs until killed. Writes `DIR/g<G>.<pid>.jsonl` (see steplog.py):
start, ready, commit/abort per step with the quorum id, whether this group
participated, the number of participants, and its local loss.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "_jobs"))

from steplog import StepLog  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--group", type=int, required=True)
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--mode", choices=("ddp", "flat"), required=True)
    ap.add_argument("--gate", required=True, help="HOST:PORT of the benchmark's TCPStore")
    ap.add_argument("--join", action="store_true", help="a replacement: no start gate")
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="gloo timeout, s (5)")
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--micro", type=int, required=True)
    a = ap.parse_args()
    out = Path(a.out)
    log = StepLog(out / f"g{a.group}.{os.getpid()}.jsonl", f"g{a.group}", group=a.group)
    log.emit("start", T_START, join=a.join)

    import torch
    import torch.distributed as dist
    import torchft
    from common import Shape, build, loss_fn, micro_rng_seed
    from torch.utils.data import default_collate

    from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches

    torch.set_num_threads(1)
    shape = Shape(a.dim, a.layers, a.heads, a.block, a.batch, a.micro)
    model, inner_opt, data = build(shape)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=datetime.timedelta(seconds=a.pg_timeout))

    def load_state_dict(sd: dict[str, object]) -> None:
        model.load_state_dict(sd["model"])
        inner_opt.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, object]:
        return {"model": model.state_dict(), "optim": inner_opt.state_dict()}

    manager = torchft.Manager(
        pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
        replica_id=f"versus_{a.group}", timeout=datetime.timedelta(seconds=30),
        store_addr="127.0.0.1", store_port=store.port, rank=0, world_size=1,
        hostname="127.0.0.1", init_sync=False,
    )  # fmt: skip
    net: torch.nn.Module = (
        torchft.DistributedDataParallel(manager, model) if a.mode == "ddp" else model
    )
    opt = torchft.Optimizer(manager, inner_opt)
    params = [p for p in model.parameters() if p.requires_grad]
    order = GlobalOrder(len(data), shape.seed, shuffle=True)
    B, G = shape.global_batch, a.groups
    if not a.join:
        host, port = a.gate.rsplit(":", 1)
        gate = dist.TCPStore(host, int(port), is_master=False)
        gate.add("ready", 1)
        while int(gate.add("ready", 0)) < G:
            time.sleep(0.01)
    log.emit("ready", time.time())
    while True:
        t0 = time.monotonic()
        s = manager.current_step()
        opt.zero_grad()  # starts the (async) quorum
        mbs = step_microbatches(s, B, shape.micro_batch)
        mine = assign_microbatches(len(mbs), G, a.group)
        loss_sum, n = 0.0, 0
        for k, i in enumerate(mine):
            ids = order.ids(mbs[i].start, mbs[i].stop)
            last = k == len(mine) - 1
            ctx = (
                net.no_sync()  # type: ignore[operator]
                if a.mode == "ddp" and not last
                else contextlib.nullcontext()
            )
            with ctx, torch.random.fork_rng(devices=[]):
                torch.manual_seed(micro_rng_seed(shape.seed, s, i))
                batch = default_collate([data[j] for j in ids])
                loss = loss_fn(net, batch)
                # The mean over this group's share; torchft averages over the groups.
                (loss * (len(ids) * G / B)).backward()
            loss_sum += float(loss.detach()) * len(ids)
            n += len(ids)
        if a.mode == "flat":
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            manager.allreduce(flat).wait()
            off = 0
            for p in params:
                k = p.numel()
                p.grad.copy_(flat[off : off + k].view_as(p))
                off += k
        participating = manager.is_participating()
        participants = manager.num_participants()
        quorum = manager._quorum_id
        before = manager.current_step()
        opt.step()  # should_commit, then the inner step if committed
        after = manager.current_step()
        fields = dict(
            loss=loss_sum / max(1, n), n=n, quorum=quorum, participating=participating,
            participants=participants, step_s=time.monotonic() - t0,
        )  # fmt: skip
        if after > before:
            log.emit("commit", time.time(), step=after - 1, **fields)
        else:
            err = manager.errored()
            log.emit("abort", time.time(), step=before, error=str(err)[:200] if err else None,
                     **fields)  # fmt: skip


if __name__ == "__main__":
    main()

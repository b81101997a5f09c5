"""The torchft side ("T") of benchmarks/sharded.py: torchft's HSDP with FSDP2, one rank.

    python torchft_hsdp_gpt.py GROUP RANK --groups R --shard-size S --port STORE_PORT
        --log LOG_JSONL --incarnation N --lighthouse URL [--join] [--pg-timeout 5]
        [--out OUT_JSON --warmup-steps W --block-steps B --blocks N] [shape args]

torchft 0.2.0 has no `ft_init_device_mesh` / `ManagedDeviceMesh` any more (they
were in 0.1.x); its HSDP is the recipe its own FSDP test and torchtitan's
torchft integration use, and this script follows it:

- a replica group is a plain torch.distributed world of S ranks (here: a
  TCPStore hosted by the group's rank 0, `init_process_group("gloo")` over it),
  and `fully_shard` runs on that group's 1-D mesh ("shard"): the shard
  dimension is plain FSDP2, as on the H side;
- the replicate dimension is torchft's: one `torchft.Manager` per rank (group
  rank 0 runs the group's ManagerServer, which talks to the lighthouse), with
  `torchft.ProcessGroupGloo` across the groups (rank r of every group), and
  every FSDP module's `set_all_reduce_hook` all-reduces its reduce-scattered
  gradient shard over `ManagedProcessGroup(manager)` with AVG (the manager's
  fault-tolerant all-reduce: averaged over the groups in the quorum, errors
  swallowed and reported to the manager);
- `torchft.Optimizer` around AdamW (start_quorum at zero_grad, should_commit
  before the inner step); `init_sync=False` (every rank builds the same
  seeded weights, as torchft advises); healing over torchft's default HTTP
  checkpoint transport, rank r of a recovering group fetching rank r's state
  (its shard) from a peer group; the state is each rank's local shards of the
  parameters and of AdamW's moments (plain tensors: DTensors carry a mesh).

Everything else is the H side's (_jobs/hsdp_gpt.py): the same model and initial
weights, micro-batches, per-micro-batch RNG, gradient accumulation
(`set_requires_gradient_sync(False)` on all but the rank's last micro-batch:
one reduce-scatter and one all-reduce per FSDP module per step, float32), loss
scaling (sum / global batch when all R groups take part). Step s is the
manager's step (step-based data, as torchft advises with faults); global rank
GROUP * S + RANK takes `assign_microbatches(M, R * S, rank)`. When a group is
missing or healing the step is committed over the others' share only
(torchft's default WorldSizeMode.DYNAMIC averages over the participants).

With --blocks it takes turns with the other sides (common.Gate, side "T") and
writes OUT_JSON at the end (the H side's fields: step_s, local_loss,
last_microbatch_s, opt_s, RSS); without, it trains until killed (the recovery
run). Always appends JSON lines to LOG_JSONL: `start` (before `import torch`),
`imported` (torch, torchft and the rest imported), `built` (the group's gloo world,
the model and its FSDP2 shards built), `ready` (the manager built; for the first
ranks, after the start barrier), `heal_recv` (a heal's payload
received: tensor bytes, seconds, by the transport), `healed` (the received
state applied), `commit` / `abort` per step (step, step_s, participating,
participants, quorum id, local loss). The first ranks wait for all R * S at a
start barrier (so the first quorum has every group); a restarted group (--join)
skips it and heals from a peer.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchft  # noqa: E402
from common import Gate, accumulate, add_shape_arguments, build, proc_status_kb, shape_of  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp  # noqa: E402
from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402
from torchft.checkpointing.http_transport import HTTPTransport  # noqa: E402
from torchft.process_group import ManagedProcessGroup  # noqa: E402

from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches  # noqa: E402


class EventLog:
    """JSON lines, one per event, flushed at once; written from the training thread
    and torchft's quorum thread (hence the lock)."""

    def __init__(self, path: str, **common: Any) -> None:
        self._f = open(path, "a", buffering=1)  # noqa: SIM115
        self._lock = threading.Lock()
        self._common = {"pid": os.getpid(), **common}

    def emit(self, kind: str, t: float, **fields: Any) -> None:
        line = json.dumps({"t": t, "kind": kind, **self._common, **fields})
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()


def tensor_bytes(obj: object) -> int:
    return sum(x.numel() * x.element_size() for x in tree_flatten(obj)[0] if torch.is_tensor(x))


class TimedHTTPTransport(HTTPTransport):  # type: ignore[type-arg]
    """torchft's default checkpoint transport (HTTP, unchunked), unchanged, with the
    receiving side's payload size and seconds logged: torchft reports neither."""

    def __init__(self, log: EventLog, timeout: datetime.timedelta) -> None:
        super().__init__(timeout=timeout, num_chunks=0)
        self._log = log

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
        t0 = time.time()
        state = super().recv_checkpoint(src_rank, metadata, step, timeout)
        self._log.emit(
            "heal_recv", time.time(), t0=t0, bytes=tensor_bytes(state), step=step, src=src_rank
        )
        return state


def main() -> None:
    t_imported = time.time()
    rss_imports = proc_status_kb("VmRSS")
    ap = argparse.ArgumentParser()
    ap.add_argument("group", type=int)
    ap.add_argument("rank", type=int, help="rank within the replica group")
    ap.add_argument("--groups", type=int, required=True)
    ap.add_argument("--shard-size", type=int, required=True)
    ap.add_argument("--port", type=int, required=True, help="the benchmark's TCPStore")
    ap.add_argument("--log", required=True)
    ap.add_argument("--incarnation", type=int, default=0, help="restarts of this group so far")
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--join", action="store_true", help="a restarted group: no start barrier")
    ap.add_argument("--pg-timeout", type=float, default=5.0, help="torchft gloo timeout, s")
    ap.add_argument("--out", default=None)
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--block-steps", type=int, default=0)
    ap.add_argument("--blocks", type=int, default=0, help="> 0: take turns (common.Gate)")
    ap.add_argument("--clip", type=float, default=None, help="clip_grad_norm_ to this norm")
    add_shape_arguments(ap)
    a = ap.parse_args()
    if a.blocks > 0 and (a.out is None or a.block_steps < 1):
        ap.error("--blocks needs --out and --block-steps")
    G, R, S = a.group, a.rank, a.shard_size
    log = EventLog(a.log, proc=f"g{G}r{R}", group=G, rank=R, inc=a.incarnation)
    log.emit("start", T_START, join=a.join)
    log.emit("imported", t_imported)
    torch.set_num_threads(1)
    shape = shape_of(a)
    B, W = shape.global_batch, a.groups * S
    grank = G * S + R
    mbs_per_step = len(step_microbatches(0, B, shape.micro_batch))
    if mbs_per_step % W:
        ap.error(f"{mbs_per_step} micro-batches per step do not split evenly over {W} ranks")
    bench = dist.TCPStore(
        "127.0.0.1", a.port, is_master=False, timeout=datetime.timedelta(seconds=120)
    )
    # The replica group's own store (torchft's Manager keeps per-group keys in it),
    # one per incarnation of the group, hosted by its rank 0.
    key = f"T/g{G}/i{a.incarnation}/store"
    if R == 0:
        gstore = dist.TCPStore("127.0.0.1", 0, S, is_master=True, wait_for_workers=False)
        bench.set(key, str(gstore.port))
        gport = gstore.port
    else:
        gport = int(bench.get(key))
        gstore = dist.TCPStore("127.0.0.1", gport, S, is_master=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("shard", gstore), rank=R, world_size=S,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (S,), mesh_dim_names=("shard",))
    model, opt0, data = build(shape)
    del opt0  # built over the unsharded parameters; a new one over the shards below
    rss_built = proc_status_kb("VmRSS")
    for blk in model.blocks:  # type: ignore[union-attr]
        fully_shard(blk, mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)
    rss_sharded = proc_status_kb("VmRSS")
    log.emit("built", time.time())
    named = list(model.named_parameters())

    def state_dict() -> dict[str, Any]:
        # This rank's shards only (rank r of a healing group fetches rank r's).
        return {
            "model": {n: p.detach().to_local() for n, p in named},  # type: ignore[attr-defined]
            "optim": {
                i: {k: (v.to_local() if hasattr(v, "to_local") else v) for k, v in st.items()}
                for i, (_, p) in enumerate(named)
                if (st := inner.state.get(p))
            },
        }

    def load_state_dict(sd: dict[str, Any]) -> None:
        with torch.no_grad():
            for n, p in named:
                p.to_local().copy_(sd["model"][n])  # type: ignore[attr-defined]
            for i, (_, p) in enumerate(named):
                got = sd["optim"].get(i)
                if got is None:
                    continue
                st = inner.state[p]
                for k, v in got.items():
                    if k == "step":
                        st[k] = v.clone()
                        continue
                    if k not in st:
                        st[k] = torch.zeros_like(p)
                    st[k].to_local().copy_(v)
        log.emit("healed", time.time(), bytes=tensor_bytes(sd))

    manager = torchft.Manager(
        pg=torchft.ProcessGroupGloo(timeout=datetime.timedelta(seconds=a.pg_timeout)),
        load_state_dict=load_state_dict, state_dict=state_dict, min_replica_size=1,
        timeout=datetime.timedelta(seconds=30), rank=R, world_size=S,
        store_addr="127.0.0.1", store_port=gport, lighthouse_addr=a.lighthouse,
        replica_id=f"sharded_tft_{G}", hostname="127.0.0.1", init_sync=False,
        checkpoint_transport=TimedHTTPTransport(log, datetime.timedelta(seconds=30)),
    )  # fmt: skip
    replicate = ManagedProcessGroup(manager)
    avg = AllreduceOptions()
    avg.reduceOp = ReduceOp.AVG

    def all_reduce_hook(out: torch.Tensor) -> None:
        replicate.allreduce([out], avg).wait()

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(all_reduce_hook)
    opt = torchft.Optimizer(manager, inner)
    gate = (
        Gate(f"127.0.0.1:{a.port}", "T", W, a.warmup_steps, a.block_steps, a.blocks)
        if a.blocks > 0
        else None
    )
    if not a.join:
        bench.add("T/up", 1)
        while int(bench.add("T/up", 0)) < W:
            time.sleep(0.01)
    log.emit("ready", time.time())
    order = GlobalOrder(len(data), shape.seed, shuffle=True)
    step_s: list[float] = []
    end_t: list[float] = []
    losses: list[float] = []
    last_s: list[float] = []
    opt_s: list[float] = []

    def sync(last: bool) -> contextlib.nullcontext[None]:
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        return contextlib.nullcontext()

    while gate is None or manager.current_step() < gate.total_steps:
        t0 = time.monotonic()
        s = manager.current_step()
        opt.zero_grad()  # starts the (async) quorum
        mbs = step_microbatches(s, B, shape.micro_batch)
        mine = assign_microbatches(len(mbs), W, grank)
        model.train()
        # Averaged over the S shards by the reduce-scatter and over the groups by the
        # hook: accumulate's scaling makes the result sum / global batch.
        loss_sum, t_last = accumulate(model, data, order, shape, s, mbs, mine, W, sync)
        t_opt = time.monotonic()
        participating = manager.is_participating()
        participants = manager.num_participants()
        quorum = manager._quorum_id
        if a.clip is not None:  # over the group's shard mesh, after the groups' averaging
            torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()  # should_commit, then AdamW's step if committed
        t1 = time.monotonic()
        committed = manager.current_step() > s
        n = sum(len(mbs[i]) for i in mine)
        log.emit(
            "commit" if committed else "abort", time.time(), step=s, step_s=t1 - t0,
            participating=participating, participants=participants, quorum=quorum,
            loss=loss_sum / max(1, n),
            error=None if committed or not manager.errored() else str(manager.errored())[:300],
        )  # fmt: skip
        if not committed:
            continue
        last_s.append(t_opt - t_last)
        opt_s.append(t1 - t_opt)
        step_s.append(t1 - t0)
        end_t.append(time.time())
        losses.append(loss_sum / max(1, n))
        if gate is not None:
            gate.after_step(s + 1)
    dist.barrier()
    if a.out is not None:
        with open(a.out, "w") as f:
            json.dump(
                {"rank": grank, "step_s": step_s, "end_t": end_t, "local_loss": losses,
                 "last_microbatch_s": last_s, "opt_s": opt_s, "pid": os.getpid(),
                 "rss_imports_kb": rss_imports, "rss_built_kb": rss_built,
                 "rss_sharded_kb": rss_sharded, "rss_end_kb": proc_status_kb("VmRSS"),
                 "hwm_kb": proc_status_kb("VmHWM")},
                f,
            )  # fmt: skip
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""One process of benchmarks/heal_rate.py: elastrain's heal against a plain gloo broadcast.

    python heal_rate_job.py RANK SENDERS STORE_PORT DIM LAYERS HEADS REPS OUT_PREFIX MIN_STRIPE

SENDERS + 1 processes join the parent's TCPStore: ranks 0 .. SENDERS-1 are heal
senders, rank SENDERS the receiver. Every process builds the demo GPT (DIM,
LAYERS, HEADS, context 64) with AdamW, as the benchmarks' jobs do; the senders
from one seed and after one AdamW step on seeded random gradients (so the
optimizer state exists and the payload is about 3 x the params), the receiver
from another seed with no optimizer state, as a replacement starts.

The first heal (the receiver's first ever) is timed on its own; after it and
one untimed warm-up broadcast, each of REPS rounds runs, in this order (so
that a shared machine's load hits them all alike), each after a barrier of
every rank so that they start it together:

1. ``warm``: a plain gloo broadcast of one uint8 tensor of the heal's payload
   bytes from rank 0 to the receiver (a 2-rank group of its own), into memory
   the receiver has touched before;
2. ``fresh``: the same into a tensor the receiver allocated just before it;
3. ``heal``: `elastrain.transfer.heal` of the `TorchState` (the code the
   trainers run, in digest mode, the default: manifest sealed under a job key,
   payload checked by the state digest; ``in_place`` as the trainers'
   `heal_with`: the model's entries land in the receiver's live tensors; striped
   over as many senders as give each stripe MIN_STRIPE bytes, `stripe_senders`,
   0: every sender) from the senders into the receiver, which lands the rest in a `LandingReserve`
   it prepared before the barrier (mapped
   and touched, untimed: a joiner does it while it waits to be admitted), laid
   out there for the layout it expects (`PreparedReceive`, untimed: the
   replicated trainer's receiver does it while the generation's group is
   built), and installs it; every sender flattened and laid out its state and the root
   (rank 0) also computed its digest before the barrier (`PreparedSend`,
   untimed: the replicated trainer's senders do it while the generation's
   group is built);
4. ``mac``: the same heal in mac mode (``heal_auth="mac"``: every stripe
   sealed with Poly1305), into a reserve prepared the same way, its senders'
   flatten and layout prepared the same way;
5. ``cold``: the digest heal with neither: the receiver lands it in memory it
   has not touched yet and the senders flatten and the root digests at the heal (what
   every heal did before the reserve and the preparation);
6. ``floor``: the least any heal that authenticates its bytes must do, with
   nothing else: over the broadcast's 2-rank group, rank 0 seals the payload
   bytes with Poly1305 (the MAC the heal's stripe seals use) in pieces of
   `FLOOR_PIECE` bytes and sends each piece as soon as it is sealed; the
   receiver, its receives all posted into memory it touched before, checks
   each piece's tag as it arrives, and the bytes stay where they landed (no
   install copy, no manifest, no per-tensor work);
7. ``dfloor``: the least a heal checked by the state digest must do, with the
   root's digest prepared: the payload in pieces of `DIGEST_FLOOR_PIECE` bytes
   sent at once, unsealed; the receiver hashes each (XXH3-128, the state
   digest's hash) as it arrives.

Each rank writes, to OUT_PREFIX.RANK, the payload bytes and per round and kind
the wall seconds (from the barrier to its own end of it) and the CPU seconds of
its process (every thread, gloo's included), per heal the part of its own
call that moved the payload (`HealStats.payload_s`; the rest is the flatten,
the manifest rounds and the install), and per reserve the seconds its touching
took (off the clock, as in a joiner). After the last round the ranks
check that the receiver's state hash equals the senders' (exit 3 if not).
Run it with MALLOC_MMAP_THRESHOLD_ set (heal_rate.py does) so that every large
allocation is fresh memory, as in a replacement's first heal.
"""

from __future__ import annotations

import datetime
import functools
import json
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from cryptography.hazmat.primitives.poly1305 import Poly1305

from elastrain.demo.gpt import GPT
from elastrain.transfer import (
    HealAuth,
    LandingReserve,
    PreparedReceive,
    PreparedSend,
    TorchState,
    heal,
    section_bytes,
    state_hash,
)

KEY = b"heal-rate-benchmark-key"
TIMEOUT = datetime.timedelta(seconds=120)
KINDS = ("warm", "fresh", "heal", "mac", "cold", "floor", "dfloor")
FLOOR_PIECE = 4 << 20
"""Bytes per sealed piece of the floor (the heal's stripes are of this order)."""
DIGEST_FLOOR_PIECE = 1 << 20
"""Bytes per piece of the digest floor: the heal's own messages of this state are
at most 1 MiB (its tensors' size; `plan_chunks`), and the receiver hashes each as
it lands, while it is still in the cache. In 4 MiB pieces the hash read bytes that
had left it: a probe of the same 39.7 MB between two processes (2026-12-08, 30
rounds, three runs) hashed as it landed at 0.71-0.81 of the warm broadcast in
4 MiB pieces against 0.81-0.99 in 1 MiB pieces, so a floor of 4 MiB pieces
understated what a digest-checked heal can reach."""


def build(dim: int, layers: int, heads: int, sender: bool) -> TorchState:
    torch.manual_seed(0 if sender else 1)
    model = GPT(block=64, d=dim, layers=layers, heads=heads)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    if sender:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
    return TorchState(model, opt)


def cpu_s() -> float:
    """This process's CPU seconds so far (every thread: gloo's included)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def barrier(pg: Any) -> None:
    pg.allreduce([torch.zeros(1)]).wait()


def same_everywhere(pg: Any, digest: str) -> bool:
    """Whether every rank passed the same hex digest (collective)."""
    h = torch.tensor(list(bytes.fromhex(digest[:16])), dtype=torch.int64)
    hi, lo = h.clone(), h.clone()
    for t, op in ((hi, dist.ReduceOp.MAX), (lo, dist.ReduceOp.MIN)):
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        pg.allreduce([t], opts).wait()
    return torch.equal(hi, lo)


def main() -> None:
    rank, senders, port, dim, layers, heads, reps = (int(a) for a in sys.argv[1:8])
    out, min_stripe = sys.argv[8], int(sys.argv[9])
    torch.set_num_threads(1)
    world, receiver = senders + 1, senders
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=TIMEOUT)
    # Any: torch's stubs do not declare the collectives on the backend classes.
    pg: Any = dist.ProcessGroupGloo(dist.PrefixStore("heal", store), rank, world, TIMEOUT)
    bcast: Any = (
        dist.ProcessGroupGloo(dist.PrefixStore("bcast", store), min(rank, 1), 2, TIMEOUT)
        if rank in (0, receiver)
        else None
    )
    state = build(dim, layers, heads, rank < senders)

    payload_s: dict[str, list[float]] = {"heal": [], "mac": [], "cold": []}
    predicted: dict[str, list[bool]] = {"heal": [], "mac": [], "cold": []}
    """Per heal: the receiver's manifest had the layout it laid out (`HealStats.predicted`)."""
    prepare_s: list[float] = []
    digest_prepare_s: list[float] = []
    """The digest-mode preparations alone (on the root: flatten, layout and digest)."""
    reserve: LandingReserve | None = None
    prepared: PreparedSend | PreparedReceive | None = None

    def prepare(auth: HealAuth = HealAuth.DIGEST) -> None:
        """Before the barrier (untimed): the receiver's landing, mapped and touched, and
        its expected layout laid out in it (`PreparedReceive`); each sender's flatten
        and layout and, on the root in digest mode, its digest (waited for)."""
        nonlocal reserve, prepared
        t0 = time.perf_counter()
        if rank == receiver:
            reserve = LandingReserve(section_bytes(state.landing_estimate()))
            reserve.wait()
            prepared = PreparedReceive(state, reserve)
        else:
            prepared = PreparedSend(state, auth, root=rank == 0)
            digesting = prepared.digesting()
            if digesting is not None:
                digesting.result()
        prepare_s.append(time.perf_counter() - t0)
        if auth == HealAuth.DIGEST:
            digest_prepare_s.append(prepare_s[-1])

    def do_heal(kind: str = "heal") -> None:
        nonlocal reserve, prepared
        _, stats = heal(
            pg, rank, list(range(senders)), [receiver], state, {"step": 1}, 120.0, key=KEY,
            reserve=reserve if kind != "cold" else None,
            auth=HealAuth.MAC if kind == "mac" else HealAuth.DIGEST, in_place=True,
            min_stripe_bytes=min_stripe, prepared=prepared if kind != "cold" else None,
        )  # fmt: skip
        reserve, prepared = None, None
        payload_s[kind].append(stats.payload_s)
        predicted[kind].append(stats.predicted)

    def broadcast(t: torch.Tensor) -> None:
        if bcast is None:
            return  # a second sender: not in the broadcast
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        bcast.broadcast([t], opts).wait()

    seconds: dict[str, list[float]] = {k: [] for k in KINDS}
    cpu: dict[str, list[float]] = {k: [] for k in KINDS}

    def timed(kind: str, fn: Callable[[], None]) -> None:
        barrier(pg)
        c0, t0 = cpu_s(), time.perf_counter()
        fn()
        seconds[kind].append(time.perf_counter() - t0)
        cpu[kind].append(cpu_s() - c0)

    # The first heal of this receiver process, timed as the rounds are: what a
    # replacement's one heal costs (cold code paths; its landing reserved from its
    # own fresh optimizer's estimate, as the trainer's joiner does). It also warms
    # up the connections; the receiver has optimizer state from here on.
    prepare()
    barrier(pg)
    c0, t0 = cpu_s(), time.perf_counter()
    do_heal()
    first = (time.perf_counter() - t0, cpu_s() - c0, payload_s["heal"].pop())
    nbytes = sum(t.numel() * t.element_size() for _, t in state.flatten().tensors)
    warm = torch.zeros(nbytes, dtype=torch.uint8)
    broadcast(warm)

    def floor(round_key: bytes) -> None:
        """Seal, send and check the payload bytes, pipelined by piece."""
        if bcast is None:
            return
        pieces = list(torch.split(warm, FLOOR_PIECE))
        tags = torch.zeros(16 * len(pieces), dtype=torch.uint8)
        if rank == 0:
            works = []
            for i, piece in enumerate(pieces):
                tags[16 * i : 16 * i + 16] = torch.frombuffer(
                    bytearray(Poly1305.generate_tag(round_key, piece.numpy().data)),
                    dtype=torch.uint8,
                )
                works.append(bcast.send([piece], 1, i + 1))
            works.append(bcast.send([tags], 1, 0))
            for w in works:
                w.wait()
            return
        recvs = [bcast.recv([piece], 0, i + 1) for i, piece in enumerate(pieces)]
        bcast.recv([tags], 0, 0).wait()
        for i, (piece, w) in enumerate(zip(pieces, recvs, strict=True)):
            w.wait()
            Poly1305.verify_tag(round_key, piece.numpy().data, bytes(tags[16 * i : 16 * i + 16]))

    def digest_floor() -> None:
        """Send the payload's pieces at once; the receiver hashes each as it lands."""
        if bcast is None:
            return
        pieces = list(torch.split(warm, DIGEST_FLOOR_PIECE))
        if rank == 0:
            for w in [bcast.send([piece], 1, i + 1) for i, piece in enumerate(pieces)]:
                w.wait()
            return
        recvs = [bcast.recv([piece], 0, i + 1) for i, piece in enumerate(pieces)]
        h = xxhash.xxh3_128()
        for piece, w in zip(pieces, recvs, strict=True):
            w.wait()
            h.update(piece.numpy().data)
        h.digest()

    for i in range(reps):
        timed("warm", lambda: broadcast(warm))
        fresh = torch.empty(nbytes, dtype=torch.uint8) if rank == receiver else warm
        timed("fresh", functools.partial(broadcast, fresh))
        del fresh
        prepare()
        timed("heal", do_heal)
        prepare(HealAuth.MAC)
        timed("mac", functools.partial(do_heal, "mac"))
        timed("cold", functools.partial(do_heal, "cold"))
        # A one-time Poly1305 key per round, as the heal derives one per stripe.
        timed("floor", functools.partial(floor, i.to_bytes(32, "little")))
        timed("dfloor", digest_floor)
    ok = same_everywhere(pg, state_hash(state.model, state.optimizer))
    with open(f"{out}.{rank}", "w") as f:
        json.dump(
            {
                "rank": rank,
                "bytes": nbytes,
                "seconds": seconds,
                "cpu": cpu,
                "payload_s": payload_s,
                "predicted": predicted,
                "prepare_s": prepare_s,
                "digest_prepare_s": digest_prepare_s,
                "first": first,
            },
            f,
        )
    barrier(pg)
    if not ok:
        print(f"rank {rank}: the receiver's state hash differs from the senders'", file=sys.stderr)
        raise SystemExit(3)


if __name__ == "__main__":
    main()

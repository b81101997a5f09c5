"""Heal a JAX state over a generation's gloo group: JSON manifest + raw bytes + CRC-32.

Every rank of the group calls `heal_state` with the same ``senders`` (ranks
holding the state the generation starts from) and ``receivers`` (the ranks
behind). For each candidate root, the senders in order:

1. **manifest** -- the root broadcasts a JSON manifest: one entry per leaf
   ``[name, shape, dtype, offset, nbytes]``, the payload's total size and
   CRC-32, and the JSON meta (committed step, last loss). Length first (int64),
   then the bytes (uint8).
2. **verdict** -- every rank checks the manifest against its own leaves (same
   names, shapes, dtypes, in order; offsets contiguous; sizes consistent). One
   all-reduce of per-rank codes: any rejection makes every rank raise
   HealError before the payload moves (a state that does not fit is a
   divergence, not damage in transit: not retried).
3. **payload** -- the root broadcasts the concatenated leaf bytes; receivers
   check the CRC-32. One all-reduce of failures: none, and receivers rebuild
   their leaves; some, and the next sender is root (none left: HealError).

Nothing is pickled; a failed heal leaves the receivers' state untouched. All
waits share one deadline, ``timeout_s`` from the call; a transport error or the
deadline raises HealError on the rank that saw it (its peers fail at their
next collective). The group may then hold pending work: drop it and regroup.

Unlike the PyTorch path's striped heal (`elastrain.transfer`), one sender
sends everything; on a real network with many up-to-date peers striping pays,
for the small JAX states this path targets it does not.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from elastrain.jax.state import NamedLeaves
from elastrain.transfer import HealError, HealStats

MANIFEST_VERSION = 1


class _Deadline:
    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def run(self, post: Any, what: str) -> None:
        """Post one collective and wait for it against the deadline."""
        try:
            work = post()
            work.wait(datetime.timedelta(seconds=max(self.end - time.monotonic(), 0.001)))
        except RuntimeError as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise HealError(
                f"heal on rank {self.rank}: {what} failed (timeout_s={self.timeout_s:g}): {first}"
            ) from e


def _broadcast(pg: Any, root: int, t: torch.Tensor, dl: _Deadline, what: str) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    opts.rootTensor = 0
    dl.run(lambda: pg.broadcast([t], opts), what)


def _sum(pg: Any, flags: torch.Tensor, dl: _Deadline, what: str) -> list[int]:
    dl.run(lambda: pg.allreduce([flags]), what)
    return [int(x) for x in flags.tolist()]


def _payload_of(leaves: NamedLeaves) -> np.ndarray:
    parts = [np.ascontiguousarray(a).reshape(-1).view(np.uint8) for _, a in leaves]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)


def build_manifest(leaves: NamedLeaves, payload: np.ndarray, meta: dict[str, Any]) -> bytes:
    entries, off = [], 0
    for name, a in leaves:
        entries.append([name, [int(d) for d in a.shape], str(a.dtype), off, int(a.nbytes)])
        off += int(a.nbytes)
    doc = {
        "version": MANIFEST_VERSION,
        "entries": entries,
        "total": off,
        "crc32": zlib.crc32(payload.data),
        "meta": meta,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def check_manifest(doc: Any, local: NamedLeaves) -> str | None:
    """None if the manifest describes exactly the local layout, else what is wrong."""
    if not isinstance(doc, dict) or doc.get("version") != MANIFEST_VERSION:
        return "not a version-1 JAX state manifest"
    entries = doc.get("entries")
    if not isinstance(entries, list) or len(entries) != len(local):
        n = len(entries) if isinstance(entries, list) else "no"
        return f"manifest has {n} entries, the local state {len(local)}"
    off = 0
    for i, (e, (name, a)) in enumerate(zip(entries, local, strict=True)):
        want = [name, [int(d) for d in a.shape], str(a.dtype), off, int(a.nbytes)]
        if e != want:
            return f"entry {i}: manifest {e}, local {want}"
        off += int(a.nbytes)
    if doc.get("total") != off or not isinstance(doc.get("crc32"), int):
        return f"manifest total {doc.get('total')!r} != {off}, or no crc32"
    if not isinstance(doc.get("meta"), dict):
        return "manifest carries no meta"
    return None


def heal_state(
    pg: Any,
    rank: int,
    senders: Sequence[int],
    receivers: Sequence[int],
    leaves: NamedLeaves,
    meta: dict[str, Any] | None,
    timeout_s: float,
) -> tuple[list[np.ndarray] | None, dict[str, Any] | None, HealStats]:
    """Collective over `pg` (every rank calls it). Senders pass their state's
    `leaves` and `meta`; receivers pass their own `leaves` (for the layout
    check) and get back ``(arrays, meta, stats)`` with fresh arrays in leaf
    order; other ranks get ``(None, None, stats)``. Raises HealError on every
    rank when the layouts differ or no sender's payload arrives intact."""
    t0 = time.monotonic()
    if not senders or set(senders) & set(receivers):
        raise ValueError(f"bad heal roles: senders {list(senders)}, receivers {list(receivers)}")
    dl = _Deadline(rank, timeout_s)
    size = pg.size()
    role = "send" if rank in senders else "recv" if rank in receivers else "idle"
    sent = received = 0
    refused: list[int] = []
    for root in senders:
        # 1. manifest
        if rank == root:
            assert meta is not None, "a sender must pass its meta"
            payload = _payload_of(leaves)
            data = build_manifest(leaves, payload, meta)
        length = torch.tensor([len(data) if rank == root else 0], dtype=torch.int64)
        _broadcast(pg, root, length, dl, "manifest length broadcast")
        if rank == root:
            mbuf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            mbuf = torch.empty(int(length.item()), dtype=torch.uint8)
        _broadcast(pg, root, mbuf, dl, "manifest broadcast")
        # 2. verdict
        try:
            doc = json.loads(mbuf.numpy().tobytes())
        except ValueError as e:
            doc = {"error": str(e)}
        problem = None if rank == root else check_manifest(doc, leaves)
        codes = torch.zeros(size, dtype=torch.int64)
        codes[rank] = 1 if problem else 0
        bad = [r for r, c in enumerate(_sum(pg, codes, dl, "verdict all-reduce")) if c]
        if bad:
            why = f": {problem}" if problem else ""
            raise HealError(
                f"heal from rank {root}: ranks {bad} refused its manifest{why} "
                "(members built different params or optimizers?)"
            )
        # 3. payload
        total = int(doc["total"])
        if rank == root:
            pbuf = torch.from_numpy(payload)
            sent += total * len(receivers)
        else:
            pbuf = torch.empty(total, dtype=torch.uint8)
        _broadcast(pg, root, pbuf, dl, "payload broadcast")
        ok = rank != root and rank in receivers and zlib.crc32(pbuf.numpy().data) == doc["crc32"]
        failed = torch.zeros(size, dtype=torch.int64)
        failed[rank] = 1 if rank in receivers and not ok else 0
        if rank in receivers:
            received += total
        if not any(_sum(pg, failed, dl, "checksum outcome all-reduce")):
            if rank not in receivers:
                return None, None, HealStats(role, sent, time.monotonic() - t0, tuple(refused))
            arrays = _unpack(pbuf.numpy(), doc["entries"], leaves)
            stats = HealStats(role, received, time.monotonic() - t0, tuple(refused))
            return arrays, doc["meta"], stats
        refused.append(root)
    raise HealError(
        f"heal: every sender's payload ({list(senders)}) failed its checksum on some receiver"
    )


def _unpack(buf: np.ndarray, entries: list[Any], local: NamedLeaves) -> list[np.ndarray]:
    out = []
    for e, (_, a) in zip(entries, local, strict=True):
        off, nbytes = int(e[3]), int(e[4])
        count = math.prod(a.shape)
        arr = np.frombuffer(buf, dtype=a.dtype, count=count, offset=off) if nbytes else None
        out.append(np.zeros(a.shape, a.dtype) if arr is None else arr.reshape(a.shape).copy())
    return out

"""`Snapshot`: one member's share of the state, copied to host memory.

Taking a snapshot is the only part of a checkpoint the training loop waits
for; the `CheckpointWriter` writes it to disk in the background afterwards.
Tensors that only the optimizer step writes may be copied later, on a
background thread, until the training thread's next mutation point
(`elastrain.checkpoint.deferred`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection, Mapping
from typing import Any

import torch

from elastrain.checkpoint.deferred import DeferredCopy
from elastrain.checkpoint.layout import Layout, Piece
from elastrain.transfer.dtypes import byte_view

log = logging.getLogger(__name__)


class WriterClaim:
    """The claim a writer thread holds on a snapshot while it reads its buffers, so
    that a newer snapshot does not reuse them (``into=``) under it. One writer at a
    time: `_acquire` is False while another holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_use = False

    @property
    def in_use(self) -> bool:
        """True while a writer is reading the buffer; the buffer must not be reused then."""
        return self._in_use

    def _acquire(self) -> bool:
        with self._lock:
            if self._in_use:
                return False
            self._in_use = True
            return True

    def _release(self) -> None:
        with self._lock:
            self._in_use = False


class PartSnapshot(WriterClaim):
    """What a snapshot holds in every format, besides its bytes: which part of the
    checkpoint it is (``shard`` of ``num_shards``), ``meta_json`` (the canonical
    JSON of the meta), ``take_s`` (the seconds `take` blocked the training thread)
    and ``deferred`` (the copy still running after `take` returned, which the
    writer follows: `wait_copied`). `Snapshot` is the flat format's,
    `elastrain.checkpoint.dcp.ShardSnapshot` the DCP format's."""

    def __init__(self, shard: int, num_shards: int, meta_json: str, deferred: DeferredCopy) -> None:
        super().__init__()
        self.shard = shard
        self.num_shards = num_shards
        self.meta_json = meta_json
        self.take_s = 0.0
        self.deferred = deferred

    @property
    def meta(self) -> dict[str, Any]:
        """A fresh copy of the meta dict passed to `take`."""
        out: dict[str, Any] = json.loads(self.meta_json)
        return out

    def wait_copied(self, part: torch.Tensor | None = None) -> None:
        """Block until the deferred copy into ``part`` (None: all of it) is done
        (the writer, before it reads those bytes); `CopyFailed` if it failed."""
        self.deferred.wait(part)


class Snapshot(PartSnapshot):
    """A host-memory copy of the payload bytes one shard owns, plus the JSON meta.

    Build it with `Snapshot.take`; hand it to `CheckpointWriter.save_async`.
    Attributes are read-only by convention: ``layout`` (the whole state's
    layout), ``shard``/``num_shards``, ``lo``/``hi`` (the owned payload range),
    ``buffer`` (a uint8 tensor of ``hi - lo`` bytes, pinned when the sources were
    on CUDA), ``meta_json`` (the canonical JSON of ``meta``), ``take_s`` (the
    seconds the training thread was blocked in `take`) and ``deferred`` (the
    copy of the deferred tensors, still running after `take` returned).
    """

    def __init__(
        self,
        layout: Layout,
        shard: int,
        num_shards: int,
        lo: int,
        hi: int,
        buffer: torch.Tensor,
        meta_json: str,
        events: list[torch.cuda.Event],
        deferred: DeferredCopy,
    ) -> None:
        super().__init__(shard, num_shards, meta_json, deferred)
        self.layout = layout
        self.lo = lo
        self.hi = hi
        self.buffer = buffer
        self._cuda_events = events

    @property
    def nbytes(self) -> int:
        """Bytes of payload this snapshot holds (``hi - lo``)."""
        return self.hi - self.lo

    @property
    def handed_over(self) -> bool:
        """True once a newer snapshot took this one's buffer (``into=``): it cannot be written."""
        return self.buffer.numel() != self.nbytes

    def pieces(self) -> list[Piece]:
        """The tensor slices inside this shard's range."""
        return self.layout.pieces(self.lo, self.hi)

    def wait_copied(self, part: torch.Tensor | None = None) -> None:
        """Block until every copy into ``part`` (a slice of ``buffer``; None: all of
        it) is done: the deferred one, and asynchronous device-to-host ones. Called
        by the writer thread before it reads those bytes; raises `CopyFailed` if the
        deferred copy failed.
        """
        super().wait_copied(part)
        for ev in self._cuda_events:
            ev.synchronize()

    @staticmethod
    def take(
        tensors: Mapping[str, torch.Tensor],
        meta: dict[str, Any],
        *,
        shard: int,
        num_shards: int,
        into: Snapshot | None = None,
        defer: Collection[str] = (),
    ) -> Snapshot:
        """Copy this shard's share of ``tensors`` into host memory; return the snapshot.

        Who calls it: every member that takes part in a save, on its training
        thread, at a step boundary (after the optimizer step, before the next
        one), with the same ``tensors`` structure (names in the same order,
        same dtypes and shapes) and the same ``num_shards`` on every member;
        ``shard`` is the member's index, e.g. its rank in the generation.

        What it copies: the payload (all tensors' bytes back to back) is striped
        into ``num_shards`` near-equal ranges; only range ``shard`` is copied, so
        the members together write the state once. ``meta`` must be JSON
        serialisable (step, data position, RNG state, optimizer hyperparameters;
        never pickled); it is stored as given with every shard, and `load`
        returns shard 0's.

        Blocking: for CPU tensors it returns after the copy (a memcpy of about
        ``total / num_shards`` bytes), except for the tensors named in ``defer``:
        those are copied by a background thread it starts (``deferred``), and
        the caller must call ``deferred.settle()`` before anything writes them
        (``defer`` is for what only the optimizer step writes, in place; a
        non-contiguous one is copied now). For CUDA tensors the copies are
        queued on each device's current stream into pinned memory and `take`
        returns at once (``defer`` is not needed); later work on that stream
        (the next optimizer step) is ordered after them, and the writer waits
        for them before reading.

        ``into``: a previous snapshot of the same shard whose save has finished;
        its buffer is reused when the size matches, which avoids page-faulting
        fresh memory (several times slower than the copy itself). A snapshot
        still in use by a writer is never reused (a new buffer is allocated).

        Raises ValueError/TypeError for bad arguments or state that cannot be
        stored (non-tensor values, sparse tensors, non-JSON meta); nothing
        is written anywhere.
        """
        t0 = time.perf_counter()
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard={shard} of {num_shards}")
        try:
            meta_json = json.dumps(meta, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta must be JSON serialisable: {e}") from e
        layout = Layout.of(tensors)
        bounds = layout.bounds(num_shards)
        lo, hi = bounds[shard], bounds[shard + 1]
        pieces = layout.pieces(lo, hi)
        devices = {t.device for t in tensors.values() if t.device.type == "cuda"}
        pinned = bool(devices)

        buffer: torch.Tensor | None = None
        if into is not None:
            into.deferred.finish()  # its copy must not write into a buffer reused here
        if into is not None and into.shard == shard and into._acquire():
            ok = into.buffer.numel() == hi - lo and (into.buffer.is_pinned() or not pinned)
            if ok:
                buffer = into.buffer
                into.buffer = torch.empty(0, dtype=torch.uint8)  # the old snapshot gives it up
            into._release()
        if buffer is None:
            if into is not None:
                log.debug("snapshot buffer of shard %d not reusable; allocating", shard)
            buffer = torch.empty(hi - lo, dtype=torch.uint8, pin_memory=pinned)

        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for p in pieces:
                t = tensors[p.entry.name]
                a = p.start - p.entry.offset
                src = byte_view(t)[a : a + p.end - p.start]
                dst = buffer[p.start - lo : p.end - lo]
                if not pinned and p.entry.name in defer and t.is_contiguous():
                    later.append((dst, src))
                else:
                    dst.copy_(src, non_blocking=pinned)
        deferred = DeferredCopy(later)
        cuda_events = []
        for dev in devices:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(dev))
            cuda_events.append(ev)
        snap = Snapshot(layout, shard, num_shards, lo, hi, buffer, meta_json, cuda_events, deferred)
        deferred.start()
        snap.take_s = time.perf_counter() - t0
        return snap

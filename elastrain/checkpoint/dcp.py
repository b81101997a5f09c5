"""Sharded checkpoints in `torch.distributed.checkpoint` (DCP) format.

A sharded job (docs/design/sharded-checkpoints.md) writes every shard's rows
once: one *writer* per shard index writes the rows it holds, and nobody gathers
the model. A tensor is split along dim 0 (a 0-dim tensor counts as one row); a
writer's piece of a tensor is a *chunk*, rows ``[lo, hi)``, which DCP describes
as ``ChunkStorageMetadata(offsets=(lo, 0, ...), sizes=(hi - lo, ...))``. Tensors
that are not sharded (buffers, Adam's ``step``) are one whole chunk, written by
writer 0. A replicated job with ``--ckpt-format dcp`` writes the same format,
one writer per member, each its rows of every tensor
(`elastrain.checkpoint.replicated_parts`). For checkpoint ``step``::

    <directory>/step-XXXXXXXX/
        __K_0.distcp                writer K's data: DCP's data file, one torch.save
                                    blob per chunk, back to back
        shard-KKKKK-of-SSSSS.json   writer K's part manifest (signed JSON): the data
                                    file's size and CRC-32; per chunk its tensor, rows,
                                    blob offset and length, the offset of its raw bytes
                                    and a CRC-32 per `BLOCK_BYTES` of them; the list of
                                    every tensor of the checkpoint; the meta
        .metadata                   DCP's `Metadata` of every chunk (pickled: DCP's
                                    own format), written by the committer
        COMMITTED.json              the commit marker (signed JSON): every chunk of
                                    every tensor, every file with size and CRC-32, meta

1. Each writer takes a `ShardSnapshot` of its chunks (a host copy; the only part
   the training loop waits for); a `ShardedWriter` writes it in the background:
   data file (temp file, fsync, rename, directory fsync), then its part manifest
   the same way. The manifest's presence means "this part is durable".
2. One process (the committer, rank 0 of the generation) calls `commit_sharded`
   once every part manifest exists: it checks them (same step, generation,
   members and tensor list; data files of the size and CRC-32 claimed; the chunks
   of every tensor tile its rows exactly), writes DCP's ``.metadata`` and then
   ``COMMITTED.json``. Without the marker a checkpoint does not count, whatever
   else is there (``.metadata`` included).
3. `torch.distributed.checkpoint.load` reads the directory as any DCP checkpoint
   (keys ``model.<parameter or buffer>``, ``optim.state.<parameter>.<key>``: the
   flattened ``{"model": ..., "optim": {"state": ...}}`` of torch's convention),
   resharding to whatever the caller's state_dict asks for.
4. elastrain reads with `ShardedReader`, from the marker's JSON only: it never
   unpickles anything (neither ``.metadata`` nor the torch.save blobs). It reads
   the rows it needs straight from the raw bytes inside each blob (torch.save
   stores a tensor's bytes uncompressed, and the writer checked where), checking
   the CRC-32 of every block it touches.

Local file I/O only; no communication. Torch's zip format and DCP's metadata
classes are those of the torch this runs with (checked at write time: a blob
whose raw bytes are not where the writer expects them fails the save).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import pickle
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elastrain.checkpoint.deferred import DeferredCopy
from elastrain.checkpoint.files import (
    FORMAT,
    MARKER,
    CheckpointCorrupt,
    CheckpointError,
    CommitError,
    DurableFile,
    atomic_file,
    shard_manifest_name,
    step_dir,
    write_atomically,
)
from elastrain.checkpoint.snapshot import PartSnapshot
from elastrain.checkpoint.store import (
    CommitOrder,
    Format,
    VerifiedCheckpoint,
    _check_file,
    commit_with,
    read_part_manifest,
)
from elastrain.checkpoint.writer import CheckpointWriter
from elastrain.transfer.dtypes import byte_view, dtype_from_name, dtype_name

log = logging.getLogger(__name__)

KIND = "dcp"
"""The ``kind`` of a sharded checkpoint's manifests and marker (the replicated ones have none)."""

METADATA = ".metadata"
"""DCP's metadata file (``torch.distributed.checkpoint.filesystem``'s name)."""

BLOCK_BYTES = 1 << 20
"""The raw bytes of a chunk carry one CRC-32 per block of this size, so that a
reader of a few rows checks what it reads without reading the whole chunk."""

DCP_VERSION = "1.0.0"
"""`torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION` of the format written."""


def model_key(name: str) -> str:
    """The DCP key of a model parameter or buffer (``{"model": state_dict}`` flattened)."""
    return f"model.{name}"


def optim_key(param: str, key: str) -> str:
    """The DCP key of a parameter's optimizer state tensor (torch's FQN-keyed
    ``{"optim": {"state": {param: {key: tensor}}}}`` flattened)."""
    return f"optim.state.{param}.{key}"


def data_file_name(shard: int) -> str:
    """Writer ``shard``'s data file: DCP's ``__<rank>_<n>.distcp``."""
    return f"__{shard}_0.distcp"


def row_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """A tensor's shape as rows: itself, or one row for a 0-dim tensor."""
    return tuple(shape) if len(shape) else (1,)


def row_count(shape: Sequence[int]) -> int:
    return row_shape(shape)[0]


def chunk_box(shape: Sequence[int], lo: int, hi: int) -> tuple[list[int], list[int]]:
    """DCP's chunk ``(offsets, sizes)`` of rows ``[lo, hi)`` of a tensor of ``shape``."""
    if not len(shape):
        if (lo, hi) != (0, 1):
            raise ValueError(f"a 0-dim tensor has one row, not rows {lo}-{hi}")
        return [], []
    return [lo] + [0] * (len(shape) - 1), [hi - lo, *shape[1:]]


# ---- pure planning ------------------------------------------------------------------


def cover(chunks: Sequence[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int, int]]:
    """Which saved chunks make rows ``[lo, hi)``: ``(chunk index, a, b)``, rows
    ``[a, b)`` from that chunk, in row order. ``chunks`` are ``(lo, hi)`` row
    ranges that do not overlap (a committed checkpoint's tile their tensor).
    ValueError if some row of ``[lo, hi)`` is in none. Pure."""
    out: list[tuple[int, int, int]] = []
    at = lo
    for i in sorted(range(len(chunks)), key=lambda j: chunks[j]):
        clo, chi = chunks[i]
        a, b = max(at, clo), min(hi, chi)
        if a >= b:
            continue
        if a != at:
            raise ValueError(f"rows {at}-{a} are in no saved chunk")
        out.append((i, a, b))
        at = b
    if at < hi:
        raise ValueError(f"rows {at}-{hi} are in no saved chunk")
    return out


def tiling_problem(chunks: Sequence[tuple[int, int]], rows: int) -> str | None:
    """None if the non-empty ``(lo, hi)`` chunks tile rows ``[0, rows)`` exactly
    (every row in exactly one), else what is wrong. Pure."""
    at = 0
    for lo, hi in sorted(c for c in chunks if c[1] > c[0]):
        if lo < at:
            return f"rows {lo}-{min(hi, at)} are in two chunks"
        if lo > at:
            return f"rows {at}-{lo} are in no chunk"
        at = hi
    if at != rows:
        return f"rows {at}-{rows} are in no chunk" if at < rows else f"chunks run to row {at}"
    return None


# ---- what a writer holds --------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """Rows ``[lo, hi)`` of tensor ``fqn`` (0-dim: rows [0, 1)); ``tensor`` holds
    them (any shape with that many elements). ``defer``: only the optimizer step
    writes ``tensor`` (in place), so its copy may run on a background thread
    until the next mutation point (`ShardSnapshot.take`); else it is read on the
    training thread only."""

    fqn: str
    lo: int
    hi: int
    tensor: torch.Tensor
    defer: bool = False


@dataclass
class ShardParts:
    """One writer's share of a sharded checkpoint.

    ``tensors``: every tensor of the checkpoint (not only this writer's), fqn ->
    (dtype name, shape); every writer declares the same. ``chunks``: the rows this
    writer writes. ``meta``: JSON (the committer keeps writer 0's)."""

    tensors: dict[str, tuple[str, tuple[int, ...]]]
    chunks: list[Chunk]
    meta: dict[str, Any]


def _tensor_list(tensors: Mapping[str, tuple[str, Sequence[int]]]) -> list[list[Any]]:
    return [[f, d, [int(x) for x in s]] for f, (d, s) in sorted(tensors.items())]


class ShardSnapshot(PartSnapshot):
    """A host copy of one writer's chunks, plus the JSON meta (`ShardSnapshot.take`).

    The sharded counterpart of `elastrain.checkpoint.Snapshot`: hand it to a
    `ShardedWriter`. Each chunk is its own tensor (torch.save writes a tensor's
    whole storage, so a view into a shared buffer would write all of it).
    """

    def __init__(
        self,
        shard: int,
        num_shards: int,
        tensors: dict[str, tuple[str, tuple[int, ...]]],
        chunks: list[tuple[str, int, int]],
        staging: list[torch.Tensor],
        meta_json: str,
        deferred: DeferredCopy,
    ) -> None:
        super().__init__(shard, num_shards, meta_json, deferred)
        self.tensors = tensors
        self.chunks = chunks
        self.staging = staging
        self._handed = False

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staging)

    @property
    def handed_over(self) -> bool:
        """True once a newer snapshot took this one's staging tensors (``into=``)."""
        return self._handed

    @staticmethod
    def take(
        parts: ShardParts, *, shard: int, num_shards: int, into: ShardSnapshot | None = None
    ) -> ShardSnapshot:
        """Copy ``parts``' chunks to host memory; the training thread waits for this only.

        ``shard`` is the writer's index (its data file is ``__<shard>_0.distcp``),
        ``num_shards`` the number of writers. ``into``: a previous snapshot whose
        save finished; its tensors are reused when the chunks have the same
        shapes (fresh memory page-faults several times slower than a copy).
        Chunks with ``defer`` (contiguous ones) are copied by a background thread
        it starts (``deferred``); the caller must call ``deferred.settle()``
        before anything writes them. ValueError/TypeError for chunks that do not fit the declared tensors or
        meta that is not JSON; nothing is written anywhere.
        """
        t0 = time.perf_counter()
        if num_shards < 1 or not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard={shard} of {num_shards}")
        try:
            meta_json = json.dumps(parts.meta, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise TypeError(f"checkpoint meta must be JSON serialisable: {e}") from e
        tensors = {f: (str(d), tuple(int(x) for x in s)) for f, (d, s) in parts.tensors.items()}
        specs: list[tuple[str, int, int]] = []
        shapes: list[tuple[torch.dtype, tuple[int, ...]]] = []
        for c in parts.chunks:
            if c.fqn not in tensors:
                raise ValueError(f"chunk of {c.fqn!r}, which the checkpoint does not declare")
            dtype, shape = tensors[c.fqn]
            if not 0 <= c.lo < c.hi <= row_count(shape):
                raise ValueError(f"chunk {c.fqn!r} rows {c.lo}-{c.hi} outside {list(shape)}")
            box = tuple(chunk_box(shape, c.lo, c.hi)[1])
            if c.tensor.numel() != math.prod(box) or dtype_name(c.tensor.dtype) != dtype:
                raise ValueError(
                    f"chunk {c.fqn!r} rows {c.lo}-{c.hi} is {c.tensor.dtype} "
                    f"{list(c.tensor.shape)}, expected {dtype} {list(box)}"
                )
            if c.tensor.layout != torch.strided:
                raise TypeError(f"chunk {c.fqn!r} has layout {c.tensor.layout}; only dense")
            specs.append((c.fqn, c.lo, c.hi))
            shapes.append((c.tensor.dtype, box))
        staging: list[torch.Tensor] | None = None
        if into is not None:
            into.deferred.finish()  # its copy must not write into tensors reused here
        if into is not None and into.shard == shard and into._acquire():
            same = [(t.dtype, tuple(t.shape)) for t in into.staging] == shapes
            if same and not into._handed:
                staging, into._handed = into.staging, True
                into.staging = []
            into._release()
        if staging is None:
            staging = [torch.empty(box, dtype=dt) for dt, box in shapes]
        later: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for c, dst in zip(parts.chunks, staging, strict=True):
                if c.defer and c.tensor.is_contiguous() and c.tensor.device.type == "cpu":
                    later.append((byte_view(dst), byte_view(c.tensor)))
                else:
                    dst.copy_(c.tensor.detach().reshape(dst.shape))
        deferred = DeferredCopy(later)
        snap = ShardSnapshot(shard, num_shards, tensors, specs, staging, meta_json, deferred)
        deferred.start()
        snap.take_s = time.perf_counter() - t0
        return snap


# ---- writing -------------------------------------------------------------------------


def _gf2_times(mat: Sequence[int], vec: int) -> int:
    """The 32x32 GF(2) matrix ``mat`` (columns) times the 32-bit vector ``vec``."""
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


@functools.lru_cache(maxsize=256)
def _zeros_operator(nbytes: int) -> tuple[int, ...]:
    """The GF(2) operator that appending ``nbytes`` zero bytes applies to a CRC-32
    (zlib's ``crc32_combine`` construction: squares of the one-zero-bit operator).
    Cached: the writer needs it for `BLOCK_BYTES` and a few tail lengths."""
    odd = [0xEDB88320] + [1 << (k - 1) for k in range(1, 32)]  # one zero bit
    even = [_gf2_times(odd, c) for c in odd]  # two zero bits
    odd = [_gf2_times(even, c) for c in even]  # four
    op = [1 << k for k in range(32)]  # identity
    n = nbytes
    while n:
        even = [_gf2_times(odd, c) for c in odd]  # 1, 4, 16, ... zero bytes
        if n & 1:
            op = [_gf2_times(even, c) for c in op]
        n >>= 1
        if not n:
            break
        odd = [_gf2_times(even, c) for c in even]  # 2, 8, 32, ... zero bytes
        if n & 1:
            op = [_gf2_times(odd, c) for c in op]
        n >>= 1
    return tuple(op)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``a + b`` from ``crc1 = crc32(a)``, ``crc2 = crc32(b)`` and
    ``len2 = len(b)`` (zlib's ``crc32_combine``, which Python's zlib lacks). Pure."""
    return _gf2_times(_zeros_operator(len2), crc1) ^ crc2 if len2 else crc1


class _BlobSink:
    """Where one chunk's ``torch.save`` goes: straight into the data file.

    torch.save hands its zip writer's pieces to ``write`` as memoryviews of its
    own buffers, the storage's bytes as one view of the tensor's memory: each is
    written at once (no blob in memory: a 128 MiB chunk saved into a BytesIO
    was copied as the buffer grew, then again, the writer's main cost), folded
    into the data file's CRC-32, and the storage's own piece is recognised by its
    address and size, so the raw bytes' offset and their block CRC-32s come
    from what was written, not from parsing the zip afterwards."""

    def __init__(self, out: DurableFile, t: torch.Tensor, crc: int) -> None:
        self.out = out
        self.crc = crc
        self.written = 0
        self.nbytes = t.numel() * t.element_size()
        self._ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() != self.nbytes:
            # torch.save writes a tensor's whole storage; a view into a larger one
            # would put other bytes in the file (snapshots hold their own tensors).
            raise RuntimeError("a chunk's tensor is a view into a larger storage")
        self.data_at: list[int] = []
        self.block_crc32: list[int] = [0]

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        n = mv.nbytes
        if n == self.nbytes and n and np.frombuffer(mv, np.uint8).ctypes.data == self._ptr:
            # The raw bytes: their block CRC-32s in parallel with the write (both
            # release the GIL), and the file's CRC-32 combined from them, so the
            # bytes are read once for checksums, as the flat writer reads its own.
            blocks: list[list[int]] = []
            crc_thread = threading.Thread(
                target=lambda: blocks.append(_block_crcs(mv, BLOCK_BYTES)), name="ckpt-crc"
            )
            crc_thread.start()
            try:
                self.out.write(mv)
            finally:
                crc_thread.join()
            if not blocks:
                raise RuntimeError("the CRC-32 of a chunk's bytes failed")
            self.data_at.append(self.written)
            self.block_crc32 = blocks[0]
            for i, c in enumerate(self.block_crc32):
                self.crc = crc32_combine(self.crc, c, min(BLOCK_BYTES, n - i * BLOCK_BYTES))
        else:
            self.out.write(mv)
            self.crc = zlib.crc32(mv, self.crc)
        self.written += n
        return n

    def flush(self) -> None:
        """torch.save may flush; every piece is in the file already."""


def _zip_save() -> tuple[Callable[..., None], Callable[[], int]] | None:
    """torch.save's own pieces (``torch.serialization._save`` and the storage
    alignment), or None where this torch has them under other names."""
    save = getattr(torch.serialization, "_save", None)
    align = getattr(torch.serialization, "_get_storage_alignment", None)
    return (save, align) if callable(save) and callable(align) else None


def _torch_save(t: torch.Tensor, sink: _BlobSink) -> None:
    """``torch.save(t, sink)`` without the zip's own CRC-32 of each record, what
    torch.save writes with ``torch.utils.serialization.config.save.compute_crc32
    = False`` (torch.load and DCP's reader accept it). That CRC is a second
    sequential pass over the bytes on the writer thread, and redundant here: the
    block CRC-32s and the file's cover the same bytes. The config is process-wide
    (a script's own torch.save would change with it), so the zip writer is built
    here, as torch.save builds it; torch.save itself where those private names
    changed."""
    private = _zip_save()
    if private is None:
        torch.save(t, sink)  # type: ignore[arg-type]  # a file-like object: it only writes
        return
    save, align = private
    # A file-like object that only writes, as torch.save's own buffer writer takes.
    writer = torch._C.PyTorchFileWriter(sink, False, align())  # type: ignore[call-overload]
    try:
        save(t, writer, pickle, torch.serialization.DEFAULT_PROTOCOL, False)
    finally:
        # Always, as torch.save's context does: an unfinished writer finishes itself
        # when collected, calling `sink.write` from wherever that happens.
        writer.write_end_of_file()


def _save_chunk(out: DurableFile, t: torch.Tensor, crc: int) -> _BlobSink:
    """``torch.save(t)`` appended to the data file ``out`` (whose CRC-32 so far is
    ``crc``). Checks that the storage's bytes went out once, as they are (so a
    reader can take rows from the file without unpickling); RuntimeError if not,
    which fails the save rather than writing what elastrain could not read."""
    sink = _BlobSink(out, t, crc)
    _torch_save(t, sink)
    if sink.nbytes and len(sink.data_at) != 1:
        raise RuntimeError(
            f"torch.save wrote a chunk's {sink.nbytes} bytes {len(sink.data_at)} times "
            "from its own memory, not once"
        )
    if not sink.nbytes:
        sink.data_at.append(0)  # nothing to read: any offset
    return sink


def _block_crcs(raw: memoryview, block: int) -> list[int]:
    return [zlib.crc32(raw[i : i + block]) for i in range(0, len(raw), block)] or [0]


class ShardedWriter(CheckpointWriter):
    """Writes `ShardSnapshot`s (one writer's part of a sharded checkpoint) in the
    background; otherwise a `CheckpointWriter` (one save in flight, skips, events,
    failure handling, cancel on ``close(wait=False)``)."""

    def _data_path(self, d: Path, snap: Any) -> Path:
        return d / data_file_name(snap.shard)

    def _write_part(
        self, d: Path, final: Path, step: int, snap: Any, generation: int, members: list[str]
    ) -> tuple[int, dict[str, Any]]:
        """The DCP format's part: this writer's chunks in one data file (torch.save
        records), written under its final name; its size and its part manifest."""
        assert isinstance(snap, ShardSnapshot)
        entries: list[dict[str, Any]] = []
        crc, off = 0, 0
        with atomic_file(final, fsync=self.config.fsync, unless=d / MARKER) as out:
            for (fqn, lo, hi), t in zip(snap.chunks, snap.staging, strict=True):
                if self._cancel.is_set():
                    raise RuntimeError("writer closed (close(wait=False)) during the save")
                snap.wait_copied(t)  # the copy runs during the next step; follow it
                sink = _save_chunk(out, t, crc)
                entries.append(
                    {
                        "fqn": fqn,
                        "lo": lo,
                        "hi": hi,
                        "offset": off,
                        "length": sink.written,
                        "data_offset": off + sink.data_at[0],
                        "nbytes": sink.nbytes,
                        "block_crc32": sink.block_crc32,
                    }
                )
                crc = sink.crc
                off += sink.written
        manifest = {
            "format": FORMAT,
            "kind": KIND,
            "step": step,
            "generation": generation,
            "members": members,
            "shard": snap.shard,
            "num_shards": snap.num_shards,
            "file": final.name,
            "size": off,
            "crc32": crc,
            "byteorder": sys.byteorder,
            "block_bytes": BLOCK_BYTES,
            "tensors": _tensor_list(snap.tensors),
            "chunks": entries,
            "meta": json.loads(snap.meta_json),
            "created_unix": time.time(),
        }
        return off, manifest


# ---- commit and verification -----------------------------------------------------------


def import_commit_modules() -> None:
    """Import what a commit needs of torch's DCP (`_dcp_metadata`), which imports
    torch.distributed.tensor and sympy: seconds on a busy machine. A process that
    has not imported it already (a JAX job's, a replicated torch job's) calls this
    on a background thread at start, so that its first commit is not late by that
    much (measured: a JAX replica job's step-4 checkpoint committed only 3 s after
    its parts were written, and a kill in between lost it)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401
    import torch.distributed.checkpoint.metadata  # noqa: F401


def _dcp_metadata(tensors: Mapping[str, dict[str, Any]], checkpoint_id: str) -> Any:
    """DCP's `Metadata` of every chunk of ``tensors`` (the marker's "tensors")."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    sd_md: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    for fqn, t in tensors.items():
        shape = tuple(t["shape"])
        chunks = []
        for c in t["chunks"]:
            offsets, sizes = chunk_box(shape, c["lo"], c["hi"])
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            storage[MetadataIndex(fqn, offsets)] = _StorageInfo(c["file"], c["offset"], c["length"])
        sd_md[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=dtype_from_name(t["dtype"])), torch.Size(shape), chunks
        )
    return Metadata(
        state_dict_metadata=sd_md,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id),
        version=DCP_VERSION,
    )


def _index(parts: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The marker's "tensors": fqn -> dtype, shape and every chunk (with its file),
    from the part manifests; ValueError if a chunk names an undeclared tensor or
    the chunks of a tensor do not tile its rows."""
    tensors: dict[str, dict[str, Any]] = {
        str(f): {"dtype": str(d), "shape": [int(x) for x in s], "chunks": []}
        for f, d, s in parts[0]["tensors"]
    }
    for p in parts:
        for c in p["chunks"]:
            t = tensors.get(c["fqn"])
            if t is None:
                raise ValueError(f"{p['file']} holds a chunk of undeclared tensor {c['fqn']!r}")
            box = chunk_box(t["shape"], int(c["lo"]), int(c["hi"]))[1]
            itemsize = dtype_from_name(t["dtype"]).itemsize
            if int(c["nbytes"]) != math.prod(box) * itemsize:
                raise ValueError(f"{p['file']}: chunk of {c['fqn']!r} has the wrong size")
            t["chunks"].append({**c, "file": p["file"]})
    for fqn, t in tensors.items():
        t["chunks"].sort(key=lambda c: c["lo"])
        why = tiling_problem([(c["lo"], c["hi"]) for c in t["chunks"]], row_count(t["shape"]))
        if why is not None:
            raise ValueError(f"tensor {fqn!r}: {why}")
    return tensors


class _Dcp:
    kind = KIND

    def marker_body(self, d: Path, c: CommitOrder) -> dict[str, Any]:
        """Check the parts of sharded checkpoint ``step``, write DCP's ``.metadata``;
        the commit marker's body (`commit_with` writes it).

        Who calls it: exactly one process per checkpoint (rank 0 of the generation),
        once every part manifest exists (`num_shards` writers). Blocking (reads every
        data file once when ``verify_checksums``). Idempotent like `commit`. Raises
        CommitError naming the file, writing no marker, when a part is missing, of
        another step, generation or member list, declares other tensors, has a data
        file of the wrong size or CRC-32, or when the chunks of a tensor do not tile
        its rows (a membership change mid-write never yields a "complete" checkpoint).
        """
        step, generation, members, num_shards = c.step, c.generation, c.members, c.num_shards
        verify_checksums, fsync = c.verify_checksums, c.fsync
        parts: list[dict[str, Any]] = []
        for k in range(num_shards):
            want: dict[str, Any] = {
                "kind": KIND,
                "step": step,
                "generation": generation,
                "num_shards": num_shards,
                "shard": k,
                "members": list(members),
                "file": data_file_name(k),
            }
            pm = read_part_manifest(d, step, k, num_shards, want)
            mp = d / shard_manifest_name(k, num_shards)
            if parts and pm.get("tensors") != parts[0]["tensors"]:
                raise CommitError(f"cannot commit step {step}: {mp} declares other tensors")
            if pm.get("byteorder") != sys.byteorder:
                raise CommitError(
                    f"cannot commit step {step}: {mp} was written {pm.get('byteorder')}"
                )
            try:
                _check_file(d / pm["file"], int(pm["size"]), int(pm["crc32"]), verify_checksums)
            except CheckpointCorrupt as e:
                raise CommitError(f"cannot commit step {step}: {e}") from e
            parts.append(pm)
        try:
            tensors = _index(parts)
            meta_bytes = pickle.dumps(_dcp_metadata(tensors, str(d)))
        except (KeyError, TypeError, ValueError) as e:
            raise CommitError(f"cannot commit step {step}: {e}") from e
        write_atomically(d / METADATA, meta_bytes, fsync=fsync)
        files = [
            {"file": p["file"], "size": int(p["size"]), "crc32": int(p["crc32"])} for p in parts
        ]
        body = {
            "format": FORMAT,
            "kind": KIND,
            "step": step,
            "generation": generation,
            "members": list(members),
            "num_shards": num_shards,
            "byteorder": sys.byteorder,
            "block_bytes": int(parts[0]["block_bytes"]),
            "total_bytes": sum(f["size"] for f in files),
            "files": files,
            "metadata": {
                "file": METADATA,
                "size": len(meta_bytes),
                "crc32": zlib.crc32(meta_bytes),
                "sha256": hashlib.sha256(meta_bytes).hexdigest(),
            },
            "tensors": tensors,
            "meta": parts[0]["meta"],
            "committed_unix": time.time(),
        }
        return body

    def verify(self, d: Path, marker: dict[str, Any], verify_checksums: bool) -> VerifiedCheckpoint:
        return verify_marker(d, marker, verify_checksums)


DCP: Format = _Dcp()
"""The DCP format (a sharded job's checkpoints; a replicated one's with --ckpt-format dcp)."""

commit_sharded = functools.partial(commit_with, DCP)
"""`commit_with` the DCP format: what a sharded job's committer calls."""


def verify_marker(d: Path, m: dict[str, Any], verify_checksums: bool) -> VerifiedCheckpoint:
    """Verify the sharded checkpoint whose parsed marker is ``m`` in step directory
    ``d``: every data file and ``.metadata`` has the size (and CRC-32) the marker
    claims and every tensor's chunks tile its rows; CheckpointCorrupt naming the
    file otherwise. (`elastrain.checkpoint.store` calls it for markers of this kind.)"""
    try:
        step, n, files = int(m["step"]), int(m["num_shards"]), list(m["files"])
        if d.name != step_dir(d.parent, step).name:
            raise ValueError(f"it claims step {step}")
        if n < 1 or [f["file"] for f in files] != [data_file_name(k) for k in range(n)]:
            raise ValueError("its data files are not those of its writers")
        if m["byteorder"] != sys.byteorder:
            raise ValueError(f"it was written on a {m['byteorder']}-endian machine")
        names = {f["file"] for f in files}
        for fqn, t in m["tensors"].items():
            chunks = t["chunks"]
            if any(c["file"] not in names for c in chunks):
                raise ValueError(f"a chunk of {fqn!r} names a file it does not list")
            why = tiling_problem([(c["lo"], c["hi"]) for c in chunks], row_count(t["shape"]))
            if why is not None:
                raise ValueError(f"tensor {fqn!r}: {why}")
        md = m["metadata"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{d / MARKER} is not a valid commit marker: {e}") from e
    for f in files:
        _check_file(d / f["file"], int(f["size"]), int(f["crc32"]), verify_checksums)
    _check_file(d / METADATA, int(md["size"]), int(md["crc32"]), verify_checksums)
    return VerifiedCheckpoint(
        d,
        step,
        int(m["generation"]),
        list(m["members"]),
        n,
        int(m["total_bytes"]),
        m["meta"],
        m,
        kind=KIND,
    )


# ---- reading -------------------------------------------------------------------------


class ShardedReader:
    """Reads rows of a committed sharded checkpoint, from its marker's JSON only.

    Who uses it: a resuming member, for the rows of its new shard (any shard size),
    or a replicated member, for whole tensors. Local and blocking; reads only the
    `BLOCK_BYTES` blocks that hold the rows asked for, checking each block's CRC-32
    (CheckpointCorrupt naming the file if one changed). Never unpickles.
    ``bytes_read`` counts what it read. Close it (or use ``with``) to close its files.
    """

    def __init__(self, ckpt: VerifiedCheckpoint) -> None:
        m = ckpt.manifest
        if ckpt.kind != KIND:
            raise CheckpointError(f"{ckpt.path} is not a sharded checkpoint")
        if m.get("byteorder") != sys.byteorder:
            raise CheckpointError(f"{ckpt.path} was written on a {m.get('byteorder')} machine")
        self.path = ckpt.path
        self.step = ckpt.step
        self.block = int(m["block_bytes"])
        self.tensors: dict[str, dict[str, Any]] = m["tensors"]
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def __enter__(self) -> ShardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def has(self, fqn: str) -> bool:
        return fqn in self.tensors

    def info(self, fqn: str) -> tuple[torch.dtype, tuple[int, ...]]:
        """The dtype and shape of tensor ``fqn``; KeyError if the checkpoint lacks it."""
        t = self.tensors[fqn]
        return dtype_from_name(t["dtype"]), tuple(int(x) for x in t["shape"])

    def read(self, fqn: str) -> torch.Tensor:
        """The whole tensor ``fqn``, in its shape."""
        _, shape = self.info(fqn)
        return self.read_rows(fqn, 0, row_count(shape)).reshape(shape)

    def read_rows(self, fqn: str, lo: int, hi: int) -> torch.Tensor:
        """Rows ``[lo, hi)`` of tensor ``fqn`` as a new tensor (a 0-dim tensor is one
        row: shape (1,)). Reads only the blocks of the saved chunks that hold them."""
        dtype, shape = self.info(fqn)
        rows = row_shape(shape)
        if not 0 <= lo <= hi <= rows[0]:
            raise ValueError(f"rows {lo}-{hi} of {fqn!r} {list(shape)}")
        out = torch.empty((hi - lo, *rows[1:]), dtype=dtype)
        if out.numel() == 0:
            return out
        row_bytes = math.prod(rows[1:]) * dtype.itemsize
        dst = byte_view(out).numpy()
        chunks = self.tensors[fqn]["chunks"]
        for i, a, b in cover([(c["lo"], c["hi"]) for c in chunks], lo, hi):
            c = chunks[i]
            s, e = (a - c["lo"]) * row_bytes, (b - c["lo"]) * row_bytes
            dst[(a - lo) * row_bytes : (b - lo) * row_bytes] = self._raw(c, s, e)
        return out

    def _raw(self, c: dict[str, Any], s: int, e: int) -> np.ndarray:
        """Bytes ``[s, e)`` of chunk ``c``'s raw data, its blocks' CRC-32s checked."""
        block = self.block
        bs, be = s // block * block, min(int(c["nbytes"]), -(-e // block) * block)
        path = self.path / c["file"]
        fd = self._fds.get(c["file"])
        if fd is None:
            fd = self._fds[c["file"]] = os.open(path, os.O_RDONLY)
        buf = bytearray(be - bs)
        view = memoryview(buf)
        got = 0
        while got < len(buf):
            n = os.preadv(fd, [view[got:]], int(c["data_offset"]) + bs + got)
            if not n:
                raise CheckpointCorrupt(f"{path} ended early (truncated since it was verified)")
            got += n
        self.bytes_read += len(buf)
        crcs = c["block_crc32"]
        for at in range(bs, be, block):
            part = view[at - bs : min(at + block, be) - bs]
            if zlib.crc32(part) != crcs[at // block]:
                raise CheckpointCorrupt(
                    f"{path}: bytes {at}-{at + len(part)} of {c['fqn']!r} rows "
                    f"{c['lo']}-{c['hi']} fail their crc32 (changed on disk)"
                )
        return np.frombuffer(buf, dtype=np.uint8)[s - bs : e - bs]


__all__ = [
    "BLOCK_BYTES",
    "KIND",
    "METADATA",
    "Chunk",
    "ShardParts",
    "ShardSnapshot",
    "ShardedReader",
    "ShardedWriter",
    "chunk_box",
    "commit_sharded",
    "cover",
    "crc32_combine",
    "data_file_name",
    "import_commit_modules",
    "model_key",
    "optim_key",
    "row_count",
    "row_shape",
    "tiling_problem",
    "verify_marker",
]

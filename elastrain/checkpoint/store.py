"""Commit, verify, find and load checkpoints (local file I/O, no communication)."""

from __future__ import annotations

import copy
import logging
import os
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import torch

from elastrain.checkpoint.files import (
    FORMAT,
    MARKER,
    CheckpointCorrupt,
    CheckpointError,
    CommitError,
    list_steps,
    read_signed_json,
    shard_file_name,
    shard_manifest_name,
    step_dir,
    write_signed_json,
)
from elastrain.checkpoint.layout import Layout
from elastrain.transfer.dtypes import byte_view

log = logging.getLogger(__name__)

_READ_CHUNK = 16 << 20


@dataclass(frozen=True)
class VerifiedCheckpoint:
    """A committed checkpoint whose shards matched their sizes (and checksums, if checked).

    ``manifest`` is the parsed commit marker; ``meta`` is shard 0's meta dict.
    ``kind`` is "flat" (striped safetensors, `load`) or "dcp" (a sharded job's
    checkpoint in DCP format, `elastrain.checkpoint.dcp.ShardedReader`).
    """

    path: Path
    step: int
    generation: int
    members: list[str]
    num_shards: int
    total_bytes: int
    meta: dict[str, Any]
    manifest: dict[str, Any]
    kind: str = "flat"


def _file_crc32(path: Path, size: int) -> int:
    crc, buf = 0, bytearray(min(_READ_CHUNK, max(size, 1)))
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _check_file(path: Path, size: int, crc: int, verify_checksums: bool) -> None:
    """CheckpointCorrupt naming ``path`` unless it exists with ``size`` bytes and ``crc``."""
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing") from None
    if actual != size:
        how = "truncated" if actual < size else "has extra bytes"
        raise CheckpointCorrupt(f"{path} is {actual} bytes, manifest says {size} ({how})")
    if verify_checksums:
        got = _file_crc32(path, size)
        if got != crc:
            raise CheckpointCorrupt(
                f"{path} has crc32 {got:#010x}, manifest says {crc:#010x} (bytes changed on disk)"
            )


def _check_ranges(where: Path, layout: Layout, ranges: Sequence[Any], num_shards: int) -> None:
    bounds = layout.bounds(num_shards)
    for i, r in enumerate(ranges):
        if list(r) != [bounds[i], bounds[i + 1]]:
            raise CheckpointCorrupt(
                f"{where}: shard {i} range {r} is not the striping of its layout"
            )


def _verify(d: Path, verify_checksums: bool) -> VerifiedCheckpoint:
    """Verify the committed checkpoint in step directory ``d``; CheckpointCorrupt if not."""
    marker = d / MARKER
    if not marker.exists():
        raise CheckpointCorrupt(
            f"{marker} is missing: the save never completed (or is still in flight)"
        )
    m = read_signed_json(marker)
    return format_of(m).verify(d, m, verify_checksums)


def _verify_flat(d: Path, m: dict[str, Any], verify_checksums: bool) -> VerifiedCheckpoint:
    """Verify the flat checkpoint whose parsed marker is ``m`` in step directory ``d``."""
    marker = d / MARKER
    try:
        step, n, shards = int(m["step"]), int(m["num_shards"]), list(m["shards"])
        layout = Layout.from_json(m["layout"])
        if d.name != step_dir(d.parent, step).name:
            raise ValueError(f"it claims step {step}")
        if n < 1 or len(shards) != n or layout.total != int(m["total_bytes"]):
            raise ValueError("its shard count or total size is inconsistent")
        if layout.sha256 != m["layout_sha256"]:
            raise ValueError("its layout does not match its layout_sha256")
        ranges = [s["range"] for s in shards]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointCorrupt(f"{marker} is not a valid commit marker: {e}") from e
    _check_ranges(marker, layout, ranges, n)
    for i, s in enumerate(shards):
        if s.get("file") != shard_file_name(i, n):
            raise CheckpointCorrupt(f"{marker} names an unexpected file {s.get('file')!r}")
        _check_file(d / s["file"], int(s["size"]), int(s["crc32"]), verify_checksums)
    return VerifiedCheckpoint(
        d, step, int(m["generation"]), list(m["members"]), n, layout.total, m["meta"], m
    )


def read_part_manifest(
    d: Path, step: int, k: int, num_shards: int, want: dict[str, Any]
) -> dict[str, Any]:
    """Part `k` of `num_shards`'s manifest of step `step` in its directory `d`, whose
    keys must hold `want`'s values. CommitError, saying to save a later step, if it is
    missing (its writer failed, left or is still writing), does not verify, or was
    written for another step, generation, layout or membership."""
    mp = d / shard_manifest_name(k, num_shards)
    if not mp.exists():
        raise CommitError(
            f"cannot commit step {step}: shard {k} of {num_shards} is missing ({mp} does not "
            "exist; its writer failed, left, or is still writing). Save a later step."
        )
    try:
        m = read_signed_json(mp)
    except CheckpointCorrupt as e:
        raise CommitError(f"cannot commit step {step}: {e}") from e
    for key, value in want.items():
        if m.get(key) != value:
            raise CommitError(
                f"cannot commit step {step}: {mp} has {key}={m.get(key)!r}, expected "
                f"{value!r} (membership changed during the write?). Save a later step."
            )
    return m


@dataclass(frozen=True)
class CommitOrder:
    """What `commit_with` is asked to commit, as a `Format` checks it."""

    step: int
    generation: int
    members: list[str]
    num_shards: int
    verify_checksums: bool
    fsync: bool


class Format(Protocol):
    """One on-disk checkpoint format, as the commit and the verification see it.

    The formats share everything else: the step directories, the durable write of
    every file (`atomic_file`), the part manifests, the commit marker and its
    protocol (`commit_with`), the retention. `FLAT` is the striped safetensors
    format (`Snapshot`, `CheckpointWriter`); `elastrain.checkpoint.dcp.DCP` the DCP
    one (`ShardSnapshot`, `ShardedWriter`); a plain torch DCP directory is a
    restore source only (`elastrain.checkpoint.plain`), never written or committed.
    """

    kind: str
    """The marker's "kind" (a flat marker has none: "flat")."""

    def marker_body(self, d: Path, c: CommitOrder) -> dict[str, Any]:
        """Check every part of step directory ``d`` (each part manifest present, of
        this step, generation and members, its data file of the size and CRC-32 it
        claims); the commit marker's body. May write the format's own files first
        (DCP's ``.metadata``). CommitError naming the file, writing no marker."""
        ...

    def verify(self, d: Path, marker: dict[str, Any], verify_checksums: bool) -> VerifiedCheckpoint:
        """Verify the committed checkpoint whose parsed marker is ``marker``;
        CheckpointCorrupt naming what is wrong."""
        ...


class _Flat:
    kind = "flat"

    def marker_body(self, d: Path, c: CommitOrder) -> dict[str, Any]:
        step, generation, members, num_shards = c.step, c.generation, c.members, c.num_shards
        verify_checksums = c.verify_checksums
        manifests: list[dict[str, Any]] = []
        for i in range(num_shards):
            want = {"step": step, "generation": generation, "num_shards": num_shards, "shard": i}
            sm = read_part_manifest(d, step, i, num_shards, {**want, "members": list(members)})
            if manifests and sm.get("layout_sha256") != manifests[0]["layout_sha256"]:
                mp = d / shard_manifest_name(i, num_shards)
                raise CommitError(f"cannot commit step {step}: {mp} has a different state layout")
            manifests.append(sm)
        try:
            layout = Layout.from_json(manifests[0]["layout"])
            if layout.sha256 != manifests[0]["layout_sha256"]:
                raise ValueError("layout does not match layout_sha256")
            _check_ranges(d, layout, [sm["range"] for sm in manifests], num_shards)
            for sm in manifests:
                _check_file(d / sm["file"], int(sm["size"]), int(sm["crc32"]), verify_checksums)
        except (CheckpointCorrupt, KeyError, TypeError, ValueError) as e:
            raise CommitError(f"cannot commit step {step}: {e}") from e
        body = {
            "format": FORMAT,
            "step": step,
            "generation": generation,
            "members": list(members),
            "num_shards": num_shards,
            "total_bytes": layout.total,
            "layout_sha256": layout.sha256,
            "layout": manifests[0]["layout"],
            "meta": manifests[0]["meta"],
            "shards": [{k: sm[k] for k in ("file", "size", "crc32", "range")} for sm in manifests],
            "committed_unix": time.time(),
        }
        return body

    def verify(self, d: Path, marker: dict[str, Any], verify_checksums: bool) -> VerifiedCheckpoint:
        return _verify_flat(d, marker, verify_checksums)


FLAT: Format = _Flat()
"""The flat format (striped safetensors shards)."""


def format_of(marker: dict[str, Any]) -> Format:
    """The format of a parsed commit marker."""
    if marker.get("kind") == "dcp":
        from elastrain.checkpoint.dcp import DCP

        return DCP
    return FLAT


def commit_with(
    fmt: Format,
    directory: str | os.PathLike[str],
    step: int,
    *,
    generation: int,
    members: list[str],
    num_shards: int,
    verify_checksums: bool = True,
    fsync: bool = True,
) -> Path:
    """Make checkpoint ``step`` of format ``fmt`` count: verify its parts, then write the commit marker.

    Who calls it: exactly one process per checkpoint (rank 0 of the generation,
    or the coordinator), after every member reported its `SaveResult` ok for
    ``step``. Blocking (reads every shard once when ``verify_checksums``; run
    it off the training thread for big states). Idempotent: if ``step`` is
    already committed and verifies, returns the marker without writing.

    Checks, for each shard ``0..num_shards-1``: its manifest exists and is
    intact, carries this ``step``, ``generation``, ``members`` and
    ``num_shards``, all shards agree on the layout and its striping, and the
    data file has the size (and CRC-32) its manifest claims. Any failure
    raises CommitError naming the shard file and writes nothing, so a
    membership change during the write (a member gone, a shard from another
    generation) never yields a checkpoint that claims to be complete. The
    marker (step, generation, members, layout, shard files with sizes and
    CRC-32s, shard 0's meta, format version) is written atomically (temp file,
    fsync, rename, directory fsync). Returns its path.
    """
    d = step_dir(directory, step)
    marker = d / MARKER
    if marker.exists():
        try:
            fmt.verify(d, read_signed_json(marker), verify_checksums)
        except CheckpointCorrupt as e:
            raise CommitError(f"step {step} already has a marker that does not verify: {e}") from e
        log.info("checkpoint step %d was already committed (%s)", step, marker)
        return marker
    if num_shards < 1 or not members:
        raise ValueError(f"need num_shards >= 1 and members, got {num_shards}, {members!r}")
    order = CommitOrder(step, generation, list(members), num_shards, verify_checksums, fsync)
    body = fmt.marker_body(d, order)
    write_signed_json(marker, body, fsync=fsync)
    log.info(
        "%s checkpoint step %d committed (%d parts, %d bytes)",
        fmt.kind,
        step,
        num_shards,
        body["total_bytes"],
    )
    return marker


commit = partial(commit_with, FLAT)
"""`commit_with` the flat format: what a replicated job's committer calls."""


def latest_verified(
    directory: str | os.PathLike[str],
    *,
    verify_checksums: bool = True,
    on_skip: Callable[[int, Path, str], None] | None = None,
) -> VerifiedCheckpoint | None:
    """The newest checkpoint under ``directory`` that is committed and verifies, or None.

    Who calls it: every process that resumes (or the launcher, once, before
    starting workers); local and read-only. Walks step directories newest
    first; each one without a marker, with a damaged marker, or with a shard
    whose size or CRC-32 does not match is skipped with ``logging.warning``
    naming the file and the fault, and the previous one is tried. Blocking:
    reads the newest good checkpoint in full when ``verify_checksums``.
    ``on_skip(step, step_dir, reason)`` is called for each skipped one as well
    (e.g. to show the warning to the user or record an event).
    """
    for step, d in reversed(list_steps(directory)):
        try:
            ckpt = _verify(d, verify_checksums)
        except CheckpointCorrupt as e:
            log.warning("skipping checkpoint step %d: %s; trying the previous one", step, e)
            if on_skip is not None:
                on_skip(step, d, str(e))
            continue
        log.info("newest verified checkpoint: step %d (%s)", step, d)
        return ckpt
    return None


def load(
    ckpt: VerifiedCheckpoint,
    *,
    verify_checksums: bool = True,
    names: Callable[[str], bool] | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Reassemble the full state from every shard of ``ckpt``: ``(tensors, meta)``.

    Returns new CPU tensors under the names, dtypes and shapes passed to
    `Snapshot.take`, in that order, bit for bit, and shard 0's meta. With
    ``names``, only the tensors whose name it accepts (the others' bytes are
    still read, into a small scratch buffer, for the CRC-32). Local and
    blocking (reads every shard once). Raises CheckpointCorrupt naming the
    file if a shard changed since it was verified (size or CRC-32, when
    ``verify_checksums``); no partial state is returned. A sharded checkpoint
    (``ckpt.kind`` "dcp") is read with `elastrain.checkpoint.dcp.ShardedReader`
    instead: CheckpointError.
    """
    if ckpt.kind != "flat":
        raise CheckpointError(
            f"{ckpt.path} is a sharded ({ckpt.kind}) checkpoint: read it with "
            "elastrain.checkpoint.dcp.ShardedReader (or torch.distributed.checkpoint.load)"
        )
    layout = Layout.from_json(ckpt.manifest["layout"])
    tensors = {
        e.name: torch.empty(e.shape, dtype=e.torch_dtype)
        for e in layout.entries
        if names is None or names(e.name)
    }
    scratch = memoryview(bytearray(0))
    for s in ckpt.manifest["shards"]:
        path = ckpt.path / s["file"]
        lo, hi = s["range"]
        size = int(s["size"])
        header_len = size - (hi - lo)
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != size or header_len < 8:
                raise CheckpointCorrupt(f"{path} is not {size} bytes any more; verify again")
            crc = zlib.crc32(_read_exact(f, memoryview(bytearray(header_len)), path))
            for p in layout.pieces(lo, hi):
                a, n = p.start - p.entry.offset, p.end - p.start
                if p.entry.name in tensors:
                    dst = byte_view(tensors[p.entry.name]).numpy().data[a : a + n]
                    for i in range(0, n, _READ_CHUNK):
                        crc = zlib.crc32(_read_exact(f, dst[i : i + _READ_CHUNK], path), crc)
                    continue
                if len(scratch) < min(n, _READ_CHUNK):
                    scratch = memoryview(bytearray(min(n, _READ_CHUNK)))
                for i in range(0, n, _READ_CHUNK):
                    part = scratch[: min(_READ_CHUNK, n - i)]
                    crc = zlib.crc32(_read_exact(f, part, path), crc)
        if verify_checksums and crc != int(s["crc32"]):
            raise CheckpointCorrupt(f"{path} changed on disk since it was verified (crc32)")
    return tensors, copy.deepcopy(ckpt.meta)


def _read_exact(f: Any, dst: memoryview, path: Path) -> memoryview:
    got = 0
    while got < len(dst):
        n = f.readinto(dst[got:])
        if not n:
            raise CheckpointCorrupt(f"{path} ended early (truncated while loading)")
        got += n
    return dst

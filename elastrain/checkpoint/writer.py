"""`CheckpointWriter`: writes one member's shard in a background thread.

One save is in flight per writer. A `save_async` while another save is still
running is *skipped* (its `SaveResult` says so at once) unless ``block=True``,
which waits for the running save first (use that for an emergency checkpoint).
Skipping keeps the training thread from ever waiting on the disk; a
checkpoint interval shorter than the write time just means fewer checkpoints.
"""

from __future__ import annotations

import errno as errno_mod
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from elastrain.checkpoint.config import CheckpointConfig
from elastrain.checkpoint.deferred import CopyFailed
from elastrain.checkpoint.files import (
    FORMAT,
    MARKER,
    atomic_file,
    make_step_dir,
    remove_quietly,
    shard_file_name,
    shard_manifest_name,
    step_dir,
    write_signed_json,
)
from elastrain.checkpoint.layout import safetensors_header
from elastrain.checkpoint.snapshot import Snapshot

log = logging.getLogger(__name__)

EventSink = Callable[[str, dict[str, Any]], None]

CHUNK_BYTES = 32 << 20
"""Bytes per `DurableFile.write`; a cancelled save (``close(wait=False)``) stops between chunks."""


class SnapshotLike(Protocol):
    """What a writer needs of a snapshot: its shard, and exclusive use of its buffers
    while it is written (`Snapshot`; `elastrain.checkpoint.dcp.ShardSnapshot`)."""

    shard: int
    num_shards: int

    @property
    def handed_over(self) -> bool: ...

    def wait_copied(self, part: Any = None) -> None: ...

    def _acquire(self) -> bool: ...

    def _release(self) -> None: ...


@dataclass(frozen=True)
class SaveResult:
    """What happened to one `save_async`.

    ``status``: ``"ok"`` (shard file and shard manifest durable), ``"failed"``
    (``error`` says why, ``errno`` is set for OS errors such as ENOSPC; temp
    files were removed) or ``"skipped"`` (nothing written: another save was in
    flight or the step is already committed; or rank 0 gave the step up and
    removed its directory while this shard was being finished). ``bytes`` is the shard file size,
    ``seconds`` the background write time, ``path`` the shard file.
    """

    step: int
    shard: int
    status: Literal["ok", "failed", "skipped"]
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    errno: int | None = None
    path: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class SaveHandle:
    """Completion handle of one save; thread-safe."""

    def __init__(self, result: SaveResult | None = None) -> None:
        self._done = threading.Event()
        self._result = result
        if result is not None:
            self._done.set()

    def _finish(self, result: SaveResult) -> None:
        self._result = result
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveResult:
        """Block until the save finished; TimeoutError if ``timeout`` seconds pass first.

        Never raises the save's own error: a failed save returns a failed result.
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint save still running after {timeout} s")
        assert self._result is not None
        return self._result


class CheckpointWriter:
    """Writes snapshots of one member's shard to ``config.directory`` in the background.

    Who uses it: each member holds one writer for its lifetime, calls
    `save_async` from the training thread, and reports the handle's result
    to whoever calls `commit` for the step (rank 0 / the coordinator).

    Per save, in the writer thread: create ``step-XXXXXXXX/``, write the
    shard as a safetensors file to a hidden temp file while a second thread
    computes its CRC-32, each chunk once the snapshot's copy of it is done
    (`Snapshot.wait_copied`: the copy runs during the next step and the writes
    follow it), with the kernel's writeback started as the bytes go out
    (`DurableFile`), fsync it, rename it to ``shard-KKKKK-of-NNNNN.safetensors``,
    fsync the directory, then write the shard's JSON manifest (step,
    generation, members, size, crc32, layout, meta) the same way. The manifest
    appears only after the data is durable, so its presence means "this shard
    is written". Failure (ENOSPC, EIO, anything): the save's files are
    removed, ``events("checkpoint_failed", ...)`` is called and logged at
    ERROR, the result is failed, and the writer accepts the next save (so does
    a failed deferred snapshot copy: ``phase`` "snapshot" in its event). A
    committed checkpoint is never written into or modified.

    ``events`` is called from the writer thread (or from `save_async` for a
    skip) with ``("checkpoint_saved" | "checkpoint_failed" | "checkpoint_skipped",
    fields)``; its exceptions are logged and ignored.
    """

    def __init__(self, config: CheckpointConfig, *, events: EventSink | None = None) -> None:
        self.config = config
        self._events = events
        self._lock = threading.Lock()
        self._inflight: SaveHandle | None = None
        self._closed = False
        self._cancel = threading.Event()

    @property
    def busy(self) -> bool:
        """True while a save is in flight (a non-blocking `save_async` would be skipped).

        Check it before `Snapshot.take` to avoid copying a snapshot that would be skipped.
        """
        with self._lock:
            return self._inflight is not None and not self._inflight.done()

    def save_async(
        self,
        step: int,
        snapshot: SnapshotLike,
        *,
        generation: int,
        members: list[str],
        block: bool = False,
    ) -> SaveHandle:
        """Start writing ``snapshot`` as shard ``snapshot.shard`` of checkpoint ``step``.

        Returns at once (unless ``block=True`` and a save is in flight, which
        is waited for first). ``generation`` and ``members`` are those of the
        generation that took the snapshot; every shard of one checkpoint must
        carry the same ones or `commit` refuses. The snapshot's buffer is read
        until the handle completes; do not reuse it (``into=``) before that.
        Raises RuntimeError after `close`, ValueError for bad arguments.
        """
        if step < 0 or generation < 0:
            raise ValueError(f"step and generation must be >= 0, got {step}, {generation}")
        if not members or not all(isinstance(m, str) for m in members):
            raise ValueError(f"members must be a non-empty list of member ids, got {members!r}")
        if snapshot.handed_over:
            raise ValueError("snapshot buffer was handed to a newer snapshot (into=); take again")
        if (step_dir(self.config.directory, step) / MARKER).exists():
            return self._skip(step, snapshot, "step is already committed")
        while True:
            with self._lock:
                if self._closed:
                    raise RuntimeError("CheckpointWriter is closed")
                prev = self._inflight
                if prev is None or prev.done():
                    if not snapshot._acquire():
                        raise ValueError("snapshot is being written by another save")
                    handle = SaveHandle()
                    self._inflight = handle
                    break
            if not block:
                return self._skip(step, snapshot, "another save is still in flight")
            prev.wait()
        args = (step, snapshot, generation, list(members), handle)
        threading.Thread(target=self._run, args=args, name="ckpt-writer", daemon=True).start()
        return handle

    def close(self, wait: bool = True) -> None:
        """Stop accepting saves. ``wait=True`` waits for the in-flight save to finish;
        ``wait=False`` cancels it (it stops at the next chunk, fails with "writer
        closed" and removes its temp files) and returns without waiting."""
        with self._lock:
            self._closed = True
            inflight = self._inflight
        if inflight is None:
            return
        if wait:
            inflight.wait()
        else:
            self._cancel.set()

    def _emit(self, kind: str, fields: dict[str, Any]) -> None:
        if self._events is None:
            return
        try:
            self._events(kind, fields)
        except Exception:
            log.exception("checkpoint events callback failed for %s", kind)

    def _skip(self, step: int, snapshot: SnapshotLike, reason: str) -> SaveHandle:
        return SaveHandle(self._skipped({"step": step, "shard": snapshot.shard}, reason))

    def _skipped(self, fields: dict[str, Any], reason: str) -> SaveResult:
        """A save that writes nothing (``fields``: its event's, with step and shard)."""
        step, shard = fields["step"], fields["shard"]
        log.info("checkpoint step %d shard %d skipped: %s", step, shard, reason)
        self._emit("checkpoint_skipped", fields | {"reason": reason})
        return SaveResult(step, shard, "skipped", error=reason)

    def _run(
        self, step: int, snap: SnapshotLike, generation: int, members: list[str], handle: SaveHandle
    ) -> None:
        res = SaveResult(step, snap.shard, "failed", error="internal error in the writer thread")
        try:
            res = self._save(step, snap, generation, members)
        finally:
            snap._release()
            handle._finish(res)

    def _save(
        self, step: int, snap: SnapshotLike, generation: int, members: list[str]
    ) -> SaveResult:
        """One save, start to end; never raises (failures become a failed result)."""
        t0 = time.perf_counter()
        d = step_dir(self.config.directory, step)
        final = self._data_path(d, snap)
        fields: dict[str, Any] = {
            "step": step,
            "shard": snap.shard,
            "num_shards": snap.num_shards,
            "generation": generation,
            "path": str(final),
        }
        try:
            # A snapshot's copy may still be running (deferred, or queued on a device):
            # `_write` waits for each part before it reads it.
            size = self._write(d, final, step, snap, generation, members)
        except Exception as e:
            if isinstance(e, FileNotFoundError) and not d.exists():
                # Rank 0 gave the step up (another shard failed) and removed its
                # directory: once this shard's manifest is visible, only the
                # directory's fsync after it is left to fail. Not this shard's failure.
                why = "its step was given up and its directory removed while this shard was written"
                return self._skipped(fields, why)
            err = getattr(e, "errno", None)
            msg = f"{type(e).__name__}: {e}"
            if err is not None and not isinstance(err, int):
                err = None
            res = SaveResult(
                step, snap.shard, "failed", 0, time.perf_counter() - t0, msg, err, str(final)
            )
            log.error("checkpoint step %d shard %d failed (%s): %s", step, snap.shard, final, msg)
            fields.update(error=msg, errno=err, errno_name=errno_mod.errorcode.get(err or -1))
            if isinstance(e, CopyFailed):
                fields["phase"] = "snapshot"
            self._emit("checkpoint_failed", fields)
        else:
            res = SaveResult(
                step, snap.shard, "ok", size, time.perf_counter() - t0, path=str(final)
            )
            log.info("checkpoint step %d shard %d written: %d bytes", step, snap.shard, size)
            self._emit("checkpoint_saved", fields | {"bytes": size, "seconds": res.seconds})
        return res

    def _data_path(self, d: Path, snap: Any) -> Path:
        """The data file of ``snap`` in step directory ``d``."""
        return d / shard_file_name(snap.shard, snap.num_shards)

    def _write(
        self, d: Path, final: Path, step: int, snap: Any, generation: int, members: list[str]
    ) -> int:
        """Write the data file, then the part manifest (both durable, whatever the
        format: `atomic_file`); returns the data file's size. Raises on failure,
        leaving neither behind."""
        make_step_dir(d, fsync=self.config.fsync)
        size, manifest = self._write_part(d, final, step, snap, generation, members)
        mpath = d / shard_manifest_name(snap.shard, snap.num_shards)
        try:
            write_signed_json(mpath, manifest, fsync=self.config.fsync)
        except BaseException:
            remove_quietly(final)
            raise
        return size

    def _write_part(
        self, d: Path, final: Path, step: int, snap: Any, generation: int, members: list[str]
    ) -> tuple[int, dict[str, Any]]:
        """The flat format's part: its shard file, written under its final name;
        returns the file's size and its part manifest."""
        size, crc = self._write_shard(d, final, step, snap, generation)
        manifest = {
            "format": FORMAT,
            "step": step,
            "generation": generation,
            "members": members,
            "shard": snap.shard,
            "num_shards": snap.num_shards,
            "file": final.name,
            "size": size,
            "crc32": crc,
            "range": [snap.lo, snap.hi],
            "total_bytes": snap.layout.total,
            "layout_sha256": snap.layout.sha256,
            "layout": snap.layout.to_json(),
            "meta": json.loads(snap.meta_json),
            "created_unix": time.time(),
        }
        return size, manifest

    def _write_shard(
        self, d: Path, final: Path, step: int, snap: Snapshot, generation: int
    ) -> tuple[int, int]:
        """Write the shard file durably under its final name; returns ``(size, crc32)``."""
        meta = {
            "format": FORMAT,
            "step": str(step),
            "generation": str(generation),
            "shard": str(snap.shard),
            "num_shards": str(snap.num_shards),
            "range": f"{snap.lo}:{snap.hi}",
        }
        header = safetensors_header(snap.pieces(), snap.lo, meta)
        buf = snap.buffer
        data = buf.numpy().data if snap.nbytes else memoryview(b"")
        spans = [(i, min(i + CHUNK_BYTES, len(data))) for i in range(0, len(data), CHUNK_BYTES)]
        crc = _ChunkCrc(zlib.crc32(header))
        with atomic_file(final, fsync=self.config.fsync, unless=d / MARKER) as out:
            # CRC-32 of the data in parallel with the writes (both release the GIL),
            # each chunk once it is copied, as the writes below.
            crc_thread = threading.Thread(
                target=crc.run, args=(snap, buf, data, spans), name="ckpt-crc"
            )
            crc_thread.start()
            try:
                out.write(header)
                for lo, hi in spans:
                    if self._cancel.is_set():
                        raise RuntimeError("writer closed (close(wait=False)) during the save")
                    snap.wait_copied(buf[lo:hi])
                    out.write(data[lo:hi])
            except BaseException:
                crc.stop()
                raise
            finally:
                crc_thread.join()
            checksum = crc.result()
        return len(header) + len(data), checksum


class _ChunkCrc:
    """The CRC-32 of a shard's data, chunk by chunk as the snapshot's copy
    finishes them, on a thread of its own beside the writes (`run`)."""

    def __init__(self, initial: int) -> None:
        self._crc = initial
        self._done = False
        self._error: BaseException | None = None
        self._stop = threading.Event()

    def run(self, snap: Snapshot, buf: Any, data: memoryview, spans: list[tuple[int, int]]) -> None:
        try:
            for lo, hi in spans:
                if self._stop.is_set():
                    return
                snap.wait_copied(buf[lo:hi])
                self._crc = zlib.crc32(data[lo:hi], self._crc)
            self._done = True
        except BaseException as e:  # noqa: BLE001 - `result` raises it on the writer thread
            self._error = e

    def stop(self) -> None:
        """Stop at the next chunk (the writes failed; nobody needs the CRC)."""
        self._stop.set()

    def result(self) -> int:
        """The CRC-32 of the header and all chunks, once `run` returned; raises
        what `run` raised."""
        if self._error is not None:
            raise self._error
        if not self._done:
            raise RuntimeError("the shard's CRC-32 was not computed")
        return self._crc

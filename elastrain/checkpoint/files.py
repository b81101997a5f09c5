"""On-disk names, fsync helpers, self-checksummed JSON, and the checkpoint errors.

Everything here is local file I/O with no communication. JSON documents this
package writes (shard manifests and the commit marker) carry a ``sha256``
field over their own canonical JSON, so a flipped byte in a manifest is caught
even when the JSON still parses.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FORMAT = "elastrain-checkpoint/1"
"""Format version written into every shard manifest, marker and shard file header."""

CHECKPOINTS = "checkpoints"
"""The checkpoint directory inside a run directory (`elastrain run` writes there,
`elastrain export` reads there)."""

MARKER = "COMMITTED.json"
"""The commit marker: a step directory counts as a checkpoint only once this exists."""

_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CheckpointError(RuntimeError):
    """Base class of the errors this package raises."""


class CommitError(CheckpointError):
    """`commit` refused: a shard is missing, from another generation, or does not verify.

    No marker was written; the step stays uncommitted and is ignored on resume.
    """


class CheckpointCorrupt(CheckpointError):
    """A committed checkpoint failed verification. The message names the file and the fault."""


def step_dir(directory: str | os.PathLike[str], step: int) -> Path:
    """``<directory>/step-XXXXXXXX`` (at least 8 digits, zero padded)."""
    return Path(directory) / f"step-{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a ``step-XXXXXXXX`` directory name, or None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def list_steps(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every step directory under ``directory``, ascending by step."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = []
    for p in d.iterdir():
        s = parse_step(p.name)
        if s is not None and p.is_dir():
            found.append((s, p))
    return sorted(found)


def committed_steps(directory: str | os.PathLike[str] | None) -> list[int]:
    """The steps of the committed checkpoints under ``directory`` (their marker
    exists; not verified), ascending; [] when there is none or no directory."""
    if directory is None:
        return []
    return [s for s, d in list_steps(directory) if (d / MARKER).exists()]


def shard_file_name(shard: int, num_shards: int) -> str:
    """The data file of one shard (a safetensors file)."""
    return f"shard-{shard:05d}-of-{num_shards:05d}.safetensors"


def shard_manifest_name(shard: int, num_shards: int) -> str:
    """The JSON manifest of one shard; it is written only after its data file is durable."""
    return f"shard-{shard:05d}-of-{num_shards:05d}.json"


def temp_name(final: Path) -> Path:
    """A unique hidden temp path next to ``final`` (``.<name>.tmp-<pid>-<random>``)."""
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    """True for names made by `temp_name`."""
    return name.startswith(".") and ".tmp-" in name


def fsync_dir(path: Path) -> None:
    """fsync a directory so that renames and creations inside it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview) -> None:
    """``os.write`` until every byte of ``data`` is written (raises OSError, e.g. ENOSPC)."""
    while len(data):
        n = os.write(fd, data)
        data = data[n:]


WRITEBACK_BYTES = 32 << 20
"""Bytes a `DurableFile` appends before it asks the kernel to start writing them back."""

_SYNC_FILE_RANGE_WRITE = 2
"""``SYNC_FILE_RANGE_WRITE`` (linux/fs.h): start writeback of the range's dirty pages, no wait."""


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux; Python's os module lacks it), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()


class DurableFile:
    """A file written front to back, then fsync-ed: a checkpoint's data file.

    Write-then-fsync (what ``dd conv=fsync`` does) leaves the disk idle while the
    bytes go into the page cache, then the CPU idle while fsync waits for all of
    them. With ``writeback``, every `WRITEBACK_BYTES` appended are handed to the
    kernel's writeback at once (``sync_file_range(SYNC_FILE_RANGE_WRITE)``, which
    does not wait), so the disk writes while the writer copies and checksums the
    next bytes, and `sync` waits for the tail only. Durability is still `sync`'s
    fsync alone: starting writeback early changes when the bytes go out, not what
    a crash leaves. Where the call is missing or the file system refuses it, the
    writes are plain and fsync does all of it.

    Not thread safe: one writer appends. ``fd`` stays the caller's to close.
    """

    def __init__(self, fd: int, *, writeback: bool) -> None:
        self.fd = fd
        self.size = 0
        """Bytes appended so far."""
        self._started = 0
        """Bytes whose writeback was started."""
        self._sync_file_range = _sync_file_range if writeback else None

    def write(self, data: Any) -> None:
        """Append all of ``data`` (a buffer); OSError on failure (e.g. ENOSPC)."""
        mv = memoryview(data).cast("B")
        for i in range(0, len(mv), WRITEBACK_BYTES):
            piece = mv[i : i + WRITEBACK_BYTES]
            write_all(self.fd, piece)
            self.size += len(piece)
            if self.size - self._started >= WRITEBACK_BYTES:
                self._start_writeback()

    def _start_writeback(self) -> None:
        fn = self._sync_file_range
        if fn is not None and fn(
            self.fd, self._started, self.size - self._started, _SYNC_FILE_RANGE_WRITE
        ):
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
                raise OSError(err, f"sync_file_range: {os.strerror(err)}")
            self._sync_file_range = None  # this file cannot: fsync does it all
        self._started = self.size

    def sync(self) -> None:
        """fsync: every byte appended is durable when this returns."""
        os.fsync(self.fd)


def remove_quietly(path: Path) -> None:
    """Best-effort unlink used on failure paths; never raises."""
    with contextlib.suppress(OSError):
        path.unlink()


def _canonical(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_signed_json(path: Path, obj: dict[str, Any], *, fsync: bool) -> None:
    """Write ``obj`` plus its own ``sha256`` to ``path`` atomically.

    Strategy: write a temp file beside it, fsync it, ``os.replace`` onto
    ``path``, fsync the directory. A crash leaves either the old file or the new
    one, never a torn one. On any error the temp file is removed and the error
    propagates (OSError with its errno, e.g. ENOSPC).
    """
    body = dict(obj)
    body.pop("sha256", None)
    body["sha256"] = hashlib.sha256(_canonical(body)).hexdigest()
    write_atomically(path, json.dumps(body, sort_keys=True, indent=1).encode(), fsync=fsync)


@contextlib.contextmanager
def atomic_file(path: Path, *, fsync: bool, unless: Path | None = None) -> Iterator[DurableFile]:
    """The one durable write of every checkpoint file, whatever its format: the block
    appends to a `DurableFile` on a hidden temp file beside ``path``; when it ends,
    the file is fsync-ed (with ``fsync``), ``os.replace``-d onto ``path`` and the
    directory fsync-ed. A crash leaves the old file or the new one, never a torn one.
    On any error (in the block, or OSError with its errno, e.g. ENOSPC) the temp
    file is removed and the error propagates. ``unless``: a file (a step's commit
    marker) whose presence when the block ends refuses the rename (RuntimeError):
    a committed step is never written into."""
    tmp = temp_name(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            out = DurableFile(fd, writeback=fsync)
            yield out
            if fsync:
                out.sync()
        finally:
            os.close(fd)
        if unless is not None and unless.exists():
            raise RuntimeError(f"{path.parent} was committed while {path.name} was being written")
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)
        raise
    if fsync:
        fsync_dir(path.parent)


def make_step_dir(d: Path, *, fsync: bool) -> None:
    """Create step directory ``d`` if needed, durably (its parent fsync-ed when new)."""
    existed = d.is_dir()
    d.mkdir(parents=True, exist_ok=True)
    if fsync and not existed:
        fsync_dir(d.parent)


def write_atomically(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` to ``path`` atomically (`atomic_file`)."""
    with atomic_file(path, fsync=fsync) as out:
        out.write(data)


def read_signed_json(path: Path) -> dict[str, Any]:
    """Read a file written by `write_signed_json`; CheckpointCorrupt names what is wrong."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path} cannot be read: {e}") from e
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointCorrupt(f"{path} is not valid JSON ({e}); it is damaged") from e
    if not isinstance(obj, dict) or not isinstance(obj.get("sha256"), str):
        raise CheckpointCorrupt(f"{path} has no sha256 field; it is not a manifest of ours")
    claimed = obj.pop("sha256")
    if hashlib.sha256(_canonical(obj)).hexdigest() != claimed:
        raise CheckpointCorrupt(f"{path} does not match its own sha256; it is damaged")
    if obj.get("format") != FORMAT:
        raise CheckpointCorrupt(f"{path} has format {obj.get('format')!r}, expected {FORMAT!r}")
    return obj

"""Durable checkpoints: async striped saves, atomic commit, verified resume.

The training loop pays only for `Snapshot.take` (a host-memory copy of this
member's share of the state, of which what only the optimizer step writes is
copied in the background until the next step's update, `deferred`); a
`CheckpointWriter` writes that share in a background thread. The flattened state (tensors back to back) is striped over
``num_shards`` members, so data-parallel replicas write it once between them.

Atomicity strategy: **per-shard temp file + fsync + rename, then a shard
manifest, then a single commit marker**. For checkpoint ``step``::

    <directory>/step-XXXXXXXX/
        shard-KKKKK-of-NNNNN.safetensors   raw tensor bytes (a valid safetensors file)
        shard-KKKKK-of-NNNNN.json          shard manifest: step, generation, members,
                                           size, crc32, byte range, layout, meta
        COMMITTED.json                     commit marker: the manifest of the whole checkpoint

1. Each member writes its shard to a hidden temp file in the step directory,
   fsyncs it, renames it to its final name and fsyncs the directory; then it
   writes its shard manifest the same way (temp, fsync, rename, fsync).
2. Once every member reported success, one process calls `commit`: it checks
   every shard manifest (same step, generation, members, layout) and every
   data file (size and CRC-32), then writes ``COMMITTED.json`` (format
   version, step, generation, members, layout, per-shard file, size, CRC-32
   and byte range, meta) by temp file + fsync + rename + directory fsync.
3. A checkpoint counts only if its marker exists and every shard verifies
   (`latest_verified`); anything else is skipped with a warning naming the
   file. A member that fails, leaves, or belongs to another generation
   leaves a shard missing or mismatched, so `commit` refuses and the step is
   never claimed complete.

Every JSON document carries a sha256 of itself. No pickle anywhere: tensors
are raw bytes, everything else is JSON. (A sharded job writes its checkpoints
in DCP format instead, `elastrain.checkpoint.dcp`: the same commit marker and
verification, data files torch's DCP can load, read back here without pickle; a
replicated job does too with ``--ckpt-format dcp``, `CheckpointFormat`.) A failed save (ENOSPC, EIO, ...)
fails only that save, removes its files and never touches a committed
checkpoint; committed checkpoints are never rewritten.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastrain.checkpoint.config import (
        CheckpointConfig,
        CheckpointFormat,
        young_daly_interval,
    )
    from elastrain.checkpoint.files import CheckpointCorrupt, CheckpointError, CommitError
    from elastrain.checkpoint.retention import apply_retention, discard_newer
    from elastrain.checkpoint.snapshot import Snapshot
    from elastrain.checkpoint.store import VerifiedCheckpoint, commit, latest_verified, load
    from elastrain.checkpoint.writer import CheckpointWriter, SaveHandle, SaveResult

_WHERE = {
    "CheckpointConfig": "config",
    "CheckpointFormat": "config",
    "young_daly_interval": "config",
    "CheckpointCorrupt": "files",
    "CheckpointError": "files",
    "CommitError": "files",
    "apply_retention": "retention",
    "discard_newer": "retention",
    "Snapshot": "snapshot",
    "VerifiedCheckpoint": "store",
    "commit": "store",
    "latest_verified": "store",
    "load": "store",
    "CheckpointWriter": "writer",
    "SaveHandle": "writer",
    "SaveResult": "writer",
}

__all__ = [
    "CheckpointConfig",
    "CheckpointFormat",
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointWriter",
    "CommitError",
    "SaveHandle",
    "SaveResult",
    "Snapshot",
    "VerifiedCheckpoint",
    "apply_retention",
    "commit",
    "discard_newer",
    "latest_verified",
    "load",
    "young_daly_interval",
]


def __getattr__(name: str) -> Any:
    # Lazy, so that the launcher can look at file names (`files`) without importing torch.
    if name in _WHERE:
        return getattr(importlib.import_module(f"elastrain.checkpoint.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

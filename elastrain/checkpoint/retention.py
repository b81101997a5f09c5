"""Retention: which step directories to delete after a commit."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from elastrain.checkpoint.config import CheckpointConfig
from elastrain.checkpoint.files import (
    MARKER,
    CheckpointCorrupt,
    fsync_dir,
    is_temp_name,
    list_steps,
)
from elastrain.checkpoint.store import _verify

log = logging.getLogger(__name__)


def apply_retention(
    directory: str | os.PathLike[str],
    config: CheckpointConfig,
    *,
    verified_step: int | None = None,
) -> list[Path]:
    """Delete checkpoints the policy no longer keeps; returns the deleted paths.

    Who calls it: the process that just ran `commit` (one per job), after the
    commit; local, blocking, never concurrently with itself.

    Kept: the ``config.keep_last`` newest committed checkpoints, every
    committed one whose step is a multiple of ``config.keep_every`` (when > 0),
    the newest *verified* one (found by verifying committed checkpoints
    newest first, unless the caller passes ``verified_step``, a step it just
    committed and verified), and every uncommitted step directory newer than
    the newest committed one (a save may still be in flight there).
    Deleted: the other committed checkpoints, uncommitted step directories
    older than the newest committed one (failed or abandoned saves), and
    leftover temp files inside kept committed checkpoints (a writer
    killed mid-save). A committed checkpoint is deleted marker
    first (with a directory fsync), so a crash mid-delete leaves an
    uncommitted directory, never a marker pointing at missing shards.
    Deletion errors are logged and skipped (the next call retries).
    """
    steps = list_steps(directory)
    committed = [s for s, d in steps if (d / MARKER).exists()]
    keep = set(committed[-config.keep_last :])
    if config.keep_every:
        keep.update(s for s in committed if s % config.keep_every == 0)
    if verified_step is not None and verified_step in committed:
        keep.add(verified_step)
    else:
        for s in reversed(committed):
            try:
                _verify(dict(steps)[s], verify_checksums=True)
            except CheckpointCorrupt:
                continue
            keep.add(s)
            break
    newest = committed[-1] if committed else -1
    deleted: list[Path] = []
    for s, d in steps:
        if s in keep or (s not in committed and s > newest):
            continue
        try:
            if s in committed:
                (d / MARKER).unlink()
                if config.fsync:
                    fsync_dir(d)
            shutil.rmtree(d)
        except OSError as e:
            log.warning("retention could not delete %s: %s", d, e)
            continue
        deleted.append(d)
    for s, d in steps:
        if s in keep and s in committed:
            for p in d.iterdir():
                if is_temp_name(p.name):
                    try:
                        p.unlink()
                        deleted.append(p)
                    except OSError as e:
                        log.warning("retention could not delete %s: %s", p, e)
    if deleted:
        log.info("checkpoint retention deleted %s", ", ".join(p.name for p in deleted))
    return deleted


def discard_newer(directory: str | os.PathLike[str], step: int | None) -> list[Path]:
    """Clear every step directory newer than ``step`` (the checkpoint resumed from; None: all).

    Who calls it: exactly one process at whole-job resume, after
    `latest_verified` chose the checkpoint and before any member saves.
    Directories newer than it are saves of the previous run that failed,
    were torn, or did not verify. Left in place, a stale shard could complete
    a checkpoint of the new run (same step, generation and members), and a
    stale marker would make that step unsavable ("already committed").
    Uncommitted ones are deleted; committed ones (they failed verification)
    are renamed to ``rejected-step-XXXXXXXX[-N]`` for inspection and never
    read again. Returns the paths removed or renamed (their old names).
    Raises OSError if one cannot be cleared: do not start saving then.
    """
    cleared: list[Path] = []
    for s, d in list_steps(directory):
        if step is not None and s <= step:
            continue
        if (d / MARKER).exists():
            dest, n = d.with_name(f"rejected-{d.name}"), 1
            while dest.exists():
                dest, n = d.with_name(f"rejected-{d.name}-{n}"), n + 1
            log.warning("checkpoint %s does not verify; moved aside to %s", d, dest.name)
            d.rename(dest)
        else:
            shutil.rmtree(d)
        cleared.append(d)
    return cleared

"""Whole-job resume, launcher side: which checkpoint the job starts from.

Who calls: the launcher, once, before it spawns any worker (never an agent:
its workers each load the newest checkpoint that verifies and peers heal the
rest). Reads the checkpoint directory, clears step directories newer than the
chosen checkpoint (a torn save, or one that fails verification), and tells
the user on stderr and in a `checkpoint_resume` event.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from elastrain.observe.events import EventKind, EventLog


def choose_checkpoint(checkpoint_dir: Path, events: EventLog) -> int | None:
    """The step to resume from (None: start from scratch). Damaged checkpoints
    are skipped with a warning naming the file; OSError if the directory
    cannot be read or cleared."""
    d = checkpoint_dir
    if not d.is_dir():
        return None
    from elastrain.checkpoint import discard_newer, latest_verified

    skipped: list[dict[str, Any]] = []

    def on_skip(step: int, path: Path, reason: str) -> None:
        skipped.append({"step": step, "path": str(path), "reason": reason})

    ckpt = latest_verified(d, on_skip=on_skip)
    discarded = discard_newer(d, ckpt.step if ckpt is not None else None)
    step = ckpt.step if ckpt is not None else None
    using = (
        f"the previous one, step {ckpt.step} ({ckpt.path})"
        if ckpt is not None
        else "none (no older checkpoint verifies): starting from scratch"
    )
    for sk in skipped:
        print(
            f"elastrain: warning: checkpoint step {sk['step']} fails verification: "
            f"{sk['reason']}; using {using}",
            file=sys.stderr,
            flush=True,
        )
    if ckpt is not None:
        print(
            f"elastrain: resuming from checkpoint step {ckpt.step} ({ckpt.path})",
            file=sys.stderr,
            flush=True,
        )
    if ckpt is not None or skipped or discarded:
        events.emit(
            EventKind.CHECKPOINT_RESUME,
            step=step,
            path=str(ckpt.path) if ckpt is not None else None,
            skipped=skipped,
            discarded=[str(x) for x in discarded],
        )
    return step


def plain_start(directory: str, given: int | None, events: EventLog) -> int:
    """The step a job started with ``--resume-from directory`` begins at: the
    checkpoint's ``step`` entry or ``given`` (`elastrain.checkpoint.plain`).
    Warns about the keys it will not load; PlainCheckpointError if the
    directory is not a DCP checkpoint elastrain can start from."""
    from elastrain.checkpoint.plain import read_layout, read_step, resume_step

    path = Path(directory).resolve()
    layout = read_layout(path)
    step = resume_step(read_step(path, layout), given, path)
    if layout.ignored:
        shown = ", ".join(layout.ignored[:5]) + (", ..." if len(layout.ignored) > 5 else "")
        print(
            f"elastrain: warning: --resume-from loads the model and optimizer state only; "
            f"not loaded: {shown}",
            file=sys.stderr,
            flush=True,
        )
    print(
        f"elastrain: starting from DCP checkpoint {path} at step {step}",
        file=sys.stderr,
        flush=True,
    )
    events.emit(
        EventKind.CHECKPOINT_RESUME, step=step, path=str(path), skipped=[], discarded=[], plain=True
    )
    return step


NO_CHECKPOINT = "no checkpoint was committed"


def newest_checkpoint_note(checkpoint_dir: Path) -> str:
    """One line for the user: the newest committed checkpoint, or that there is none.
    A checkpoint's step is a committed step count, as in "N steps committed"."""
    from elastrain.checkpoint.files import committed_steps

    committed = committed_steps(checkpoint_dir)
    if not committed:
        return NO_CHECKPOINT
    n = committed[-1]
    return f"newest committed checkpoint: {n} steps committed, in {checkpoint_dir} (run again to resume)"

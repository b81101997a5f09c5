"""The demos' pace file: a driver slows the job's steps while it waits for a phase.

The driver (`elastrain demo --sharded`, `--jax`) writes a minimum step time in
seconds; the demo's training script reads it after every step and sleeps the
rest of it. A pace, not a synchronisation: the job is correct at any pace, the
pace only makes every phase happen before the job's last step on a slow machine.
"""

from __future__ import annotations

from pathlib import Path


def read_pace(path: str | None, default: float) -> float:
    """The pace in `path` (seconds), or `default` when there is none or it is unreadable."""
    if path:
        try:
            return float(Path(path).read_text())
        except (OSError, ValueError):
            pass
    return default


def write_pace(path: Path, seconds: float) -> None:
    """Set the pace; the workers read it every step, so replace it whole (never a
    torn file), and leave an unchanged one alone."""
    text = f"{seconds:g}"
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)

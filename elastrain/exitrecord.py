"""A worker's exit record: the Python exception that ended a worker's script.

The worker entry point (`elastrain.worker`) writes one when the user's script
raises an exception it did not catch (not a signal, not a watchdog firing, not a
device error: those end the process otherwise and leave none), as
``<run_dir>/exits/<member>-<pid>.json``; its launcher or agent reads it once it
has reaped the process and sends it to the coordinator with the exit status
(`protocol.ExitRequest.error_*`). Two records with the same `key` (exception type
and script line) are the same bug: `elastrain.launch.failwatch` stops the job on
them instead of replacing workers that will fail the same way.

Stdlib only: the launcher reads it without importing torch.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

EXITS = "exits"
"""The run directory's folder of exit records."""

MAX_MESSAGE = 500
"""Characters of the exception's message kept (the record travels on the wire)."""

_LIBRARY = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class ScriptError:
    """The exception a worker's script raised and did not catch."""

    type: str
    """The exception class's name (`ValueError`)."""
    message: str
    """Its message's first `MAX_MESSAGE` characters (several lines possible)."""
    where: str
    """``file:line`` of the innermost frame in the script's own code (the
    library's, the standard library's and installed packages' frames skipped;
    the innermost frame of all when none is the script's)."""

    @property
    def key(self) -> tuple[str, str]:
        """What makes two failures the same bug: the exception type at the same
        script line, whatever the message says (it often holds the step)."""
        return (self.type, self.where)

    def fields(self) -> dict[str, str]:
        """The record as the exit event's and the wire's ``error_*`` fields."""
        return {"error_type": self.type, "error_message": self.message, "error_where": self.where}

    def headline(self) -> str:
        """One line: ``ValueError: message (at train.py:12)``."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return (
            f"{self.type}: {first} (at {self.where})" if first else f"{self.type} (at {self.where})"
        )


def _is_library(filename: str) -> bool:
    """A frame of elastrain, the standard library, an installed package or frozen code."""
    if filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, _LIBRARY}
    return "site-packages" in path or any(path.startswith(r + os.sep) for r in roots)


def from_exception(exc: BaseException) -> ScriptError:
    """The record of `exc` (see `ScriptError.where` for which frame is named)."""
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if not _is_library(f.filename)]
    pick = mine or frames
    where = f"{pick[-1].filename}:{pick[-1].lineno}" if pick else "?"
    return ScriptError(type(exc).__name__, str(exc)[:MAX_MESSAGE], where)


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception `exc` was raised from (``raise ... from``): the
    library wraps a script's error (a ``load_state_dict`` refusing) in its own,
    and the record names the script's line."""
    seen = {id(exc)}
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        exc = exc.__cause__
        seen.add(id(exc))
    return exc


def record_path(run_dir: Path, member: str, pid: int) -> Path:
    return run_dir / EXITS / f"{member}-{pid}.json"


def write_record(run_dir: Path, member: str, pid: int, err: ScriptError) -> None:
    """Write the record (atomically: a reader sees all of it or none)."""
    path = record_path(run_dir, member, pid)
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(err)))
    os.replace(tmp, path)


def read_record(run_dir: Path, member: str, pid: int) -> ScriptError | None:
    """The record that process left, None if it left none (or it is unreadable)."""
    try:
        d = json.loads(record_path(run_dir, member, pid).read_text())
        return ScriptError(str(d["type"]), str(d["message"]), str(d["where"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None

"""One launcher per run directory, and the run directory's private files.

`RunDirLock` holds an exclusive `flock` on ``<run_dir>/lock`` (which records
the holder's PID) for as long as the launcher runs. A second `elastrain run`
on the same directory fails at once with `RunDirLocked`, naming that PID,
before it writes anything (the token of the first job stays as it is). The
kernel drops the lock when the holder dies, however it dies, so a SIGKILLed
launcher never leaves a stale lock behind: the next one simply takes it.

Files: the run directory is made 0700 (0750 with `group_readable`, for shared
filesystems where a group must read it) and the token is written 0600 from
its first byte (`write_private`: a temporary created with O_EXCL at mode
0600, renamed over the old one), never created readable and chmod-ed after.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

LOCK_FILE = "lock"


class RunDirLocked(RuntimeError):
    """Another live launcher holds the run directory."""


def dir_mode(group_readable: bool) -> int:
    return 0o750 if group_readable else 0o700


def child_umask(group_readable: bool) -> int:
    """The umask of the job's processes: files 0600 (0640), directories 0700 (0750)."""
    return 0o027 if group_readable else 0o077


def make_run_dir(path: Path, group_readable: bool = False) -> None:
    """Create `path` (and its parents) and give it the job's mode, also when it existed."""
    path.mkdir(parents=True, exist_ok=True, mode=dir_mode(group_readable))
    os.chmod(path, dir_mode(group_readable))


def holder_pid(text: str) -> int | None:
    """The PID recorded in a lock file's text, if it holds one."""
    word = text.strip()
    return int(word) if word.isdigit() else None


class RunDirLock:
    """Holds ``<run_dir>/lock`` until `release()` (or the process's death)."""

    _fd: int | None = None

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            try:
                pid = holder_pid(os.pread(fd, 64, 0).decode(errors="replace"))
            finally:
                os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            who = f"PID {pid}" if pid is not None else "another process"
            raise RunDirLocked(
                f"run directory {run_dir} is in use by another launcher ({who} holds "
                f"{self.path}); wait for it to end, stop it, or pick another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        """Unlock (the file stays: removing it would race a launcher opening it)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:  # a launcher built but never run
        self.release()


def write_private(path: Path, text: str) -> None:
    """Write `path` as mode 0600 with no moment where another user can read it."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

"""What the launcher does to inject the faults that are not signals.

- `damage_checkpoint`: flip bytes in, or truncate, one shard of the newest
  committed checkpoint (the resume path must notice and use the previous one).
- `DiskFiller`: fill the checkpoint filesystem until ENOSPC, then free it. It
  refuses a filesystem with more than `limit_bytes` free, so a schedule can
  never fill a real disk: give the checkpoints a small dedicated filesystem
  (the soak mounts a tmpfs).
- `send_slow`: tell one worker to become a straggler, through its chaos inbox
  (`<run_dir>/chaos/<member>.json`), which the worker polls at every step
  (`elastrain.chaos.points.FaultPoints`).

Each returns the details that go into the `fault_injected` event.
"""

from __future__ import annotations

import errno
import json
import os
import random
import threading
from pathlib import Path
from typing import Any

from elastrain.checkpoint.files import MARKER, list_steps

INBOX_DIR = "chaos"


def inbox_path(run_dir: str | os.PathLike[str], member: str) -> Path:
    return Path(run_dir) / INBOX_DIR / f"{member}.json"


def send_slow(run_dir: str | os.PathLike[str], member: str, delay_s: float, steps: int) -> Path:
    """Append a straggler order to `member`'s inbox (atomic replace of the file)."""
    path = inbox_path(run_dir, member)
    path.parent.mkdir(parents=True, exist_ok=True)
    orders: list[dict[str, Any]] = []
    if path.exists():
        orders = json.loads(path.read_text())
    orders.append({"id": len(orders) + 1, "action": "slow", "delay_s": delay_s, "steps": steps})
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(orders))
    os.replace(tmp, path)
    return path


def damage_checkpoint(
    checkpoint_dir: str | os.PathLike[str], rng: random.Random, how: str
) -> dict[str, Any]:
    """Damage one shard of the newest committed checkpoint: `how` is "corrupt"
    (64 bytes from a seeded offset XORed with seeded non-zero bytes, so that
    damaging the same file twice does not repair it, as a fixed flip would) or
    "truncate" (cut it in half).
    Returns {"path", "checkpoint_step", ...} or {"skipped": reason} when there is none."""
    if how not in ("corrupt", "truncate"):
        raise ValueError(f"how must be 'corrupt' or 'truncate', got {how!r}")
    committed = [(s, d) for s, d in list_steps(checkpoint_dir) if (d / MARKER).exists()]
    if not committed:
        return {"skipped": "no committed checkpoint yet"}
    step, d = committed[-1]
    # Data files of both kinds: a replicated job's safetensors stripes, a sharded
    # job's DCP row chunks.
    shards = sorted(p for p in d.iterdir() if p.suffix in (".safetensors", ".distcp"))
    if not shards:
        return {"skipped": f"no shard files in {d}"}
    path = rng.choice(shards)
    size = path.stat().st_size
    if how == "truncate":
        os.truncate(path, size // 2)
        return {"path": str(path), "checkpoint_step": step, "size": size, "truncated_to": size // 2}
    off = rng.randrange(0, max(1, size - 64))
    with open(path, "r+b") as f:
        f.seek(off)
        data = bytearray(f.read(64))
        for i in range(len(data)):
            data[i] ^= rng.randrange(1, 256)
        f.seek(off)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"path": str(path), "checkpoint_step": step, "offset": off, "bytes": len(data)}


class DiskFiller:
    """Fill the filesystem holding `directory` until it is full; `release()` frees it.

    Thread-safe; `fill()` blocks only for the writes (a few hundred ms on a
    small tmpfs).
    """

    CHUNK = 1 << 20

    def __init__(self, directory: str | os.PathLike[str], limit_bytes: int = 1 << 30) -> None:
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes
        self._lock = threading.Lock()
        self._files: list[Path] = []

    def fill(self) -> dict[str, Any]:
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            st = os.statvfs(self.directory)
            free = st.f_bavail * st.f_frsize
            if free > self.limit_bytes:
                return {
                    "skipped": f"{self.directory} has {free} bytes free, more than the "
                    f"{self.limit_bytes} this fault may fill; give checkpoints a small "
                    "dedicated filesystem"
                }
            path = self.directory / f".chaos-fill-{len(self._files)}"
            self._files.append(path)
            written = 0
            chunk = b"\0" * self.CHUNK
            with open(path, "wb", buffering=0) as f:
                while True:
                    try:
                        written += f.write(chunk) or 0
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
            return {"path": str(path), "bytes": written, "free_before": free}

    def release(self) -> None:
        with self._lock:
            for p in self._files:
                try:
                    p.unlink()
                except FileNotFoundError:
                    pass
            self._files.clear()

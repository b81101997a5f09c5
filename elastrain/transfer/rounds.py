"""The heal's waits and its small collective rounds: one deadline, int64 flag vectors.

Shared by the manifest rounds (`elastrain.transfer.striped`) and the payload
rounds (`elastrain.transfer.payload`). Every helper here that names a round is
collective over the transport's group: every rank calls it, in the same order,
with a vector of the same length.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch

from elastrain.transfer.errors import HealError
from elastrain.transfer.transport import HealTransport, Pending, Reduce


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


class Deadline:
    """Waits on a transport's posted operations, all against one deadline; errors
    become HealError."""

    def __init__(self, rank: int, timeout_s: float) -> None:
        self.rank = rank
        self.timeout_s = timeout_s
        self.end = time.monotonic() + timeout_s

    def remaining(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=max(self.end - time.monotonic(), 0.001))

    def wait(self, work: Pending, what: str) -> None:
        try:
            work.wait(self.remaining())
        except RuntimeError as e:
            raise HealError(
                f"heal on rank {self.rank}: {what} failed (timeout_s={self.timeout_s:g}): "
                f"{first_line(e)}"
            ) from e

    def call(self, fn: Callable[[], Pending], what: str) -> Pending:
        """Post an operation; a transport error at post time also becomes HealError."""
        try:
            return fn()
        except RuntimeError as e:
            raise HealError(f"heal on rank {self.rank}: {what} failed: {first_line(e)}") from e


class Flags:
    """An all-reduce (sum) of an int64 flag vector in which each rank set only its
    own slots, posted: `result` waits for it. Local work can run in between."""

    def __init__(self, tx: HealTransport, flags: torch.Tensor, what: str, dl: Deadline) -> None:
        self.flags, self.what, self.dl = flags, what, dl
        self.work = dl.call(lambda: tx.allreduce(flags, Reduce.SUM, dl.remaining()), what)

    def result(self) -> list[int]:
        self.dl.wait(self.work, self.what)
        return [int(f) for f in self.flags.tolist()]


def sum_flags(tx: HealTransport, flags: torch.Tensor, what: str, dl: Deadline) -> list[int]:
    """All-reduce (sum) of an int64 flag vector in which each rank set only its own slots."""
    return Flags(tx, flags, what, dl).result()


def outcome(tx: HealTransport, n: int, failed: list[int], dl: Deadline) -> dict[int, list[int]]:
    """All-reduce of this rank's failed assignments among ``n`` (collective).

    Returns {assignment index: receiver ranks that failed it}, only for failed ones.
    """
    flags = torch.zeros(tx.size * n, dtype=torch.int64)
    for j in failed:
        flags[tx.rank * n + j] = 1
    got = sum_flags(tx, flags, "stripe outcome all-reduce", dl)
    out: dict[int, list[int]] = {}
    for r in range(tx.size):
        for j in range(n):
            if got[r * n + j]:
                out.setdefault(j, []).append(r)
    return out

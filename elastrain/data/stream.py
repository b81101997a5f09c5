"""Streaming sources: samples read in order from a position, not indexed.

A stream takes part in exactly-once the way a map-style dataset does, with
the stream's own order in place of the shuffled global order: position k of
the stream is "sample id" k, step s consumes the positions of its window
(`DataPosition.window`), and each member reads only its micro-batches'
positions. What a stream must offer is `iter_from(position)`: the samples at
position, position + 1, ... A resumed or healed member reopens the stream at
its next step's position, so the stream must be replayable: position p yields
the same sample on every member and every time (files read in a fixed order,
a log's offsets). An epoch is the source's business (loop inside
`iter_from`); the job has no dataset length.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from elastrain.data.order import OrderKind


@runtime_checkable
class StreamingDataset(Protocol):
    """A replayable stream of samples (see the module's docstring)."""

    def iter_from(self, position: int) -> Iterator[Any]:
        """The samples at positions `position`, `position + 1`, ... in stream order."""
        ...


class StreamEnded(ValueError):
    """The stream has fewer samples than the job's steps consume."""


def is_stream(dataset: Any) -> bool:
    """True for a streaming source (it has `iter_from`), False for a map-style dataset."""
    return callable(getattr(dataset, "iter_from", None))


def check_dataset(dataset: Any) -> None:
    """Refuse what the engine cannot feed exactly once, with what to change."""
    from torch.utils.data import IterableDataset

    if is_stream(dataset):
        return
    iterable = isinstance(dataset, IterableDataset)  # it has __getitem__, unusable
    if not iterable and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):
        return
    what = type(dataset).__name__
    raise TypeError(
        f"the dataset ({what}) is neither map-style (len() and [i]) nor a replayable stream "
        "(iter_from(position)); an iterable dataset needs iter_from(position) yielding its "
        "samples from that position on, so that a replacement or a resumed job can start "
        "at its step's position (elastrain.data.StreamingDataset)"
    )


class StreamOrder:
    """The order of a stream: position k is sample id k (the stream's own order)."""

    kind = OrderKind.STREAM

    def ids(self, start: int, stop: int) -> list[int]:
        if start < 0 or stop < start:
            raise ValueError(f"bad position range [{start}, {stop})")
        return list(range(start, stop))


class StreamReader:
    """Reads a stream's samples by position with one open iterator.

    A read that starts where the previous one stopped continues the open
    iterator (a member's contiguous micro-batches cost one `iter_from` per step);
    any other start reopens the stream there, leaving the seek to the source.
    """

    def __init__(self, source: StreamingDataset) -> None:
        self.source = source
        self._it: Iterator[Any] | None = None
        self._cursor = -1

    def read(self, start: int, stop: int) -> list[Any]:
        """The samples at positions [start, stop)."""
        if self._it is None or start != self._cursor:
            self._it = iter(self.source.iter_from(start))
            self._cursor = start
        out: list[Any] = []
        for _ in range(stop - start):
            try:
                out.append(next(self._it))
            except StopIteration:
                self._it, self._cursor = None, -1
                raise StreamEnded(
                    f"the stream ended at position {start + len(out)}, but the step needs "
                    f"positions up to {stop - 1}: fewer samples than total_steps x "
                    "global_batch_size (loop the source inside iter_from for epochs)"
                ) from None
        self._cursor = stop
        return out

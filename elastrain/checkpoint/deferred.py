"""`DeferredCopy`: the part of a checkpoint snapshot copied after `take` returned.

The bulk of a member's state (the parameters and the optimizer state) is written
only by the optimizer step; the next step's forward and backward only read it.
So a snapshot copies those tensors on a background thread during the next
step's compute, and the training thread waits for that copy only right before
anything writes the state again (`settle`: the trainer calls it before every
action that may write the state, `elastrain.runtime.engine.READ_ONLY`). What
forward writes (model buffers such as BatchNorm's running statistics), the RNG
state and the meta are copied by `take` itself, on the training thread.

Thread contract: the snapshot's taker calls `start` once; the copier thread and
`settle`/`finish` (the training thread) copy chunks of at most `CHUNK_BYTES`,
claiming them one at a time under a lock, so a training thread that reaches its
mutation point finishes what the copier has not started instead of waiting
idle (and torch's ``copy_`` releases the GIL between chunks). `wait` (the
writer thread) blocks until the chunks under one part of the snapshot's memory
(or every chunk) are copied, so the writer writes the first bytes while the
rest are still being copied, and raises `CopyFailed` if one failed; `waited`
(event emitters, any thread) is the time the training thread was blocked in
`settle`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

log = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20
"""Bytes per ``copy_`` call: the unit the copier and the training thread claim."""

REPORT_TIMEOUT_S = 5.0
"""How long `waited` waits for a `settle` in progress to finish measuring."""


class CopyFailed(RuntimeError):
    """A deferred copy into a snapshot failed: that snapshot cannot be written."""


def copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one chunk (uint8 views of equal length); the one place the copy runs."""
    with torch.no_grad():
        dst.copy_(src)


class DeferredCopy:
    """Copies ``pairs`` ``(dst, src)`` (flat uint8 tensors of equal length, ``src``
    aliasing live state) after the snapshot was taken. See the module docstring."""

    def __init__(
        self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], chunk_bytes: int = CHUNK_BYTES
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        chunks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for dst, src in pairs:
            if dst.numel() != src.numel() or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
                raise ValueError("a deferred copy needs uint8 views of equal length")
            for i in range(0, src.numel(), chunk_bytes):
                chunks.append((dst[i : i + chunk_bytes], src[i : i + chunk_bytes]))
        self.nbytes = sum(int(s.numel()) for _, s in chunks)
        """Bytes this copy moves (0: nothing was deferred)."""
        self._spans = [(d.data_ptr(), d.data_ptr() + int(d.numel())) for d, _ in chunks]
        """Each chunk's destination, as addresses ``[lo, hi)`` (`wait` looks them up)."""
        self._copied = [False] * len(chunks)
        self._chunks = chunks
        self._cond = threading.Condition()
        self._next = 0
        """Index of the next unclaimed chunk (set to the end after a failure)."""
        self._claimed = 0
        self._finished = 0
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._settling_since: float | None = None
        self._waited = 0.0
        if not chunks:
            self._done.set()

    @property
    def done(self) -> bool:
        """True once every chunk is copied (or the copy failed)."""
        return self._done.is_set()

    def start(self) -> None:
        """Start the copier thread (nothing to do when nothing was deferred)."""
        if not self._done.is_set():
            threading.Thread(target=self._work, name="ckpt-copy", daemon=True).start()

    def _work(self) -> None:
        """Copy chunks until none is left unclaimed (any thread)."""
        while True:
            with self._cond:
                if self._next >= len(self._chunks):
                    return
                index = self._next
                dst, src = self._chunks[index]
                self._next += 1
                self._claimed += 1
            err: BaseException | None = None
            try:
                copy_chunk(dst, src)
            except Exception as e:  # noqa: BLE001 - reported by `wait`, to the writer
                err = e
            with self._cond:
                if err is not None and self._error is None:
                    self._error = err
                    self._next = len(self._chunks)  # nobody copies the rest
                self._copied[index] = err is None
                self._finished += 1
                self._cond.notify_all()  # a `wait` may be waiting for this chunk
                if self._next >= len(self._chunks) and self._finished == self._claimed:
                    self._chunks = []  # drop the views of the live state
                    self._done.set()

    def finish(self) -> None:
        """Copy what is left on this thread, then wait for the chunks in flight.
        Never raises (a failure is the writer's to report, `wait`)."""
        self._work()
        self._done.wait()

    def settle(self) -> float:
        """The training thread is about to write the state: `finish`, and return
        the seconds it was blocked (also kept for `waited`)."""
        t0 = time.perf_counter()
        with self._cond:
            self._settling_since = t0
        try:
            self.finish()
        finally:
            waited = time.perf_counter() - t0
            with self._cond:
                self._waited += waited
                self._settling_since = None
                self._cond.notify_all()
        return waited

    @property
    def settling(self) -> bool:
        """True while the training thread is blocked in `settle` (its clock running)."""
        with self._cond:
            return self._settling_since is not None

    def waited(self) -> float:
        """Seconds the training thread was blocked in `settle` so far; if it is in
        `settle` now, what it will have been (waits up to `REPORT_TIMEOUT_S`). 0 if
        it has not reached its mutation point yet: callers ask once the copy is
        done, so it will not wait then."""
        with self._cond:
            if self._settling_since is not None:
                self._cond.wait_for(lambda: self._settling_since is None, REPORT_TIMEOUT_S)
            if self._settling_since is not None:
                return self._waited + time.perf_counter() - self._settling_since
            return self._waited

    def wait(self, part: torch.Tensor | None = None) -> None:
        """Block until every chunk copied into ``part``'s memory (a slice of one
        destination; None: every chunk) is done. The writer calls it before it
        reads those bytes; other bytes may still be in flight. CopyFailed if a
        chunk failed."""
        if part is None:
            self._done.wait()
        else:
            lo = part.data_ptr()
            hi = lo + part.numel() * part.element_size()
            under = [i for i, (a, b) in enumerate(self._spans) if a < hi and lo < b]
            with self._cond:
                self._cond.wait_for(
                    lambda: self._error is not None or all(self._copied[i] for i in under)
                )
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise CopyFailed(
                f"the deferred snapshot copy failed: {type(self._error).__name__}: {self._error}"
            ) from self._error

"""Loading a member's micro-batches ahead of the step that computes them.

A step's micro-batches are known before it starts: their positions come from
the global order and the step's window, and which ones this member computes
from the generation's membership alone (`assign_microbatches`). So the engine
tells the loader, at the start of each step, the member's micro-batches for
this step and the next `prefetch_steps` ones (`plan`), and then asks for this
step's, one by one (`get`). Background workers load the planned ones in plan
order while the step computes.

Exactly-once does not depend on the loader: a loaded batch is keyed by (step,
micro-batch) and carries the sample ids it was loaded from; `get` hands it out
only for those same ids (else it loads them anew), and the engine counts a
micro-batch's ids into the step's contribution only once it has computed it.
A membership change (or an abandoned step) just makes the next plan differ:
loaded or pending batches no longer in the plan are dropped (a pending one's
result is thrown away when it arrives), never counted.

Three ways to load (`LoaderConfig`):
- inline (no workers, no prefetch): on the training thread, as before;
- one background thread (no workers, prefetch >= 1): for sources that wait on
  I/O or release the GIL in their decode;
- `num_workers` worker processes (forked; DataLoader-like): for Python-heavy
  decode. Each runs the dataset and the collate function; tensors come back
  through shared memory. Workers exit on `close`, and on their own when the
  training process is gone (they poll for their parent).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import signal
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.reduction import ForkingPickler
from typing import Any

from elastrain.data.stream import StreamingDataset, StreamReader
from elastrain.threads import name_native_thread

Key = tuple[int, int]
"""(step, micro-batch index)."""

Fetch = Callable[[list[int]], Any]
"""Sample ids -> the collated batch."""

PARENT_POLL_S = 1.0
"""How often an idle worker process checks that the training process is alive."""

WORKER_COMM = "el-data"
"""The process name (/proc/<pid>/comm) of a data worker process."""

LIVENESS_POLL_S = 0.2
"""How often `get`, waiting for a batch, checks that the worker processes are alive."""

PR_SET_PDEATHSIG = 1

WORKER_STOP_S = 5.0
"""How long `close` waits for a worker process to exit before killing it."""


class LoaderError(RuntimeError):
    """A data worker failed (the dataset or collate function raised, or it died)."""


@dataclass(frozen=True)
class LoaderConfig:
    """How a member loads its micro-batches (the `TrainerConfig` fields of that name)."""

    num_workers: int = 0
    """Worker processes (0: none; with prefetch, one background thread instead)."""
    prefetch_steps: int = 0
    """Steps ahead of the current one whose micro-batches are loaded while it computes."""

    def __post_init__(self) -> None:
        if self.num_workers < 0 or self.prefetch_steps < 0:
            raise ValueError(
                f"num_workers and prefetch_steps must be >= 0 (got {self.num_workers}, "
                f"{self.prefetch_steps})"
            )

    @property
    def background(self) -> bool:
        """Batches are loaded off the training thread."""
        return self.num_workers > 0 or self.prefetch_steps > 0


class MapFetch:
    """Loads `dataset[j]` for each id and collates them (a map-style dataset)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, ids: list[int]) -> Any:
        return self.collate_fn([self.dataset[j] for j in ids])


class StreamFetch:
    """Reads the stream positions `ids` (contiguous) and collates them."""

    def __init__(self, source: StreamingDataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.reader = StreamReader(source)
        self.collate_fn = collate_fn

    def __call__(self, ids: list[int]) -> Any:
        if not ids:
            return self.collate_fn([])
        if ids != list(range(ids[0], ids[0] + len(ids))):
            raise ValueError("a stream's micro-batch must be contiguous positions")
        return self.collate_fn(self.reader.read(ids[0], ids[0] + len(ids)))


@dataclass
class _Task:
    ids: list[int]
    seq: int
    done: bool = False
    value: Any = None
    error: str | None = None


@dataclass
class _Plan:
    """The loader's bookkeeping (guarded by `BatchLoader._cv`)."""

    tasks: dict[Key, _Task] = field(default_factory=dict)
    by_seq: dict[int, Key] = field(default_factory=dict)
    next_seq: int = 0


class BatchLoader:
    """Loads the member's planned micro-batches in the background (module docstring).

    Used from one thread (the engine's); `plan`, `get`, `reset` and `close`
    are not for concurrent callers. `close` stops every thread and process it
    started; after it, `get` loads inline.
    """

    def __init__(self, fetch: Fetch, config: LoaderConfig, *, name: str = "data") -> None:
        self.fetch = fetch
        self.config = config
        self.name = name
        self._cv = threading.Condition()
        self._plan = _Plan()
        self._dropped = 0
        self._closed = False
        self._started = False
        self._queue: deque[tuple[int, list[int]]] = deque()  # thread mode
        self._thread: threading.Thread | None = None
        self._procs: list[Any] = []
        self._tasks_q: Any = None
        self._results_q: Any = None
        self._stopping: Any = None
        self._collector: threading.Thread | None = None

    # ---- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        """Start the workers (processes are forked now: call it early, before the
        process has many threads). Idempotent; a no-op for inline loading."""
        if self._started or self._closed or not self.config.background:
            return
        self._started = True
        if self.config.num_workers == 0:
            self._thread = threading.Thread(
                target=self._thread_loop, name=f"elastrain-{self.name}", daemon=True
            )
            self._thread.start()
            return
        ctx = multiprocessing.get_context("fork")
        self._tasks_q = ctx.Queue()
        self._results_q = ctx.Queue()
        self._stopping = ctx.Event()
        parent = os.getpid()
        for w in range(self.config.num_workers):
            p = ctx.Process(
                target=_worker_main,
                args=(self.fetch, self._tasks_q, self._results_q, self._stopping, parent),
                name=f"elastrain-{self.name}-{w}",
                daemon=True,
            )
            p.start()
            self._procs.append(p)
        self._collector = threading.Thread(
            target=self._collect, name=f"elastrain-{self.name}-results", daemon=True
        )
        self._collector.start()

    def close(self) -> None:
        """Stop every worker thread and process (killing a process that does not
        exit within WORKER_STOP_S); drop everything loaded. Idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._plan = _Plan()
            self._queue.clear()
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._procs:
            self._stopping.set()  # skip what is still queued
            for _ in self._procs:
                self._tasks_q.put(None)
            for p in self._procs:
                p.join(WORKER_STOP_S)
                if p.is_alive():
                    p.kill()
                    p.join()
            self._results_q.put(None)
            assert self._collector is not None
            self._collector.join()
            # Tasks still buffered are for nobody now: do not wait to flush them.
            self._tasks_q.cancel_join_thread()
            for q in (self._tasks_q, self._results_q):
                q.close()
                q.join_thread()
            self._procs = []

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def dropped(self) -> int:
        """Planned batches dropped by later plans (loaded or loading for nothing)."""
        return self._dropped

    # ---- the plan ---------------------------------------------------------------

    def plan(self, wanted: Sequence[tuple[Key, list[int]]]) -> None:
        """The micro-batches this member computes next, in the order it computes
        them (this step's first). Loads the ones not loaded or loading yet, and
        drops every loaded or pending one not in `wanted`."""
        if not self.config.background or self._closed:
            return
        self.start()
        submit: list[tuple[int, list[int]]] = []
        with self._cv:
            pl = self._plan
            keep = {k for k, _ in wanted}
            for k in [k for k in pl.tasks if k not in keep]:
                self._forget(k)
                self._dropped += 1
            for k, ids in wanted:
                t = pl.tasks.get(k)
                if t is not None and t.ids == ids:
                    continue
                if t is not None:
                    self._forget(k)
                    self._dropped += 1
                t = _Task(list(ids), pl.next_seq)
                pl.next_seq += 1
                pl.tasks[k] = t
                pl.by_seq[t.seq] = k
                submit.append((t.seq, t.ids))
            if self._thread is not None:
                self._queue.extend(submit)
                self._cv.notify_all()
        if self._procs:
            for item in submit:
                self._tasks_q.put(item)

    def reset(self) -> None:
        """Drop every loaded and pending batch (the order itself changed)."""
        self.plan([])

    def _forget(self, k: Key) -> None:
        t = self._plan.tasks.pop(k)
        self._plan.by_seq.pop(t.seq, None)

    def get(self, key: Key, ids: list[int]) -> Any:
        """The batch of micro-batch `key` holding the samples `ids`: the planned one
        (waiting for it if it is still loading), or, unplanned, loaded inline now.
        Raises `LoaderError` if its worker failed or died."""
        with self._cv:
            t = self._plan.tasks.get(key)
            if t is None or t.ids != ids or self._closed:
                t = None
            else:
                while not t.done:
                    self._cv.wait(LIVENESS_POLL_S)
                    if not t.done:
                        self._check_workers()
                self._forget(key)
        if t is None:
            return self.fetch(ids)
        if t.error is not None:
            raise LoaderError(f"loading micro-batch {key[1]} of step {key[0]} failed:\n{t.error}")
        return t.value

    def _check_workers(self) -> None:
        dead = [p for p in self._procs if not p.is_alive()]
        if dead:
            detail = ", ".join(f"pid {p.pid} (exit code {p.exitcode})" for p in dead)
            raise LoaderError(f"data worker process(es) exited: {detail}")

    # ---- results ------------------------------------------------------------------

    def _done(self, seq: int, value: Any, error: str | None) -> None:
        with self._cv:
            k = self._plan.by_seq.get(seq)
            if k is None:
                return  # dropped by a re-plan: nobody wants it
            t = self._plan.tasks[k]
            t.value, t.error, t.done = value, error, True
            self._cv.notify_all()

    def _thread_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                seq, ids = self._queue.popleft()
                if seq not in self._plan.by_seq:
                    continue  # dropped before it was started
            try:
                value, error = self.fetch(ids), None
            except Exception:  # noqa: BLE001 - the user's dataset: surfaced in `get`
                value, error = None, traceback.format_exc()
            self._done(seq, value, error)

    def _collect(self) -> None:
        while True:
            item = self._results_q.get()
            if item is None:
                return
            seq, payload, error = item
            value = None
            if payload is not None:
                try:
                    value = ForkingPickler.loads(payload)
                except Exception:  # noqa: BLE001 - reported to whoever waits for it
                    value, error = None, traceback.format_exc()
            self._done(seq, value, error)


def _die_with(parent: int) -> None:
    """Ask Linux for SIGKILL when the training process dies (a fork does not
    inherit the launcher's request); the parent poll in the loop covers the rest."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the request
        os._exit(0)


def _worker_main(fetch: Fetch, tasks: Any, results: Any, stopping: Any, parent: int) -> None:
    """A data worker process: load tasks until told to stop or orphaned."""
    import torch

    # Forked from the training process: not its SIGTERM handler (a leave) nor
    # Ctrl-C (the parent stops its workers itself).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    name_native_thread(WORKER_COMM)
    torch.set_num_threads(1)
    while True:
        try:
            item = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:
                # The training process died (SIGKILL): do not outlive it, nor wait to
                # flush results nobody will read.
                results.cancel_join_thread()
                return
            continue
        if item is None or stopping.is_set():
            return
        seq, ids = item
        try:
            # Pickled here, not in the queue's feeder thread, so that a batch that
            # cannot travel is reported instead of lost.
            payload, error = bytes(ForkingPickler.dumps(fetch(ids))), None
        except Exception:  # noqa: BLE001 - the user's dataset: surfaced in the parent's `get`
            payload, error = None, traceback.format_exc()
        results.put((seq, payload, error))

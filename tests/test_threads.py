"""The worker's own threads: their names in /proc and the hash thread's priority."""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading

import pytest

from elastrain.runtime.healing import _hash_thread
from elastrain.threads import HASH, yield_cpu

linux = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice is Linux's"
)


def _own_nice_and_name() -> tuple[int, str]:
    tid = threading.get_native_id()
    with open(f"/proc/self/task/{tid}/comm") as f:
        return os.getpriority(os.PRIO_PROCESS, tid), f.read().strip()


@linux
def test_yield_cpu_lowers_the_calling_thread_only() -> None:
    """A background thread that yields runs at nice 19; the process's other
    threads (the training thread, a heal's threads) keep their priority."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    got: list[int] = []

    def body() -> None:
        yield_cpu()
        got.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert got == [19]
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


@linux
def test_the_state_hash_thread_is_named_and_yields_the_cpu() -> None:
    """The engine's state-hash thread (a generation start's hash, beside the
    heal of others) is `el-hash` in /proc and at the lowest priority."""
    with concurrent.futures.ThreadPoolExecutor(1, initializer=_hash_thread) as pool:
        nice, name = pool.submit(_own_nice_and_name).result()
    assert (nice, name) == (19, HASH)

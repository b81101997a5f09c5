"""Native thread names the worker gives its own threads (``/proc/<pid>/task/<tid>/comm``).

What `top -H`, `ps -L` and profilers show, and what tells the threads that wait
out abandoned collectives apart in a leak check. Torch-free, so the launcher
side (the soak's leak check, the benchmarks' CPU per thread) can read the names
without importing torch.
"""

from __future__ import annotations

import os
import sys
import threading

COLLECTIVE_WAIT = "el-collective"
"""A `Waiter` helper: blocked in a collective's wait, or idle until the next one
(`elastrain.runtime.group`)."""
GRAVEYARD = "el-graveyard"
"""A `Graveyard` reaper waiting for a dropped group's work to end."""
LANDING = "el-landing"
"""A joiner's `LandingReserve` being touched while it waits to be admitted
(`elastrain.transfer.landing`); it ends once every page is resident."""
TRANSIENT_THREADS = frozenset({COLLECTIVE_WAIT, GRAVEYARD, LANDING})
"""Names (``/proc/<pid>/task/<tid>/comm``) of the threads that end on their own:
those that wait out an abandoned collective end when its operation does (at the
latest at the group's op timeout), so there are never more of them than
generations abandoned within that time, plus the one `Waiter` helper kept for the
next wait; the landing's ends when its pages are touched. A leak check counts
them apart (elastrain.chaos.soak)."""

QUORUM = "el-quorum"
"""The engine's quorum thread: the step's verdict request to the coordinator."""
HASH = "el-hash"
"""The engine's state-hash thread (a generation start's hash, off the critical path)."""
HEARTBEAT = "el-heartbeat"
"""The member session's heartbeats to the coordinator."""
METER = "el-meter"
"""The energy and CPU sampler (`elastrain.observe.power`)."""

WORKER_THREADS = (QUORUM, HEARTBEAT, COLLECTIVE_WAIT, HASH, METER, GRAVEYARD, LANDING)
"""Every name above: the worker's threads a per-thread CPU account tells apart."""


def yield_cpu() -> None:
    """Give the calling thread the lowest CPU priority (nice 19), on Linux, where
    a thread is a task of its own: for background work that must not take the CPU
    from the recovery's critical path on a machine with fewer free cores than busy
    threads. It still runs at once on an idle core, and whoever waits for it (a
    future's result) frees the core it needs."""
    if not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


def name_native_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 bytes) in /proc, on Linux.

    Written to ``/proc/self/task/<tid>/comm``, not through ``prctl`` by ctypes:
    ``ctypes.CDLL`` takes the dynamic loader's lock at every call, and a file
    write needs no library and no lock that a fork elsewhere could catch held."""
    if not sys.platform.startswith("linux"):
        return
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass

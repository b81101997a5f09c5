"""Native thread names the worker gives its threads that wait out abandoned collectives.

Torch-free, so the launcher side (the soak's leak check) can read the names
without importing torch.
"""

from __future__ import annotations

import ctypes
import sys

COLLECTIVE_WAIT = "el-collective"
"""A `Waiter` helper: blocked in a collective's wait, or idle until the next one
(`elastrain.runtime.group`)."""
GRAVEYARD = "el-graveyard"
"""A `Graveyard` reaper waiting for a dropped group's work to end."""
TRANSIENT_THREADS = frozenset({COLLECTIVE_WAIT, GRAVEYARD})
"""Names (``/proc/<pid>/task/<tid>/comm``) of the threads that wait out an abandoned
collective: each ends when its operation does (at the latest at the group's op
timeout), so there are never more of them than generations abandoned within that
time, plus the one `Waiter` helper kept for the next wait; a leak check counts them
apart (elastrain.chaos.soak)."""

PR_SET_NAME = 15


def name_native_thread(name: str) -> None:
    """Give the calling thread `name` (at most 15 bytes) in /proc, on Linux."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15])
    except (OSError, AttributeError):
        pass

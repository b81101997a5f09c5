"""How the launcher's children start: they die with it, and keep their files private.

Nothing outlives its supervisor: every child (the coordinator, each worker)
asks the kernel for SIGKILL when the thread that spawned it dies
(`PR_SET_PDEATHSIG`), so a launcher killed with SIGKILL takes the whole local
job with it instead of leaving it training unsupervised. The request is made
in the child between fork and exec and survives the exec; a launcher that
died before the request was made is caught by comparing the parent PID.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def child_setup(umask: int) -> Callable[[], None]:
    """A `preexec_fn`: set `umask`, and SIGKILL on the death of the spawning
    thread (Linux). Built in the parent, so the child calls nothing that
    loads a library or allocates much between fork and exec."""
    prctl = _prctl()
    parent = os.getpid()

    def setup() -> None:
        os.umask(umask)
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the launcher died before the request above
            os.kill(os.getpid(), signal.SIGKILL)

    return setup

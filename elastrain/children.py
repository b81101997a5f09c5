"""How the launcher's children start and end: they die with it, keep their files
private, and end without the interpreter's teardown.

Nothing outlives its supervisor: every child (the coordinator, the prefork
server, each worker) asks the kernel for SIGKILL when the thread that spawned
it dies (`PR_SET_PDEATHSIG`), so a launcher killed with SIGKILL takes the whole
local job with it instead of leaving it training unsupervised.

The child makes that request itself, first thing after it starts
(`die_with_parent`), not in a `preexec_fn` between fork and exec: Python code
run in the forked copy of a launcher that has torch or JAX loaded, with their
threads, can crash or deadlock there (it did: "Fatal Python error:
Segmentation fault" in `_execute_child`), and without a `preexec_fn`
`subprocess` can use `vfork`, which runs nothing of ours in the child at all.
The umask is `Popen`'s own argument. A launcher that died before the request
was made is caught by comparing the parent PID with the one the launcher put
in the child's environment (`spawn_env`).

They end with `end_process` once their work is done: what an exit does that
anyone can observe, then `os._exit` (see there why).

A top-level module, below `launch`: the children themselves (the coordinator
server, the worker entry point) call `die_with_parent`, and they sit below the
launcher.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import NoReturn

from elastrain import env

PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def spawn_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` plus this process's PID as the parent the child must die with
    (`die_with_parent`). Only for a child this process starts itself."""
    return {**base, env.PARENT_PID: str(os.getpid())}


def die_with(parent: int) -> None:
    """SIGKILL this process when the thread of `parent` that started it dies, and
    at once if `parent` is already gone (Linux's `PR_SET_PDEATHSIG`)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    # After the request: a parent that dies later is covered by the signal.
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGKILL)


def die_with_parent() -> None:
    """In a child started with `spawn_env`: `die_with` the parent named there.
    Removes the variable, so this process's own children do not inherit a
    parent that is not theirs. Does nothing in a process started otherwise (by
    hand)."""
    expected = os.environ.pop(env.PARENT_PID, "")
    if expected:
        die_with(int(expected))


def end_process(code: int) -> NoReturn:
    """End this process with status `code` once its work returned (a worker's
    script, the coordinator's server).

    What the interpreter's own exit does that anyone can observe, in its order:
    non-daemon threads are joined (and the executors that asked to be told,
    `concurrent.futures`), atexit hooks run (logging's flush among them), the
    garbage is collected (the script's namespace, which `runpy` leaves in a
    cycle with its functions, among it: its objects' finalizers run, with its
    globals still set, as the interpreter's last collection ran them), and
    buffered output is flushed. Then `os._exit`, skipping what no one observes: the teardown of
    every loaded module and of torch's C++ state. That teardown took 0.5-1 s of
    CPU per process here (torch and dynamo loaded), at a job's end on every
    member at once, and on a member's leave on the cores its peers go on
    training on. (A forked `multiprocessing` child ends the same way, with
    less: it runs no atexit hook.)"""
    try:
        # The interpreter's first step at exit; private, but stable since 3.4 and
        # what multiprocessing's children call too.
        shutdown = getattr(threading, "_shutdown")  # noqa: B009 - not in typeshed
        shutdown()
        atexit._run_exitfuncs()
        gc.collect()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):  # closed or replaced
                pass
        os._exit(code)

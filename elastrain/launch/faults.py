"""The launcher's fault seam: how fault injection plugs into a launcher that never imports it.

The launcher can fire a schedule of faults at its job (--fault) and run its
workers on simulated hosts (--hosts), but fault injection is a tool, not part
of the production launcher: both come from a `FaultPlugin` that an entry point
registers here before it starts a launcher with faults or hosts (the `elastrain
run` command line, the chaos soak, the test suite's conftest; the chaos
package's plugin is `PLUGIN` in its `injector` module). A launch with neither
and no plugin registered gets `NoFaults`, which injects nothing. The layering test
(tests/test_layers.py) holds the launcher and the worker runtime to this.

Who calls: `register` at entry-point start, before any launcher exists;
`injector_for` and the plugin's `hosts` from the launcher's main thread only.
The injector it returns is driven by the launcher's single-threaded main loop
(see `Injector`), so nothing here is shared between threads.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elastrain.launch.prefork import Proc
from elastrain.observe.events import EventLog


class FaultSpec(Protocol):
    """What the launcher reads of one scheduled fault (the plugin owns the rest)."""

    @property
    def kind(self) -> str: ...


class HasProc(Protocol):
    """A launcher worker as an injector sees it: its current process."""

    @property
    def proc(self) -> Proc: ...


class SimHost(Protocol):
    """One simulated host: a name for events, the address its workers advertise."""

    @property
    def name(self) -> str: ...

    @property
    def addr(self) -> str: ...


class SimHosts(Protocol):
    """Simulated hosts (--hosts) while they exist: the coordinator's side and the
    worker hosts. `exec_prefix(host)` is the argv prefix that runs a process on
    `host` (it execs, so the PID stays the worker's); `host` is one of `hosts`."""

    @property
    def coord(self) -> SimHost: ...

    @property
    def hosts(self) -> Sequence[SimHost]: ...

    def exec_prefix(self, host: Any) -> list[str]: ...


class FaultView(Protocol):
    """The schedule's progress, for callers that wait for it to be spent."""

    @property
    def pending(self) -> list[Any]: ...

    @property
    def exhausted(self) -> bool: ...


class Injector(Protocol):
    """Fires a fault schedule at the running job, driven by the launcher's loop.

    `poll` with each fresh coordinator status schedules the faults now due
    through the launcher's timer (`at(delay_s, what, arg)` with `what` one of
    "fault", "resume", "release-disk", "reconnect"); the launcher hands each
    timer's `arg` back, unread, to `fire`, `resume`'s caller, `reconnect`.
    `killed` are the PIDs it killed (their deaths are not the job's fault);
    `replace_delay` says when to replace a dead process; `log` is every fault
    it fired."""

    killed: set[int]
    log: list[dict[str, Any]]

    @property
    def schedule(self) -> FaultView: ...

    def poll(self, status: Mapping[str, Any], live: list[str]) -> None: ...

    def fire(
        self,
        fault: Any,
        victim: str,
        workers: Mapping[str, HasProc],
        coordinator: subprocess.Popen[bytes] | None,
        step: int,
    ) -> None: ...

    def resume(self, member: str, pid: int, workers: Mapping[str, HasProc], step: int) -> None: ...

    def release_disk(self, step: int) -> None: ...

    def reconnect(self, where: Any, step: int) -> None: ...

    def replace_delay(self, pid: int, default: float) -> float: ...

    def close(self) -> None: ...


HostOf = Callable[[str], "tuple[SimHosts, Any] | None"]
"""Member -> (the simulated hosts, the member's host), None off the simulated hosts."""


@dataclass(frozen=True)
class JobHandles:
    """What an injector reaches of the launcher's running job."""

    events: EventLog
    """The launcher's event log (every fault becomes a `fault_injected` event)."""
    run_dir: Path
    """The run directory (the members' chaos inboxes live there)."""
    checkpoint_dir: Path
    """The job's checkpoints (for faults that damage them or fill their disk)."""
    at: Callable[[float, str, Any], None]
    """The launcher's timer: ``at(delay_s, what, arg)`` (see `Injector`)."""
    host_of: HostOf
    """Where a member runs, on simulated hosts."""


class FaultPlugin(Protocol):
    """Fault injection as the launcher sees it (registered by an entry point)."""

    def injector(self, faults: Sequence[FaultSpec], seed: int, job: JobHandles) -> Injector:
        """The injector that fires `faults` (seeded by `seed`) at `job`."""
        ...

    def hosts(self, n: int) -> AbstractContextManager[SimHosts]:
        """Build `n` simulated hosts (RuntimeError/OSError if this machine cannot);
        entering the result moves the calling thread into the coordinator's side
        until the block ends, when the hosts are deleted."""
        ...


class _NoSchedule:
    def __init__(self) -> None:
        self.pending: list[Any] = []
        self.exhausted = True


class NoFaults:
    """The injector of a launch without faults: nothing is due, nobody killed."""

    def __init__(self) -> None:
        self.killed: set[int] = set()
        self.log: list[dict[str, Any]] = []
        self.schedule: FaultView = _NoSchedule()

    def poll(self, status: Mapping[str, Any], live: list[str]) -> None:
        return None

    def fire(
        self,
        fault: Any,
        victim: str,
        workers: Mapping[str, HasProc],
        coordinator: subprocess.Popen[bytes] | None,
        step: int,
    ) -> None:
        raise AssertionError("NoFaults schedules no fault")

    def resume(self, member: str, pid: int, workers: Mapping[str, HasProc], step: int) -> None:
        raise AssertionError("NoFaults stops no process")

    def release_disk(self, step: int) -> None:
        raise AssertionError("NoFaults fills no disk")

    def reconnect(self, where: Any, step: int) -> None:
        raise AssertionError("NoFaults cuts no host")

    def replace_delay(self, pid: int, default: float) -> float:
        return default

    def close(self) -> None:
        return None


_plugin: FaultPlugin | None = None


def register(plugin: FaultPlugin) -> None:
    """Make `plugin` the fault injection of every launcher started from now on."""
    global _plugin
    _plugin = plugin


def plugin(why: str) -> FaultPlugin:
    """The registered plugin; `why` names what needs it, for the error when none is."""
    if _plugin is None:
        raise ValueError(
            f"{why} needs fault injection, and no fault plugin is registered "
            "(an entry point registers one: elastrain.launch.faults.register)"
        )
    return _plugin


def injector_for(faults: Sequence[FaultSpec], seed: int, job: JobHandles) -> Injector:
    """The registered plugin's injector for `faults` (one with no faults yet can
    still be handed some through its `schedule`), or `NoFaults` when no plugin is
    registered and there are none."""
    if _plugin is None and not faults:
        return NoFaults()
    return plugin("a fault schedule (--fault)").injector(faults, seed, job)

"""The chaos package's fault plugin for the launcher: the fault schedule fired at a running job.

The launcher imports none of this: an entry point registers `PLUGIN` with
`elastrain.launch.faults.register` (`register()` here does it), and the
launcher reaches it only through that seam's protocols.

Who calls: the launcher's main loop only (single-threaded): `poll` with each
fresh coordinator status decides which faults are due and on whom, and hands
them back to the loop's timer (`at`) so that member signals land mid-step;
`fire` then injects one; the loop asks `replace_delay` when to replace a
victim (a kill's /hold= holds its replacement back). A `cut` takes the
victim's simulated host (the launcher's --hosts) off the network and
schedules its `reconnect`. Every fault becomes a `fault_injected` event and
an entry in `log`; a fault that cannot be injected (no committed checkpoint to
damage, a filesystem too large to fill) is still an event, with `skipped`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

from elastrain.chaos.inject import DiskFiller, damage_checkpoint, send_slow
from elastrain.chaos.netns import Host, Network, entered
from elastrain.chaos.schedule import COORDINATOR, JOB, Fault, FaultSchedule
from elastrain.launch import faults as seam
from elastrain.launch.faults import FaultSpec, HasProc, JobHandles, SimHosts
from elastrain.observe.events import EventKind, EventLog

_SIGNALS = {"kill": signal.SIGKILL, "hang": signal.SIGSTOP, "term": signal.SIGTERM}
_Proc = HasProc


class Injector:
    """`elastrain.launch.faults.Injector` for a `FaultSchedule` (see the module docstring)."""

    def __init__(
        self,
        faults: Sequence[Fault],
        seed: int,
        *,
        events: EventLog,
        run_dir: Path,
        checkpoint_dir: Path,
        at: Callable[[float, str, Any], None],
        fill_limit_bytes: int = 1 << 30,
        host_of: Callable[[str], tuple[Network, Host] | None] = lambda member: None,
    ) -> None:
        self.schedule = FaultSchedule(list(faults), seed)
        self.events = events
        self.run_dir = run_dir
        self.checkpoint_dir = checkpoint_dir
        self._at = at
        self.rng = random.Random(seed + 1)
        self.filler = DiskFiller(checkpoint_dir, fill_limit_bytes)
        self.log: list[dict[str, Any]] = []
        self.killed: set[int] = set()
        """PIDs this injector killed (their deaths are not the job's fault)."""
        self.holds: dict[int, float] = {}
        """PID -> seconds from its death to its replacement's start (a fault's /hold=)."""
        self._t_first_commit: float | None = None
        self._host_of = host_of
        self._cuts: dict[str, int] = {}
        """Host name -> cuts in force (overlapping cuts: the link comes back with the last)."""

    def poll(self, status: Mapping[str, Any], live: list[str]) -> None:
        """Schedule the faults due at this status; `live` are the members with a process."""
        step = int(status.get("step", 0))
        if step >= 1 and self._t_first_commit is None:
            self._t_first_commit = time.monotonic()
        elapsed = (
            time.monotonic() - self._t_first_commit if self._t_first_commit is not None else None
        )
        for f in self.schedule.due(step, elapsed):
            members = [m for m in status.get("members", []) if m in live]
            # A named victim may be any worker with a process (a standby, a hot
            # spare, too); a seeded-random one is one of the generation's members.
            victim = self.schedule.pick(f, live if f.member is not None else members)
            if victim is None and f.member is None and f.every_s is None:
                self.schedule.pending.append(f)  # nobody to pick right now: at the next status
                continue
            if victim is None:
                self._record(f, None, None, step, skipped="no live member to pick")
                continue
            if f.kind in _SIGNALS:
                rate = float(status.get("steps_per_s") or 0.0)
                self._at(
                    self.schedule.offset(1.0 / rate if rate > 0 else 0.2), "fault", (f, victim)
                )
            else:
                self._at(0.0, "fault", (f, victim))

    def fire(
        self,
        fault: Fault,
        victim: str,
        workers: Mapping[str, _Proc],
        coordinator: subprocess.Popen[bytes] | None,
        step: int,
    ) -> None:
        k = fault.kind
        if victim == COORDINATOR:
            if coordinator is None or coordinator.poll() is not None:
                return
            self._record(fault, victim, coordinator.pid, step)
            self.killed.add(coordinator.pid)
            os.kill(coordinator.pid, signal.SIGKILL)
            return
        if victim == JOB:
            self._fire_job(fault, workers, step)
            return
        w = workers.get(victim)
        if w is None:
            return
        pid = w.proc.pid
        if k == "slow":
            assert fault.delay_s is not None and fault.steps is not None
            send_slow(self.run_dir, victim, fault.delay_s, fault.steps)
            self._record(fault, victim, pid, step, delay_s=fault.delay_s, steps=fault.steps)
            return
        if k == "cut":
            self._cut(fault, victim, pid, step)
            return
        if fault.hold_s is not None:
            self.holds[pid] = fault.hold_s
            self._record(fault, victim, pid, step, hold_s=fault.hold_s)
        else:
            self._record(fault, victim, pid, step)
        if k == "kill":
            self.killed.add(pid)
        os.kill(pid, _SIGNALS[k])
        if k == "hang" and fault.duration_s is not None:
            self._at(fault.duration_s, "resume", (victim, pid))

    def _fire_job(self, fault: Fault, workers: Mapping[str, _Proc], step: int) -> None:
        k = fault.kind
        if k == "kill-all":
            pids = [w.proc.pid for w in workers.values() if w.proc.poll() is None]
            self._record(fault, JOB, None, step, pids=pids)
            for pid in pids:
                self.killed.add(pid)
                os.kill(pid, signal.SIGKILL)
        elif k in ("corrupt-ckpt", "truncate-ckpt"):
            how = "corrupt" if k == "corrupt-ckpt" else "truncate"
            self._record(
                fault, JOB, None, step, **damage_checkpoint(self.checkpoint_dir, self.rng, how)
            )
        elif k == "fill-disk":
            details = self.filler.fill()
            self._record(fault, JOB, None, step, duration_s=fault.duration_s, **details)
            if "skipped" not in details:
                self._at(fault.duration_s or 0.0, "release-disk", None)
        else:
            raise ValueError(f"unknown job fault {k!r}")

    def _cut(self, fault: Fault, victim: str, pid: int, step: int) -> None:
        where = self._host_of(victim)
        if where is None:
            self._record(fault, victim, pid, step, skipped="not on a simulated host (--hosts)")
            return
        net, host = where
        net.cut(host)
        self._cuts[host.name] = self._cuts.get(host.name, 0) + 1
        self._record(fault, victim, pid, step, host=host.name, duration_s=fault.duration_s)
        self._at(fault.duration_s if fault.duration_s is not None else 10.0, "reconnect", where)

    def reconnect(self, where: tuple[Network, Host], step: int) -> None:
        """End one cut of a host; its link comes back when no other cut holds it down."""
        net, host = where
        self._cuts[host.name] -= 1
        if self._cuts[host.name] > 0:
            return
        net.heal(host)
        self.events.emit(
            EventKind.FAULT_INJECTED,
            fault="reconnect",
            member=JOB,
            pid=None,
            step=step,
            host=host.name,
        )

    def replace_delay(self, pid: int, default: float) -> float:
        """Seconds from this process's death to its replacement's start: the
        fault's /hold= when one killed it, else `default` (--replace-delay)."""
        return self.holds.pop(pid, default)

    def resume(self, member: str, pid: int, workers: Mapping[str, _Proc], step: int) -> None:
        """SIGCONT a hung member (if that process is still the member)."""
        w = workers.get(member)
        if w is not None and w.proc.pid == pid:
            os.kill(pid, signal.SIGCONT)
            self.events.emit(
                EventKind.FAULT_INJECTED, fault="resume", member=member, pid=pid, step=step
            )

    def release_disk(self, step: int) -> None:
        self.filler.release()
        self.events.emit(
            EventKind.FAULT_INJECTED, fault="release-disk", member=JOB, pid=None, step=step
        )

    def close(self) -> None:
        self.filler.release()

    def _record(
        self, fault: Fault, victim: str | None, pid: int | None, step: int, **details: Any
    ) -> None:
        self.events.emit(
            EventKind.FAULT_INJECTED, fault=fault.kind, member=victim, pid=pid, step=step, **details
        )
        self.log.append(
            {"fault": fault.kind, "member": victim, "pid": pid, "step": step, **details}
        )


class ChaosFaults:
    """`elastrain.launch.faults.FaultPlugin`: this module's injector, `chaos.netns` hosts."""

    def injector(self, faults: Sequence[FaultSpec], seed: int, job: JobHandles) -> Injector:
        mine = [f for f in faults if isinstance(f, Fault)]
        if len(mine) != len(faults):
            raise TypeError("the chaos injector fires elastrain.chaos.schedule.Fault faults only")

        def netns_host_of(member: str) -> tuple[Network, Host] | None:
            where = job.host_of(member)
            if where is None:
                return None
            net, host = where
            assert isinstance(net, Network) and isinstance(host, Host)  # ours: built by hosts()
            return net, host

        return Injector(
            mine,
            seed,
            events=job.events,
            run_dir=job.run_dir,
            checkpoint_dir=job.checkpoint_dir,
            at=job.at,
            host_of=netns_host_of,
        )

    @contextmanager
    def _entered(self, net: Network) -> Iterator[SimHosts]:
        with net, entered(net.coord):
            yield net

    def hosts(self, n: int) -> AbstractContextManager[SimHosts]:
        """Build the hosts now (so that a machine that cannot fails here), enter them later."""
        return self._entered(Network(n))


PLUGIN = ChaosFaults()
"""The chaos package's fault plugin."""


def register() -> None:
    """Make chaos the fault injection of every launcher started from now on
    (what an entry point that offers --fault or --hosts calls first)."""
    seam.register(PLUGIN)

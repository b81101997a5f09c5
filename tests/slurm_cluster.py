"""A real Slurm cluster of a few nodes on this machine, for tests/test_slurm.py.

`LocalSlurm(tmp, nodes=3)` writes a munge key and a slurm.conf into `tmp`
(loopback, free ports, state and spool under `tmp`, root as SlurmUser) and
starts munged, slurmctld and one slurmd per node in the foreground as child
processes, so each is stopped by its PID in `close()`. The nodes
`elastrain-n0`, `elastrain-n1`, ... all have NodeAddr 127.0.0.1, each slurmd
its own port (`Port=` on its NodeName line, which Debian's slurmd honours: two
slurmd on one host ran a 2-node `srun`); they share the host's CPUs. Commands reach this cluster through
`env` (SLURM_CONF). Debian's slurm-wlm and munge are installed with apt-get
when absent (`ensure_installed`); `unavailable()` says why a test must skip.

Run it by hand: `python tests/slurm_cluster.py` brings the cluster up, prints
`sinfo` and the environment to use, and stops it on Enter.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
PACKAGES = ("slurm-wlm", "munge")


def unavailable() -> str | None:
    """Why a local cluster cannot be run here (None: it can)."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    if shutil.which("apt-get") is None and any(shutil.which(d) is None for d in DAEMONS):
        return "slurm-wlm and munge are not installed and apt-get is not available"
    return None


def ensure_installed() -> None:
    """apt-get install slurm-wlm and munge if a daemon is missing (RuntimeError on failure)."""
    if all(shutil.which(d) for d in DAEMONS):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    r = subprocess.run(["apt-get", "install", "-y", *PACKAGES], env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    if r.returncode != 0 or not all(shutil.which(d) for d in DAEMONS):
        raise RuntimeError(f"apt-get install {' '.join(PACKAGES)} failed: {r.stderr[-2000:]}")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def slurm_conf(tmp: Path, nodes: dict[str, int], cpus: int, ctld_port: int) -> str:
    """The cluster's slurm.conf: `nodes` (name -> slurmd port) at 127.0.0.1 with
    `cpus` CPUs each, one partition `debug` of all of them."""
    return "\n".join([
        "ClusterName=elastrain-test",
        # slurmctld only runs on the host its SlurmctldHost names.
        f"SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)",
        "MailProg=/bin/true",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        # cred_expire: Slurm holds a requeued batch job until its old credential has
        # expired (default 120 s); 5 s keeps the requeue test short.
        f"AuthInfo=socket={tmp / 'munge.socket'},cred_expire=5",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"StateSaveLocation={tmp / 'state'}",
        f"SlurmdSpoolDir={tmp / 'spool' / '%n'}",
        f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
        f"SlurmdPidFile={tmp / 'slurmd.%n.pid'}",
        f"SlurmctldLogFile={tmp / 'slurmctld.log'}",
        f"SlurmdLogFile={tmp / 'slurmd.%n.log'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill",
        # A requeued job becomes eligible when its hold ends, which no event announces:
        # the passes that start it run every sched_interval (default 60 s) and
        # bf_interval (default 30 s); with 1 s it starts within a second of eligible.
        "SchedulerParameters=bf_interval=1,sched_interval=1",
        "ReturnToService=2",
        "MpiDefault=none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=30",
        "InactiveLimit=0",
        "KillWait=5",
        "MinJobAge=600",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        *(f"NodeName={n} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} State=UNKNOWN"
          for n, port in nodes.items()),
        f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])  # fmt: skip


class LocalSlurm:
    """munged + slurmctld + one slurmd, children of this process, stopped by PID."""

    def __init__(self, tmp: Path, nodes: int = 1) -> None:
        self.tmp = tmp
        self.nodes = [f"elastrain-n{i}" for i in range(nodes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for d in ("state", "spool", "munge"):
            (tmp / d).mkdir(parents=True, exist_ok=True)
        tmp.chmod(0o755)
        key = tmp / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        ctld, *ports = free_ports(1 + nodes)
        self.conf = tmp / "slurm.conf"
        cpus = max(1, (os.cpu_count() or 1) // nodes)
        self.conf.write_text(slurm_conf(tmp, dict(zip(self.nodes, ports, strict=True)), cpus, ctld))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.out", "ab")  # noqa: SIM115
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                             start_new_session=True)  # fmt: skip
        log.close()
        self.procs.append(p)
        return p

    def _wait(
        self, what: str, ok: Callable[[], bool], p: subprocess.Popen[bytes], timeout: float
    ) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            if p.poll() is not None:
                raise RuntimeError(f"{what} exited ({p.returncode}): {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out waiting for {what}: {self.logs()}")
            time.sleep(0.1)  # polling the daemons' state

    def _start(self) -> None:
        sock = self.tmp / "munge.socket"
        m = self._spawn("munged", ["munged", "-F", "-f", f"--socket={sock}",
                                   f"--key-file={self.tmp / 'munge' / 'munge.key'}",
                                   f"--pid-file={self.tmp / 'munged.pid'}",
                                   f"--log-file={self.tmp / 'munged.log'}",
                                   f"--seed-file={self.tmp / 'munge' / 'seed'}"])  # fmt: skip
        self._wait("munged", sock.exists, m, 20)
        c = self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait("slurmctld", lambda: self._ok(["scontrol", "ping"], "UP"), c, 30)
        for n in self.nodes:
            d = self._spawn(f"slurmd-{n}", ["slurmd", "-D", "-N", n, "-f", str(self.conf)])
        self._wait("every slurmd", self._all_idle, d, 60)

    def _all_idle(self) -> bool:
        r = self.run("sinfo", "-h", "-N", "-o", "%N %T")
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return r.returncode == 0 and all(states.get(n) == "idle" for n in self.nodes)

    def _ok(self, argv: list[str], want: str) -> bool:
        r = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=20)
        return r.returncode == 0 and want in r.stdout

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """A Slurm command against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True,
                              timeout=30)  # fmt: skip

    def logs(self) -> str:
        out = []
        for f in sorted(self.tmp.glob("*.log")) + sorted(self.tmp.glob("*.out")):
            out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}")
        return "\n".join(out)

    def cancel_all(self, timeout: float = 30) -> None:
        """scancel every job of this cluster and wait until slurmctld has none left
        running: a job's slurmstepd is not a child of slurmd (it outlives it), so the
        jobs must end before the daemons do."""
        if len(self.procs) < 2 or self.procs[1].poll() is not None:
            return  # no slurmctld to ask
        jobs = self.run("squeue", "-h", "-o", "%i").stdout.split()
        if not jobs:
            return
        self.run("scancel", "--full", *jobs)
        deadline = time.monotonic() + timeout
        while self.run("squeue", "-h", "-t", "running,completing", "-o", "%i").stdout.split():
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)  # polling slurmctld

    def close(self) -> None:
        """Cancel the cluster's jobs, then stop every daemon by PID: the slurmds,
        slurmctld, then munged."""
        try:
            self.cancel_all()
        except (OSError, subprocess.SubprocessError):
            pass  # the daemons are stopped below either way
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()


if __name__ == "__main__":
    import tempfile

    ensure_installed()
    cl = LocalSlurm(Path(tempfile.mkdtemp(prefix="elastrain-slurm-")), nodes=3)
    try:
        print(cl.run("sinfo").stdout)
        print(f"export SLURM_CONF={cl.conf}")
        input("Enter stops the cluster ")
    finally:
        cl.close()

"""Multi-node on one machine: a coordinator and three agents ("nodes") in network
namespaces; a worker dies, a whole node dies, a node is partitioned.

The coordinator (`elastrain coordinator`) runs in the coordinator namespace,
bound to its bridge address. Each host namespace (`tests/netns.py`) runs one
`elastrain agent` with `--host` set to that namespace's address, so its
workers' gloo groups use the namespace's link: h0 runs node a (1 worker),
h1 node b (1 worker), h2 node c (2 workers), one job of 4 (`--min 2`). Each
agent has a run directory of its own, and so has the coordinator (they share
the file system); the checks merge the events of all of them.

One job, three scenarios in turn, each driven by conditions on the events,
with deadlines (never fixed sleeps):

(a) a worker dies (SIGKILL to a-w0 by PID): the other three commit in a
    generation without it; agent a starts a replacement (a-w1), which is healed
    and trains in a generation of four.
(b) a node dies (SIGKILL to agent c): its two workers die with it
    (PR_SET_PDEATHSIG); the survivors a-w1 and b-w0 commit in a generation of
    two. A new agent d starts on h2 (a replacement node); its workers join, are
    healed and train in a generation of four.
(c) h1 is partitioned (its bridge port goes down): the other three commit in
    a generation without b-w0 while b-w0 finds the coordinator unreachable; the
    link comes back; b-w0 registers again and is healed (or, should it have
    exited, agent b's replacement is), and trains in a generation of four.

Then the job runs to its end: agents a, b and d exit 0 ("done"); identical
state at every generation start; every sample of every step consumed exactly
once; identical final parameters on every member of the last generation.

The job is slowed by a pace file (read by train_mlp.py every step) while the
scenarios run, so the step budget does not depend on how long this machine
takes to start a Python process with torch; afterwards it runs at full speed.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastrain.observe.events import EventTail
from elastrain.observe.ledger import check_exactly_once, check_same_state

from . import netns
from .conftest import MLP, ROOT
from .test_elastic import expected_ids

COORD_PORT, STORE_PORT = 29400, 29401
"""Fixed: the coordinator's namespace is the test's alone, so nothing can hold
them, and the agents can start at the same time as the coordinator (their
workers retry registering until it answers)."""

STEPS = 400
PACE_WAIT_S = 0.5
"""Seconds per step while the test waits on process start-ups (2 steps/s).
The scenarios used ~140 steps in 2 minutes at load 13 on 2 cores (three
start-ups of 20-45 s each); the rest run at full speed at the end."""
PACE_CUT_S = 0.2
"""Seconds per step during the partition: the cut lasts ~10.5 s (until the
cut-off worker's heartbeat times out), and the survivors must commit 10 steps."""

Event = dict[str, Any]


@pytest.fixture
def net() -> Iterator[netns.Network]:
    yield from netns.network(hosts=3)


def of(evs: Sequence[Event], kind: str, **match: Any) -> list[Event]:
    return [e for e in evs if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def gens_with(evs: Sequence[Event], members: Callable[[set[str]], bool], after: float) -> set[int]:
    """Generations made ready after `after` whose member set satisfies `members`."""
    return {
        g["gen"]
        for g in of(evs, "generation_ready")
        if g["t"] > after and members(set(g["members"]))
    }


def commits(evs: Sequence[Event], member: str, gens: set[int], after: float) -> list[Event]:
    return [e for e in of(evs, "step_commit", proc=member) if e["gen"] in gens and e["t"] > after]


def pid_gone(pid: int) -> bool:
    """Dead or a zombie (its parent, a killed agent, is gone; init reaps it)."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (ProcessLookupError, FileNotFoundError):
        return True


class Cluster:
    """One job: a coordinator in the coordinator namespace and `elastrain agent`s
    on the host namespaces, with a polling view of all their events. Every
    process is started with `net.run_in`, so the network's teardown kills it (an
    agent's workers die with their agent). Also used by benchmarks/multinode.py."""

    def __init__(
        self,
        net: netns.Network,
        base: Path,
        *,
        target: int,
        min_members: int,
        steps: int,
        script_args: Sequence[str] = (),
    ) -> None:
        self.net = net
        self.base = base
        self.target, self.min_members, self.steps = target, min_members, steps
        self.script_args = list(script_args)
        base.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.token_file = base / "token"
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.env = dict(
            os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
        )
        self.env.pop("ELASTRAIN_TOKEN", None)
        self.address = f"{net.coord.addr}:{COORD_PORT}"
        self.coordinator: subprocess.Popen[str] | None = None
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.agent_dirs: dict[str, Path] = {}
        self.killed: set[str] = set()
        """Agents killed on purpose (their exit is no failure)."""
        self._tails: list[EventTail] = []
        self.evs: list[Event] = []

    def start_coordinator(self) -> None:
        d = self.base / "coord"
        d.mkdir()
        argv = [sys.executable, "-m", "elastrain.cli", "coordinator", "--bind", self.address,
                "--store-port", str(STORE_PORT), "--target", str(self.target),
                "--min", str(self.min_members), "--run-dir", str(d)]  # fmt: skip
        with open(self.base / "coordinator.log", "wb") as log:
            self.coordinator = self.net.run_in(
                self.net.coord,
                argv,
                dict(self.env, ELASTRAIN_TOKEN=self.token),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
            )
        self._tails.append(EventTail(d))

    def coordinator_info(self) -> dict[str, Any]:
        """The line the coordinator prints once it listens (blocks until then)."""
        assert self.coordinator is not None and self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        assert line, "coordinator did not start:\n" + (self.base / "coordinator.log").read_text()
        info: dict[str, Any] = json.loads(line)
        return info

    def start_agent(
        self, name: str, host: netns.Host, nproc: int, *extra: str
    ) -> subprocess.Popen[bytes]:
        """`elastrain agent` on `host`: its workers advertise the host's address."""
        d = self.base / name
        argv = [sys.executable, "-m", "elastrain.cli", "agent", "--coordinator", self.address,
                "--token-file", str(self.token_file), "--name", name, "--nproc", str(nproc),
                "--host", host.addr, "--plain", "--steps", str(self.steps), "--run-dir", str(d),
                *extra, MLP, *self.script_args]  # fmt: skip
        with open(self.base / f"agent-{name}.log", "wb") as log:
            p = self.net.run_in(host, argv, self.env, stdout=log, stderr=subprocess.STDOUT)
        self.agents[name] = p
        self.agent_dirs[name] = d
        self._tails.append(EventTail(d))
        return p

    def poll(self) -> list[Event]:
        new = [e for t in self._tails for e in t.poll()]
        if new:
            self.evs = sorted([*self.evs, *new], key=lambda e: e["t"])
        return self.evs

    def spawned(self, member: str) -> Event:
        """The `worker_spawned` event of `member` (its agent wrote it)."""
        got = of(self.poll(), "worker_spawned", member=member)
        assert got, f"no worker_spawned for {member}"
        return got[-1]

    def wait_for(self, what: str, cond: Callable[[list[Event]], Any], timeout_s: float) -> Any:
        """Poll the events until `cond(events)` is truthy; fail after `timeout_s`, or
        at once if an agent that was not killed on purpose exits."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond(self.poll())
            if got:
                return got
            for name, p in self.agents.items():
                if name not in self.killed and p.poll() is not None:
                    hint = " (the job ran out of steps: raise STEPS)" if p.returncode == 0 else ""
                    pytest.fail(f"agent {name} exited with {p.returncode} while waiting for "
                                f"{what}{hint}:\n{self.log(name)[-3000:]}")  # fmt: skip
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.3)  # polling files written by other processes

    def log(self, agent: str) -> str:
        return (self.base / f"agent-{agent}.log").read_text(errors="replace")

    def wait_agents(self, names: Sequence[str], timeout_s: float) -> dict[str, int]:
        deadline = time.monotonic() + timeout_s
        rcs = {}
        for n in names:
            try:
                rcs[n] = self.agents[n].wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"agent {n} did not finish:\n{self.log(n)[-3000:]}")
        return rcs

    def worker_pids(self) -> set[int]:
        return {e["pid"] for e in of(self.poll(), "worker_spawned")}

    def kill_workers(self) -> None:
        """Teardown: SIGKILL every worker any agent spawned, by PID."""
        for pid in self.worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def set_pace(path: Path, seconds: float) -> None:
    """Atomically: a worker reading it mid-write must never see a torn number."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(repr(seconds))
    tmp.replace(path)


def test_worker_kill_node_loss_and_partition_across_hosts(
    net: netns.Network, tmp_path: Path
) -> None:
    pace = tmp_path / "pace"
    set_pace(pace, PACE_WAIT_S)
    job = Cluster(
        net, tmp_path / "job", target=4, min_members=2, steps=STEPS,
        script_args=["--pace-file", str(pace)],
    )  # fmt: skip
    h0, h1, h2 = net.hosts
    try:
        job.start_coordinator()
        job.start_agent("a", h0, 1)
        job.start_agent("b", h1, 1)
        job.start_agent("c", h2, 2)
        info = job.coordinator_info()
        assert (info["host"], info["port"]) == (net.coord.addr, COORD_PORT), info
        t: dict[str, float] = {"spawned": time.time()}
        _scenarios(job, net, pace, t)
        # The rest of the job at full speed; every live agent ends "done".
        set_pace(pace, 0.0)
        rcs = job.wait_agents(["a", "b", "d"], 300)
        for n, rc in rcs.items():
            assert rc == 0 and "job done" in job.log(n), f"agent {n}: {rc}\n{job.log(n)[-3000:]}"
        t["end"] = time.time()
    finally:
        job.kill_workers()
    evs = job.poll()

    # Never diverged: same state at every generation start, exactly-once data
    # over all steps, identical final parameters on the last generation's members.
    assert check_same_state(evs) == []
    led = check_exactly_once(evs, expected_ids)
    assert led.violations == [] and led.committed_steps == STEPS, led.violations
    last = of(evs, "generation_ready")[-1]["members"]
    finals = {f.stem: np.load(f) for d in job.agent_dirs.values() for f in d.glob("final/*.npy")}
    assert sorted(finals) == sorted(last), (sorted(finals), last)
    ref = finals[last[0]]
    for m, arr in finals.items():
        assert np.array_equal(ref, arr), f"{m}'s final parameters differ from {last[0]}'s"
    # Survivors trained on through the later faults in their own processes: b-w0
    # through the worker kill and the node loss, a-w1 (a's replacement) through
    # the node loss and the partition, to the end.
    for m, through in (("b-w0", "node_lost_survived"), ("a-w1", "partition_healed")):
        mine = of(evs, "step_commit", proc=m)
        assert {e["pid"] for e in mine} == {job.spawned(m)["pid"]}, m
        assert [e for e in mine if e["t"] > t[through]], m
    assert of(evs, "step_commit", proc="a-w1", step=STEPS - 1)
    print("multinode timings (s): " + json.dumps({k: round(v - t["spawned"], 2) for k, v in t.items()}))  # fmt: skip


def _scenarios(job: Cluster, net: netns.Network, pace: Path, t: dict[str, float]) -> None:
    _, h1, h2 = net.hosts
    four = {"a-w0", "b-w0", "c-w0", "c-w1"}

    # 0. All four train together for a few steps.
    def started(evs: list[Event]) -> bool:
        g = gens_with(evs, lambda m: m == four, 0)
        return all(len(commits(evs, m, g, 0)) >= 3 for m in four)

    job.wait_for("four members on three hosts to commit 3 steps", started, 240)
    t["started"] = time.time()

    # (a) A worker dies; its agent replaces it; the replacement is healed.
    survivors = {"b-w0", "c-w0", "c-w1"}
    victim = job.spawned("a-w0")
    t["kill_worker"] = time.time()
    os.kill(victim["pid"], signal.SIGKILL)

    def without_victim(m: set[str]) -> bool:
        # The survivors go on without a-w0: alone, or already beside its replacement,
        # which a warm prefork server can start before their first commit.
        return survivors <= m and "a-w0" not in m

    def replaced(evs: list[Event]) -> bool:
        t0 = t["kill_worker"]
        g3 = gens_with(evs, without_victim, t0)
        g4 = gens_with(evs, lambda m: m == {"a-w1", *survivors}, t0)
        return (
            all(commits(evs, m, g3, t0) for m in survivors)
            and bool(of(evs, "heal_end", proc="a-w1", role="recv"))
            and bool(commits(evs, "a-w1", g4, t0))
        )

    job.wait_for("a-w0's survivors to commit, and its replacement to heal", replaced, 180)
    t["worker_replaced"] = time.time()
    sp = job.spawned("a-w1")
    assert sp["replacement"] and sp["replaces"] == "a-w0" and sp["proc"] == "agent-a", sp
    evs = job.poll()
    exited = of(evs, "worker_exited", member="a-w0")
    assert exited and exited[0]["returncode"] == -signal.SIGKILL, exited

    # (b) A node dies: SIGKILL to agent c; its workers die with it; the survivors
    #     go on as two; a new node (agent d on h2) joins and its workers are healed.
    c_pids = [job.spawned(m)["pid"] for m in ("c-w0", "c-w1")]
    job.killed.add("c")
    t["kill_node"] = time.time()
    job.agents["c"].kill()
    job.agents["c"].wait()
    deadline = time.monotonic() + 10
    while not all(pid_gone(pid) for pid in c_pids):
        assert time.monotonic() < deadline, "node c's workers outlived their agent"
        time.sleep(0.05)  # waiting for the kernel's parent-death signal
    pair = {"a-w1", "b-w0"}

    def pair_trains(evs: list[Event]) -> bool:
        g = gens_with(evs, lambda m: m == pair, t["kill_node"])
        return all(len(commits(evs, m, g, t["kill_node"])) >= 3 for m in pair)

    job.wait_for("the survivors of node c to commit 3 steps as two", pair_trains, 60)
    t["node_lost_survived"] = time.time()
    job.start_agent("d", h2, 2)
    new_four = {*pair, "d-w0", "d-w1"}

    def node_joined(evs: list[Event]) -> bool:
        t0 = t["kill_node"]
        g = gens_with(evs, lambda m: m == new_four, t0)
        return all(
            of(evs, "heal_end", proc=m, role="recv") and commits(evs, m, g, t0)
            for m in ("d-w0", "d-w1")
        )

    job.wait_for("the replacement node's workers to heal and train", node_joined, 240)
    t["node_replaced"] = time.time()
    evs = job.poll()
    for m in ("c-w0", "c-w1"):
        assert [e for e in of(evs, "member_removed", member=m) if e["t"] > t["kill_node"]], m

    # (c) h1 is partitioned: the others go on as three; b-w0 loses the coordinator;
    #     the link comes back; b-w0 (or its replacement) is healed into four.
    set_pace(pace, PACE_CUT_S)
    trio = {"a-w1", "d-w0", "d-w1"}
    t["cut"] = time.time()
    net.cut(h1)

    def cut_off(evs: list[Event]) -> bool:
        t0 = t["cut"]
        g = gens_with(evs, lambda m: m == trio, t0)
        lost = [e for e in of(evs, "coordinator_unreachable") if e["t"] > t0
                and e["proc"].startswith("b-")]  # fmt: skip
        return bool(lost) and all(len(commits(evs, m, g, t0)) >= 10 for m in trio)

    job.wait_for("the others to commit 10 steps without h1, and b-w0 to lose them", cut_off, 60)
    evs = job.poll()
    assert [e for e in of(evs, "member_removed", member="b-w0") if e["t"] > t["cut"]]
    set_pace(pace, PACE_WAIT_S)
    t["heal"] = time.time()
    net.heal(h1)

    def rejoined(evs: list[Event]) -> str | None:
        t0 = t["heal"]
        for h in of(evs, "heal_end", role="recv"):
            m = str(h["proc"])
            if h["t"] > t0 and m.startswith("b-"):
                four = {*trio, m}
                g = gens_with(evs, four.__eq__, t0)
                if h["gen"] in g and commits(evs, m, g, t0):
                    return m
        return None

    who = job.wait_for("h1's worker to rejoin, heal and train with the others", rejoined, 180)
    t["partition_healed"] = time.time()
    if who != "b-w0":
        print(f"b-w0 exited during the partition; its replacement {who} was healed")
    # What the test observed, for the record (pytest -s shows it).
    evs = job.poll()

    def first_commit(
        after: float, members: set[str], gen: Callable[[set[str]], bool] | None = None
    ) -> float:
        g = gens_with(evs, gen or members.__eq__, after)
        return min(e["t"] for m in members for e in commits(evs, m, g, after)) - after

    rejoin = min(e["t"] for e in of(evs, "heal_end", proc=who, role="recv") if e["t"] > t["heal"])
    took = {
        "kill_worker_to_survivor_commit": first_commit(t["kill_worker"], survivors, without_victim),
        "kill_node_to_survivor_commit": first_commit(t["kill_node"], pair),
        "cut_to_survivor_commit": first_commit(t["cut"], trio),
        "heal_to_rejoined": rejoin - t["heal"],
    }
    print("multinode recovery (s): " + json.dumps({k: round(v, 2) for k, v in took.items()}))
    # Bounds (generous for a busy machine). A killed worker is reported by its
    # agent at once; a dead node's workers are not (their agent died with them):
    # the coordinator drops them when their 5 s lease expires. A cut is seen by
    # the step watchdog (3 s floor). A reconnected worker registers again within
    # ~1 s (TCP retransmission) and is healed at the next step boundary.
    assert took["kill_worker_to_survivor_commit"] < 5, took
    assert took["kill_node_to_survivor_commit"] < 12, took
    assert took["cut_to_survivor_commit"] < 12, took
    assert who != "b-w0" or took["heal_to_rejoined"] < 15, took

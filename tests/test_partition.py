"""Multi-host on one machine: one host of three is partitioned, then reconnected.

The coordinator runs in its own network namespace, bound to its bridge
address (HTTP API and TCPStore); each of three workers runs in a namespace of
its own (a "host", `tests/netns.py`) and advertises that namespace's address
for its gloo group. The run directory is the hosts' shared file system.

After a few steps with all three, host h2's link goes down (silently: no RST,
no ICMP). The survivors must notice (step watchdog, or the coordinator's
lease), re-form without w2 and keep committing steps in their PIDs. Once they
have, the link comes back; the cut-off worker must register again, be healed
into a three-member generation and train to the end with them, never
diverging: identical state at every generation start, every sample of every
step consumed exactly once, identical final parameters. (Should it exit
instead, a replacement is started on the same host and must be healed.)

Everything is driven by conditions read from the events files, with deadlines.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from elastrain.data import GlobalOrder
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state

from . import netns
from .conftest import MLP, ROOT

B, SEED, DATASET = 32, 7, 4096
"""train_mlp.py's global batch, seed and dataset size (its data order)."""

COORD_PORT, STORE_PORT = 29400, 29401
"""Fixed: the coordinator's namespace is this test's alone (see start_coordinator)."""

STEPS = 300
MIN_STEP_S = 0.05
"""The job is paced to at most 20 steps/s (it makes 15-20 here), so the step
budget does not depend on the machine's speed: the cut lasts ~10.5 s, of
which ~7.5 s the survivors train, so the heal comes before step ~160 and
leaves >= 7 s for the cut-off worker to rejoin (it takes 0.1-1 s)."""

Event = dict[str, Any]


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


@pytest.fixture
def net() -> Iterator[netns.Network]:
    yield from netns.network(hosts=3)


class Run:
    """The job's processes and a polling view of its events."""

    def __init__(self, net: netns.Network, run_dir: Path) -> None:
        self.net = net
        self.run_dir = run_dir
        self.token = secrets.token_hex(16)
        self.base_env = dict(
            os.environ,
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            ELASTRAIN_TOKEN=self.token,
        )
        self.coordinator: subprocess.Popen[str] | None = None
        self.address = ""
        self.workers: dict[str, subprocess.Popen[bytes]] = {}
        self.spawned_at: dict[str, float] = {}

    def start_coordinator(self) -> None:
        """Start the coordinator in its namespace, bound to its bridge address.
        Its ports are fixed: nothing else can listen in a namespace made for
        this test, and the workers can start at the same time (they retry
        registering until it answers) instead of after its `import torch`."""
        c = self.net.coord
        self.address = f"{c.addr}:{COORD_PORT}"
        argv = [sys.executable, "-m", "elastrain.control.server", "--bind", self.address]
        argv += ["--store-port", str(STORE_PORT), "--run-dir", str(self.run_dir)]
        argv += ["--target", "3", "--min", "2"]
        with open(self.run_dir / "coordinator.log", "wb") as log:
            self.coordinator = self.net.run_in(
                c, argv, self.base_env, stdout=subprocess.PIPE, stderr=log, text=True
            )

    def coordinator_info(self) -> dict[str, Any]:
        """The line the coordinator prints once it listens (blocks until then)."""
        assert self.coordinator is not None and self.coordinator.stdout is not None
        line = self.coordinator.stdout.readline()
        assert line, f"coordinator did not start: {(self.run_dir / 'coordinator.log').read_text()}"
        info: dict[str, Any] = json.loads(line)
        return info

    def start_worker(self, member: str, host: netns.Host) -> subprocess.Popen[bytes]:
        env = dict(
            self.base_env,
            ELASTRAIN_COORDINATOR=self.address,
            ELASTRAIN_MEMBER_ID=member,
            ELASTRAIN_RUN_DIR=str(self.run_dir),
            ELASTRAIN_HOST=host.addr,
            ELASTRAIN_STEPS=str(STEPS),
        )
        with open(self.run_dir / f"{member}.log", "wb") as log:
            p = self.net.run_in(
                host,
                [sys.executable, "-m", "elastrain.worker", MLP, "--min-step-s", str(MIN_STEP_S)],
                env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.workers[member] = p
        self.spawned_at[member] = time.time()
        return p

    def events(self) -> list[Event]:
        return read_events(self.run_dir)

    def wait_for(
        self,
        what: str,
        cond: Callable[[list[Event]], Any],
        timeout_s: float,
        watch: list[str] | None = None,
    ) -> tuple[Any, list[Event]]:
        """Poll the events files until `cond(events)` is truthy; fail after `timeout_s`
        or as soon as a watched worker (default: all) exits with an error."""
        deadline = time.monotonic() + timeout_s
        while True:
            evs = self.events()
            got = cond(evs)
            if got:
                return got, evs
            for m, p in self.workers.items():
                if (watch is None or m in watch) and p.poll() not in (None, 0):
                    pytest.fail(f"{m} exited with {p.returncode} while waiting for {what}:\n"
                                + self.log(m)[-3000:])  # fmt: skip
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.2)  # polling files written by other processes

    def log(self, member: str) -> str:
        return (self.run_dir / f"{member}.log").read_text(errors="replace")


def of(evs: list[Event], kind: str, **match: Any) -> list[Event]:
    return [e for e in evs if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def test_partitioned_host_rejoins_and_heals_without_divergence(
    net: netns.Network, tmp_path: Path
) -> None:
    run = Run(net, tmp_path / "run")
    run.run_dir.mkdir()
    run.start_coordinator()
    hosts = dict(zip(("w0", "w1", "w2"), net.hosts, strict=True))
    for m, h in hosts.items():
        run.start_worker(m, h)
    info = run.coordinator_info()
    where = (info["host"], info["port"], info["store_port"])
    assert where == (net.coord.addr, COORD_PORT, STORE_PORT), info
    survivors, victim = ["w0", "w1"], "w2"
    pids = {m: p.pid for m, p in run.workers.items()}

    # 1. All three train together for a few steps (the watchdog has measurements).
    def trio_at_step_5(evs: list[Event]) -> bool:
        trio = {g["gen"] for g in of(evs, "generation_ready") if len(g["members"]) == 3}
        return all(any(e["gen"] in trio for e in of(evs, "step_commit", proc=m, step=5))
                   for m in hosts)  # fmt: skip

    _, evs = run.wait_for("three members to commit step 5", trio_at_step_5, 180)
    started = min(e["t"] for e in of(evs, "worker_start"))

    # 2. Cut h2 off. The survivors must re-form without w2 and keep committing;
    #    the cut lasts until w2 itself has found the coordinator unreachable
    #    (its heartbeat's 10 s timeout), so it knows it is cut off.
    t_cut = time.time()
    net.cut(hosts[victim])

    def pair_committed(evs: list[Event]) -> Event | None:
        pairs = {
            g["gen"]
            for g in of(evs, "generation_ready")
            if sorted(g["members"]) == survivors and g["t"] > t_cut
        }
        done = [[e for e in of(evs, "step_commit", proc=m) if e["gen"] in pairs] for m in survivors]
        lost = [e for e in of(evs, "coordinator_unreachable", proc=victim) if e["t"] > t_cut]
        if lost and all(len(d) >= 10 for d in done):
            return min((d[0] for d in done), key=lambda e: e["t"])
        return None

    first_pair_commit, evs = run.wait_for(
        "the survivors to commit without w2, and w2 to lose the coordinator", pair_committed, 60
    )
    removed = [e for e in of(evs, "member_removed", member=victim) if e["t"] > t_cut]
    assert removed, "the coordinator never dropped the cut-off member"
    # Detection is the step watchdog (3 s floor) or the coordinator's 5 s lease.
    resumed_s = first_pair_commit["t"] - t_cut
    assert resumed_s < 12, f"the survivors needed {resumed_s:.1f} s to commit without w2"

    # 3. Reconnect h2. Its worker registers again and is healed into a 3-member generation.
    t_heal = time.time()
    net.heal(hosts[victim])
    member = victim

    def rejoined(evs: list[Event]) -> Event | None:
        healed = [e for e in of(evs, "heal_end", proc=member, role="recv") if e["t"] > t_heal]
        if healed:
            return healed[0]
        if run.workers[member].poll() is not None and member == victim:
            # It gave up instead of rejoining: a replacement takes its place on h2.
            return {"replaced": run.workers[member].returncode}
        return None

    got, evs = run.wait_for("the cut-off worker to rejoin and heal", rejoined, 60, survivors)
    if "replaced" in got:
        print(f"{victim} exited with {got['replaced']} after the heal; starting w3 on h2")
        member = "w3"
        run.start_worker(member, hosts[victim])
        got, evs = run.wait_for("the replacement to join and heal", rejoined, 90)
    healed = got

    # 4. The job runs to the end with three members.
    for m, p in run.workers.items():
        try:
            rc = p.wait(timeout=180)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{m} did not finish:\n{run.log(m)[-3000:]}")
        if m != victim or member == victim:
            assert rc == 0, f"{m} exited with {rc}:\n{run.log(m)[-3000:]}"
    evs = run.events()

    # Survivors kept their processes and trained through the cut.
    for m in survivors:
        assert {e["pid"] for e in of(evs, "step_commit", proc=m)} == {pids[m]}, m
        during = [e for e in of(evs, "step_commit", proc=m) if t_cut < e["t"] < t_heal]
        assert len(during) >= 10, f"{m} committed {len(during)} steps during the cut"
        assert of(evs, "step_commit", proc=m, step=STEPS - 1), f"{m} did not reach the last step"

    # The cut-off worker registered again after the heal and was healed into a
    # generation of three, then committed steps in it in the same process.
    again = [e for e in of(evs, "member_registered", member=member) if e["t"] > t_heal]
    assert again, f"{member} never registered after the heal"
    trio = [
        g
        for g in of(evs, "generation_ready")
        if g["t"] > t_heal and sorted(g["members"]) == sorted([*survivors, member])
    ]
    assert trio, "no 3-member generation formed after the heal"
    assert healed["gen"] in {g["gen"] for g in trio}
    if member == victim:
        took = healed["t"] - t_heal
        assert took < 15, f"{victim} was healed {took:.1f} s after its link came back"
    assert of(evs, "step_commit", proc=member, gen=trio[0]["gen"]), member
    assert of(evs, "step_commit", proc=member, step=STEPS - 1), f"{member} did not finish"
    if member == victim:
        assert {e["pid"] for e in of(evs, "step_commit", proc=victim)} == {pids[victim]}

    # Never diverged: same state at every generation start, exactly-once data,
    # identical final parameters on all three.
    assert check_same_state(evs) == []
    led = check_exactly_once(evs, expected_ids)
    assert led.violations == [] and led.committed_steps == STEPS, led.violations
    finals = {f.stem: np.load(f) for f in sorted((run.run_dir / "final").glob("*.npy"))}
    assert sorted(finals) == sorted([*survivors, member])
    ref = finals[survivors[0]]
    for m, arr in finals.items():
        assert np.array_equal(ref, arr), f"{m}'s final parameters differ from {survivors[0]}'s"

    # What the cut-off worker saw (printed for the record; pytest -s shows it).
    v = [e for e in evs if e["proc"] == victim and t_cut < e["t"] < again[0]["t"]]
    first = {k: next((e["t"] - t_cut for e in v if e["kind"] == k), None) for k in (
        "watchdog_fired", "step_abort", "coordinator_unreachable", "step_commit")}  # fmt: skip
    print(
        "partition timings (s): "
        + json.dumps(
            {
                "startup": round(started - min(run.spawned_at.values()), 2),
                "cut_to_removed": round(removed[0]["t"] - t_cut, 2),
                "cut_to_survivor_commit": round(first_pair_commit["t"] - t_cut, 2),
                "cut_length": round(t_heal - t_cut, 2),
                "victim_after_cut": {
                    k: None if x is None else round(x, 2) for k, x in first.items()
                },
                "heal_to_registered": round(again[0]["t"] - t_heal, 2),
                "heal_to_trio_ready": round(trio[0]["t"] - t_heal, 2),
                "heal_to_healed": round(healed["t"] - t_heal, 2),
                "heal_bytes": healed["bytes"],
            }
        )
    )

"""Kill-to-next-commit across hosts (network namespaces, one `elastrain agent` per
host) against on one host (`elastrain run`), side by side in one run.

Run from the repository root, as root (it builds network namespaces; needs
iproute2's `ip`):

    .venv/bin/python benchmarks/multinode.py [--kills 4] [--settle 5] [--no-record]

Two copies of the same job are alive at once, each 4 workers of
tests/scripts/train_mlp.py (an MLP of 16 -> 256 -> 1, global batch 32,
micro-batch 4, one thread per process), `--min 2`, replacements started at
once (no delay):

- one host: `elastrain run -n 4` in the root namespace (coordinator and gloo
  over loopback);
- across hosts: `elastrain coordinator` in the coordinator namespace of
  `tests/netns.py` and two agents (`elastrain agent --nproc 2 --host ADDR`)
  in two host namespaces, linked through the coordinator namespace's bridge:
  every all-reduce, heal and coordinator call crosses a veth link.

The sides take turns, one SIGKILL per turn, `--kills` turns each (one host
first). In its turn a side runs at full speed (the other is paced to 2
steps/s by its pace file, so it barely loads the machine): once its four
members have committed `--settle` steps at full speed in one generation, this
script SIGKILLs one worker (the oldest on a host, the hosts in turn) and
records a `fault_injected` event first; the side then waits until its
survivors have committed in a generation without the victim and the
replacement (started by the launcher or by the victim's agent) has been healed
and committed, paced at 2 steps/s meanwhile so that the replacement's start-up
is not starved. No two recoveries or start-ups overlap.

From each side's events, `elastrain.observe.recovery.recoveries` gives the
time from each kill to the survivors' next commit and its phases, and `joins`
the replacements' timings. The step time is the median `step_s` of the
full-speed steps before each kill. Prints the tables and appends them with
date, machine, load and command as a record in benchmarks/results/ (unless --no-record).
Run directories: benchmarks/runs/multinode-<stamp>/ (git-ignored). Takes 4-6
minutes on a busy 2-core machine (most of it replacements importing torch).
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

from elastrain.observe.events import EventKind, EventLog, EventTail  # noqa: E402
from elastrain.observe.recovery import PHASES, format_recoveries, joins, recoveries  # noqa: E402
from tests import netns  # noqa: E402
from tests.test_multinode import Cluster, set_pace  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from _harness import Bench, Figure, fmt, log, med, table  # noqa: E402

MLP = ROOT / "tests" / "scripts" / "train_mlp.py"
WORKERS = 4
STEPS = 1_000_000
"""The jobs never end on their own: this script stops them when it is done."""
IDLE_PACE_S = 0.5

Event = dict[str, Any]


class Side:
    """One copy of the job: its pace file, its processes' events and this script's
    fault events, and how to stop it."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.base = base
        base.mkdir(parents=True)
        self.pace = base / "pace"
        set_pace(self.pace, IDLE_PACE_S)
        self.faults = EventLog(base / "bench", "bench")
        self.tails: list[EventTail] = [EventTail(base / "bench")]
        self.evs: list[Event] = []
        self.kill_times: list[float] = []
        self.fast_step_s: list[float] = []
        self.load: list[float] = []
        self.alive: Callable[[], bool] = lambda: True
        self.stop: Callable[[], None] = lambda: None

    def watch(self, run_dir: Path) -> None:
        self.tails.append(EventTail(run_dir))

    def poll(self) -> list[Event]:
        new = [e for t in self.tails for e in t.poll()]
        if new:
            self.evs = sorted([*self.evs, *new], key=lambda e: e["t"])
        return self.evs

    def wait(self, what: str, cond: Callable[[list[Event]], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            got = cond(self.poll())
            if got:
                return got
            if not self.alive():
                raise RuntimeError(f"{self.name}: the job ended while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: no {what} after {timeout_s:g} s")
            time.sleep(0.1)  # polling files other processes write


def of(evs: Sequence[Event], kind: str) -> list[Event]:
    return [e for e in evs if e["kind"] == kind]


def full_generation(evs: Sequence[Event]) -> Event | None:
    """The latest generation made ready, if it has all WORKERS members."""
    ready = of(evs, "generation_ready")
    return ready[-1] if ready and len(ready[-1]["members"]) == WORKERS else None


def one_turn(side: Side, k: int, settle: int) -> None:
    """Full speed; `settle` commits by all four; SIGKILL one; wait for the survivors'
    commit; paced wait for the replacement to be healed and commit."""
    set_pace(side.pace, 0.0)
    t_fast = time.time() + 1.0  # steps already under way may still be paced

    def settled(evs: list[Event]) -> Event | None:
        g = full_generation(evs)
        if g is None:
            return None
        mine = [e for e in of(evs, "step_commit") if e["gen"] == g["gen"] and e["t"] > t_fast]
        ok = all(sum(e["proc"] == m for e in mine) >= settle for m in g["members"])
        return g if ok else None

    g = side.wait(f"{settle} full-speed commits by {WORKERS} members", settled, 300)
    evs = side.poll()
    side.fast_step_s += [e["step_s"] for e in of(evs, "step_commit")
                         if e["gen"] == g["gen"] and e["t"] > t_fast]  # fmt: skip
    # Alternate hosts (member ids are HOST-wN across hosts, wN on one host); on the
    # chosen host, the oldest worker.
    by_host: dict[str, list[str]] = {}
    for m in sorted(g["members"], key=lambda m: int(m.rsplit("w", 1)[1])):
        by_host.setdefault(m.rsplit("-", 1)[0] if "-" in m else "", []).append(m)
    hosts = sorted(by_host)
    victim = by_host[hosts[k % len(hosts)]][0]
    pid = [e for e in of(evs, "worker_spawned") if e["member"] == victim][-1]["pid"]
    step = max(e["step"] for e in of(evs, "step_commit"))
    t0 = time.time()
    side.faults.emit(EventKind.FAULT_INJECTED, fault="kill", member=victim, pid=pid, step=step)
    os.kill(pid, signal.SIGKILL)
    side.kill_times.append(t0)
    survivors = set(g["members"]) - {victim}

    def resumed(evs: list[Event]) -> bool:
        gens = {x["gen"] for x in of(evs, "generation_ready")
                if x["t"] > t0 and victim not in x["members"]}  # fmt: skip
        return any(e["gen"] in gens and e["proc"] in survivors for e in of(evs, "step_commit"))

    side.wait(f"the survivors of {victim} to commit", resumed, 60)
    set_pace(side.pace, IDLE_PACE_S)

    def healed(evs: list[Event]) -> bool:
        new = [e["member"] for e in of(evs, "worker_spawned") if e["t"] > t0 and e["replacement"]]
        if not new:
            return False
        heals = [e for e in of(evs, "heal_end") if e["proc"] == new[0] and e.get("role") == "recv"]
        g2 = full_generation(evs)
        return (
            bool(heals)
            and g2 is not None
            and new[0] in g2["members"]
            and any(e["proc"] == new[0] and e["gen"] == g2["gen"] for e in of(evs, "step_commit"))
        )

    side.wait(f"{victim}'s replacement to heal and commit", healed, 300)


def start_one_host(side: Side, env: dict[str, str]) -> subprocess.Popen[bytes]:
    run_dir = side.base / "run"
    argv = [sys.executable, "-m", "elastrain.cli", "run", "-n", str(WORKERS), "--min", "2",
            "--plain", "--steps", str(STEPS), "--run-dir", str(run_dir), str(MLP),
            "--pace-file", str(side.pace)]  # fmt: skip
    with open(side.base / "launcher.log", "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    side.watch(run_dir)
    side.alive = lambda: proc.poll() is None

    def stop() -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # the launcher stops its workers and coordinator
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for e in of(side.poll(), "worker_spawned"):
            try:
                os.kill(e["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass

    side.stop = stop
    return proc


def start_across_hosts(side: Side, net: netns.Network) -> Cluster:
    job = Cluster(net, side.base / "job", target=WORKERS, min_members=2, steps=STEPS,
                  script_args=["--pace-file", str(side.pace)])  # fmt: skip
    job.start_coordinator()
    for i, h in enumerate(net.hosts):
        job.start_agent(f"h{i}", h, WORKERS // len(net.hosts))
    job.coordinator_info()
    for d in [job.base / "coord", *job.agent_dirs.values()]:
        side.watch(d)
    side.alive = lambda: all(p.poll() is None for p in job.agents.values())

    def stop() -> None:
        for p in job.agents.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # drain: the node's workers leave
        for p in job.agents.values():
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()  # its workers die with it
                p.wait()
        job.kill_workers()

    side.stop = stop
    return job


def main() -> int:
    bench = Bench("multinode.py", __doc__, paths=("elastrain", "benchmarks", "tests"))
    ap = bench.ap
    ap.add_argument("--kills", type=int, default=4, help="SIGKILLs per side (4)")
    ap.add_argument("--settle", type=int, default=5, help="full-speed commits before a kill (5)")
    ap.add_argument("--hosts", type=int, default=2, choices=(2, 4), help="namespaces (2)")
    args = bench.parse()
    why = netns.missing_requirement()
    if why:
        print(f"benchmarks/multinode.py: {why}", file=sys.stderr)
        return 2
    t_wall0 = time.time()
    load = bench.load
    assert load is not None
    cores = os.cpu_count() or 0
    base = bench.run_dir("multinode")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log(f"load average now {os.getloadavg()[0]:.1f} on {cores} cores; run dirs under {base}")

    one = Side("one host", base / "one-host")
    across = Side(f"across {args.hosts} hosts", base / "across-hosts")
    sides = [one, across]
    with netns.Network(hosts=args.hosts) as net:
        try:
            start_one_host(one, env)
            start_across_hosts(across, net)
            log(f"both jobs started ({WORKERS} workers each); waiting for them to train")
            for s in sides:
                s.wait(f"a generation of {WORKERS}", lambda evs: full_generation(evs), 300)
            t_kills0 = time.time()
            for k in range(args.kills):
                for s in sides:
                    t = time.time()
                    one_turn(s, k, args.settle)
                    s.load.append(load.mean(t, time.time()))
                    r = recoveries(s.poll())[-1]
                    log(f"{s.name}: kill {k + 1}/{args.kills} of {r.member}: survivors' next "
                        f"commit after {fmt(r.total_s)} s; replacement healed "
                        f"({time.time() - t:.0f} s turn)")  # fmt: skip
            t_kills1 = time.time()
        finally:
            for s in sides:
                s.stop()

    # ---- analysis ------------------------------------------------------------------------
    rows, phase_rows, join_rows, details, figures = [], [], [], [], []
    for s in sides:
        evs = s.poll()
        recs = [r for r in recoveries(evs) if r.fault == "kill"]
        tot = [r.total_s for r in recs if r.total_s is not None]
        js = [j for j in joins(evs) if j.healed_s is not None]
        rows.append([s.name, str(len(recs)), fmt(med(tot)), fmt(min(tot, default=math.nan)),
                     fmt(max(tot, default=math.nan)), fmt(med(s.fast_step_s) * 1000, 1),
                     fmt(statistics.fmean(s.load) if s.load else math.nan, 1)])  # fmt: skip
        phase_rows.append([s.name, *[fmt(med([r.phase(p) for r in recs if not math.isnan(r.phase(p))])) for p in PHASES]])  # fmt: skip
        join_rows.append([s.name, str(len(js)), fmt(med([j.registered_s or math.nan for j in js]), 2),
                          fmt(med([j.healed_s or math.nan for j in js]), 2),
                          fmt(med([j.first_step_s or math.nan for j in js]), 2),
                          fmt(med([j.heal_bytes / 1e3 for j in js]), 1)])  # fmt: skip
        figures.append(
            Figure(
                f"kill_to_next_commit_s[{s.name}]",
                f"kill -> survivors' next commit, {s.name}, median",
                med(tot),
                "s",
            )
        )
        origin = min((e["t"] for e in evs), default=None)
        details.append(f"{s.name}:\n{format_recoveries(recs, origin)}")
    t1 = table(["kill -> survivors' next commit (s)", "kills", "median", "min", "max",
                "step time, median ms", "load avg (1 min) in its turns"], rows)  # fmt: skip
    t2 = table(["recovery phases, median (s)", *PHASES], phase_rows)
    t3 = table(["replacement (s from its spawn)", "joins", "registered", "healed",
                "first step", "heal KB"], join_rows)  # fmt: skip
    notes = [
        f"same job on both sides: tests/scripts/train_mlp.py, {WORKERS} workers, --min 2, "
        "replacements at once; global batch 32, micro-batch 4, 1 thread per process",
        f"one host: `elastrain run` in the root namespace (loopback). Across hosts: "
        f"`elastrain coordinator` in a namespace of its own and {args.hosts} agents "
        f"(--nproc {WORKERS // args.hosts}) in host namespaces linked by veth pairs to a "
        "bridge (tests/netns.py)",
        f"{args.kills} SIGKILLs per side, taking turns (one host first); a side runs at full "
        f"speed in its turn ({args.settle} settle steps before the kill) and is paced to "
        f"{1 / IDLE_PACE_S:g} steps/s otherwise; victims alternate hosts "
        "(the oldest worker on the host); no two recoveries or start-ups overlap",
        f"machine load (1-min load average, {cores} cores): "
        f"{load.mean(t_wall0, time.time()):.1f} mean over the benchmark, "
        f"{load.mean(t_kills0, t_kills1):.1f} during the kills",
        f"run dirs {base.relative_to(ROOT) if base.is_relative_to(ROOT) else base}",
    ]
    text = "\n\n".join([t1, t2, t3])
    print()
    print(text)
    print()
    for d in details:
        print(d + "\n")
    bench.finish(
        "",
        [f for f in figures if not math.isnan(f.value)],
        [],
        notes,
        [t1, "", t2, "", t3, "", "Per kill (seconds; t0 from the side's first event):", "",
         "```", *details, "```"],
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Side by side: elastrain against torchrun restarts and torchft, on the same job (issue 6).

Run from the repository root (about 15 minutes on the busy 2-core dev machine):

    .venv/bin/python benchmarks/versus.py            # 3 repeats of every case, records
    .venv/bin/python benchmarks/versus.py --quick    # smoke run: 1 repeat, marked as such

torchft is optional. Install it beside torch without letting pip touch torch:

    .venv/bin/pip install --no-deps torchft
    .venv/bin/pip install opentelemetry-api opentelemetry-sdk opentelemetry-exporter-otlp-proto-http
    .venv/bin/python -c "import torch; print(torch.__version__)"   # must be unchanged

(or `pip install -e .[bench]` then the same torch check). Without it the
torchft rows say "not run: torchft is not installed" and the rest runs.

The job, identical everywhere: the demo's GPT (`elastrain demo`'s size: dim 128,
2 layers, 4 heads, context 64, byte vocabulary) on the Python stdlib's source,
AdamW, global batch 32 in micro-batches of 4, 4 workers, one thread each,
elastrain's seeded global sample order (step s takes positions [32s, 32s+32)).

The cases (each repeated --repeats times, interleaved so that the shared
machine's load drifts over all of them alike):

- elastrain: `Launcher` (what `elastrain run` runs) with the faults below,
  replacement after --replace-delay seconds.
- torchrun: `torch.distributed.run --standalone --max-restarts 5
  --monitor-interval 0.1`, DDP on gloo, checkpoint every --ckpt-every steps
  (rank 0, atomic rename) and resume on start, one store prefix per restart
  round; the killed rank's restarted process waits the replacement delay.
- torchft: its own `DistributedDataParallel` wrapper ("ddp") and its manager
  with one flat all-reduce ("flat"), with the lighthouse's heartbeat timeout at
  its default (5 s, gloo collective timeout 5 s as in torchft's train_ddp.py
  example) and at 1 s (collective timeout 1 s too: with 4 replicas a survivor
  that is not the dead one's ring neighbour waits out the collective timeout, so
  a 1 s heartbeat alone does not shorten the stall). Rows: ddp 5 s, flat 5 s,
  flat 1 s; `--cases all` adds ddp 1 s (left out by default to fit in 15
  minutes). One replica group of one process per worker, set up like torchft's
  example; a replica that dies is restarted after the replacement delay and
  heals from a peer.

The fault schedule, the same for all: SIGKILL of worker 1 once --kill-at steps
are committed, SIGSTOP of worker 2 once --hang-at steps are committed and
SIGCONT --hang-s seconds later; each signal lands a seeded fraction (0.2-0.8,
the same draws for every case of a repeat) of a step time after the step
boundary, as elastrain's own fault schedule does. One failure-free run of the
job (plain DDP under torchrun) gives the loss curve every run is compared with
(the systems agree with it to ~1e-7 before their first fault, which is checked).

A run goes on until step --steps is committed, and past it until the
replacement has trained (at most 40 s after the kill). Measured, per run, from
the systems' own logs (elastrain's events; JSON lines written by the torchrun
and torchft jobs; the arithmetic is in _versus/analysis.py and tested in
tests/test_versus.py; definitions in docs/versus.md): step time before the
first fault, kill and hang -> next commit on survivors, torchrun's time back to
the step it had reached, time until the replacement trains, steps recomputed,
samples dropped, wall time to step --steps, goodput against the failure-free
run, the loss curve's largest deviation from the failure-free run's, and
whether the run survived. Prints min / median / max over the repeats, checks
the acceptance targets, and appends everything to benchmarks/RESULTS.md with
date, machine, load and command (unless --no-record).

Run directories: benchmarks/runs/versus-<stamp>/ (git-ignored). Every process
the benchmark starts is stopped by PID when it ends, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.util
import json
import math
import os
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = HERE / "_jobs"
VERSUS = HERE / "_versus"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(JOBS))
sys.path.insert(0, str(VERSUS))

from analysis import (  # noqa: E402
    Commit,
    FaultMark,
    Plan,
    back_to_reached,
    commits_from_steplog,
    compare_runs,
    first_commit_of,
    from_elastrain,
    global_loss_curve,
    goodput,
    max_rel_dev,
    next_lineage_commit,
    next_progress_commit,
    read_steplogs,
    recomputed_steps,
    samples_dropped,
    short_steps,
    span,
    step_time_s,
    step_times,
)
from common import Shape  # noqa: E402

from elastrain.chaos.schedule import parse_fault  # noqa: E402
from elastrain.launch.launcher import LaunchConfig, Launcher, RunResult  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402
from elastrain.observe.ledger import check_exactly_once  # noqa: E402
from elastrain.observe.recovery import joins, recoveries  # noqa: E402

WORKERS = 4
SHAPE = Shape(dim=128, layers=2, heads=4, block=64, global_batch=32, micro_batch=4)
"""The demo's GPT and batch (elastrain/demo/gpt.py defaults)."""
KILL_VICTIM = 1
HANG_VICTIM = 2
REPLACEMENT_CAP_S = 40.0
"""A run waits at most this long after the kill for the replacement to train."""
RUN_TIMEOUT_S = 150.0
"""A run that has not finished by then did not survive."""
SAME_MATH_TOL = 1e-4
"""Largest relative loss deviation from the failure-free run still called the same math
(float rounding of a different reduction order; a dropped sample changes the loss by more)."""
TARGET_ABS_S = 0.5
TARGET_FACTOR = 5.0
HEARTBEATS_MS = (5000, 1000)

FT_INSTALL = (
    "pip install --no-deps torchft && pip install opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http"
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def shape_args() -> list[str]:
    s = SHAPE
    return [
        "--dim", str(s.dim), "--layers", str(s.layers), "--heads", str(s.heads),
        "--block", str(s.block), "--batch", str(s.global_batch), "--micro", str(s.micro_batch),
    ]  # fmt: skip


def child_env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [e.get("PYTHONPATH")])])
    e.setdefault("OMP_NUM_THREADS", "1")
    return e


# ---- process bookkeeping -----------------------------------------------------------------


def children_of(pid: int) -> list[int]:
    """PIDs whose parent is `pid` (Linux /proc), recursively."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        for c in kids.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Procs:
    """Every process this benchmark started (directly or through torchrun), stopped by
    PID: SIGCONT (a stopped process cannot die of anything else first), then SIGKILL."""

    def __init__(self) -> None:
        self.popens: list[subprocess.Popen[bytes]] = []
        self.pids: set[int] = set()

    def start(self, cmd: list[str], logf: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        with open(logf, "ab") as f:
            p = subprocess.Popen(
                cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.popens.append(p)
        return p

    def note(self, pid: int) -> None:
        self.pids.add(pid)

    def stop(self, p: subprocess.Popen[bytes] | None = None) -> None:
        targets = [p] if p is not None else list(self.popens)
        pids: list[int] = []
        for q in targets:
            if q.poll() is None:
                pids += [*children_of(q.pid), q.pid]
        if p is None:
            pids += [x for x in self.pids if alive(x)]
        for pid in pids:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)
        for q in targets:
            with contextlib.suppress(subprocess.TimeoutExpired):
                q.wait(timeout=5)
        if p is None:
            self.popens = [q for q in self.popens if q.poll() is None]
            self.pids = {x for x in self.pids if alive(x)}


PROCS = Procs()


class Tail:
    """New JSON records from the JSON-lines files matching a glob (incremental)."""

    def __init__(self, d: Path, pattern: str) -> None:
        self.d, self.pattern = d, pattern
        self.off: dict[Path, int] = {}
        self.buf: dict[Path, str] = {}

    def poll(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for p in sorted(self.d.glob(self.pattern)):
            try:
                with open(p) as f:
                    f.seek(self.off.get(p, 0))
                    chunk = f.read()
                    self.off[p] = f.tell()
            except OSError:
                continue
            text = self.buf.get(p, "") + chunk
            lines = text.split("\n")
            self.buf[p] = lines.pop()
            for line in lines:
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line))
        return out


# ---- one run -----------------------------------------------------------------------------


@dataclass
class Run:
    case: str
    rep: int
    faulty: bool
    run_dir: Path
    commits: list[Commit] = field(default_factory=list)
    faults: list[FaultMark] = field(default_factory=list)
    t_launch: float = math.nan
    survived: bool = True
    why: str = ""
    t_crash: float | None = None
    """When a run that did not survive lost its state (its figures use commits before it)."""
    survivors_lost: int = 0
    kill_s: float | None = None
    hang_s: float | None = None
    back_s: float | None = None
    repl_s: float | None = None
    recomputed: int = 0
    dropped: int = 0
    dropped_to_s: int = 0
    short: int = 0
    exactly_once: str = ""
    notes: list[str] = field(default_factory=list)

    def commit_t(self, step: int) -> float | None:
        return step_times(self.commits).get(step)


class Injector:
    """Fires a Plan's kill and hang for the torchrun and torchft runs from the commit
    records as they arrive: once `at` steps are committed, wait the drawn offset, send
    the signal. `pid_of(victim)` gives the victim's current PID."""

    def __init__(
        self, plan: Plan, pid_of: Callable[[int], int | None], name: Callable[[int], str]
    ) -> None:
        self.plan = plan
        self.pid_of, self.name = pid_of, name
        self.draw = plan.offsets()
        todo: list[tuple[int, str, int]] = []
        if plan.kill_at is not None:
            todo.append((plan.kill_at, "kill", KILL_VICTIM))
        if plan.hang_at is not None:
            todo.append((plan.hang_at, "hang", HANG_VICTIM))
        self.todo = sorted(todo)
        self.due: float | None = None
        self.marks: list[FaultMark] = []
        self.resume: tuple[float, int] | None = None
        self.on_kill: Callable[[int, int], None] | None = None

    def tick(self, committed: int, step_s: float, now: float) -> None:
        if self.resume is not None and now >= self.resume[0]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.resume[1], signal.SIGCONT)
            self.resume = None
        if not self.todo or committed < self.todo[0][0]:
            return
        if self.due is None:
            self.due = now + self.draw(step_s if step_s > 0 else 0.2)
        if now < self.due:
            return
        at, kind, victim = self.todo.pop(0)
        self.due = None
        pid = self.pid_of(victim)
        if pid is None:
            return
        t = time.time()
        if kind == "kill" and self.on_kill is not None:
            self.on_kill(victim, pid)
        os.kill(pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        self.marks.append(FaultMark(kind, t, self.name(victim), pid, committed))
        if kind == "hang":
            self.resume = (now + self.plan.hang_s, pid)

    @property
    def pending(self) -> bool:
        return bool(self.todo) or self.resume is not None


def recent_step_s(commit_t: dict[int, float]) -> float:
    ks = sorted(commit_t)[-11:]
    d = [commit_t[b] - commit_t[a] for a, b in zip(ks, ks[1:], strict=False) if b == a + 1]
    return sorted(d)[len(d) // 2] if d else 0.2


def run_elastrain(plan: Plan, run: Run) -> None:
    faults = []
    if plan.kill_at is not None:
        faults.append(parse_fault(f"kill@{plan.kill_at}:w{KILL_VICTIM}"))
    if plan.hang_at is not None:
        faults.append(parse_fault(f"hang@{plan.hang_at}:w{HANG_VICTIM}/{plan.hang_s:g}"))
    cfg = LaunchConfig(
        script=str(JOBS / "elastic_gpt.py"),
        script_args=shape_args(),
        workers=WORKERS,
        min_workers=2,
        replace_delay_s=plan.replace_delay_s,
        run_dir=str(run.run_dir),
        steps=plan.steps if not run.faulty else 1_000_000,
        faults=faults,
        seed=plan.seed,
        progress=False,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
    originals = {f"w{i}" for i in range(WORKERS)}
    state: dict[str, Any] = {"repl_step": None, "stalled_since": time.monotonic(), "last": -1}

    def on_status(st: dict[str, Any]) -> None:
        step = int(st.get("step", 0))
        now = time.monotonic()
        if step != state["last"]:
            state["last"], state["stalled_since"] = step, now
        kills = [f for f in launcher.fault_log if f["fault"] == "kill"]
        if kills and "kill_t" not in state:
            state["kill_t"] = time.time()
        members = st.get("members") or []
        new = any(m not in originals for m in members)
        if kills and state["repl_step"] is None and st.get("ready") and new:
            state["repl_step"] = step
        if not run.faulty or step < plan.steps:
            return
        if len(launcher.fault_log) < len(faults):
            return
        repl_ok = state["repl_step"] is not None and step >= state["repl_step"] + 2
        late = kills and time.time() - state["kill_t"] > REPLACEMENT_CAP_S
        if repl_ok or late or not kills:
            state["done"] = True
            launcher.stop()

    launcher = Launcher(cfg, on_status=on_status)

    def on_timeout() -> None:
        state["timeout"] = True
        launcher.stop()

    timer = threading.Timer(RUN_TIMEOUT_S, on_timeout)
    timer.daemon = True
    timer.start()
    out: dict[str, RunResult] = {}
    # Off the main thread, so that the launcher leaves SIGTERM to the benchmark.
    th = threading.Thread(target=lambda: out.update(r=launcher.run()), name="launcher")
    th.start()
    try:
        while th.is_alive():
            th.join(0.2)
    except KeyboardInterrupt:
        launcher.stop()
        th.join(30)
        raise
    finally:
        timer.cancel()
        for pids in launcher.pids.values():
            for pid in pids:
                if alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGCONT)
                        os.kill(pid, signal.SIGKILL)
    result = out.get("r")
    events = read_events(run.run_dir)
    run.commits, run.faults = from_elastrain(events, SHAPE.global_batch)
    run.t_launch = next((e["t"] for e in events if e["kind"] == "job_start"), math.nan)
    if state.get("timeout"):
        run.survived, run.why = False, f"no end within {RUN_TIMEOUT_S:.0f} s"
    elif result is None:
        run.survived, run.why = False, "the launcher raised (see the log above)"
    elif result.status not in ("done", "interrupted"):
        run.survived, run.why = False, f"job {result.status}: {result.message}"
    if run.faulty:
        recs = recoveries(events)
        js = {j.member: j for j in joins(events)}
        for r in recs:
            if r.fault == "kill":
                run.kill_s = r.total_s
                j = js.get(r.replacement or "")
                if j is not None and j.first_step_s is not None:
                    run.repl_s = j.spawned_t + j.first_step_s - r.t0
            elif r.fault == "hang":
                run.hang_s = r.total_s
        run.back_s = run.kill_s
    from elastrain.data import GlobalOrder
    from elastrain.demo.gpt import ByteBlocks, stdlib_corpus

    order = GlobalOrder(len(ByteBlocks(stdlib_corpus(), SHAPE.block)), SHAPE.seed, shuffle=True)
    B = SHAPE.global_batch
    rep = check_exactly_once(events, lambda s: order.ids(s * B, (s + 1) * B))
    run.recomputed = sum(1 for v in rep.violations if " was committed in " in v)
    run.exactly_once = "yes" if rep.ok else f"NO ({len(rep.violations)} violations)"
    for v in rep.violations[:3]:
        run.notes.append(f"exactly-once: {v}")


def run_torchrun(plan: Plan, run: Run, ckpt_every: int) -> None:
    d = run.run_dir
    d.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(WORKERS), "--max-restarts", "5", "--monitor-interval", "0.1",
        str(VERSUS / "torchrun_gpt.py"), "--out", str(d), "--steps", str(plan.steps),
        "--ckpt-every", str(ckpt_every), *shape_args(),
    ]  # fmt: skip
    run.t_launch = time.time()
    agent = PROCS.start(cmd, d / "torchrun.log", child_env())
    tail = Tail(d, "r*.jsonl")
    recs: list[dict[str, Any]] = []
    pid_of_rank: dict[int, tuple[int, int]] = {}  # rank -> (attempt, pid)
    commit_t: dict[int, float] = {}

    def pid_of(rank: int) -> int | None:
        x = pid_of_rank.get(rank)
        return x[1] if x else None

    def on_kill(rank: int, pid: int) -> None:
        attempt = max(a for a, _ in pid_of_rank.values())
        (d / "replace.json").write_text(
            json.dumps({"attempt": attempt + 1, "rank": rank, "delay_s": plan.replace_delay_s})
        )

    inj = Injector(plan, pid_of, lambda r: f"r{r}")
    inj.on_kill = on_kill
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while True:
            for r in tail.poll():
                recs.append(r)
                rank = int(str(r.get("proc", "r0"))[1:])
                if r.get("kind") == "start":
                    PROCS.note(int(r["pid"]))
                    a = int(r.get("attempt", 0))
                    if rank not in pid_of_rank or pid_of_rank[rank][0] <= a:
                        pid_of_rank[rank] = (a, int(r["pid"]))
                elif r.get("kind") == "commit":
                    commit_t.setdefault(int(r["step"]), float(r["t"]))
            committed = max(commit_t) + 1 if commit_t else 0
            inj.tick(committed, recent_step_s(commit_t), time.monotonic())
            last = sum(
                1 for r in recs if r.get("kind") == "commit" and r.get("step") == plan.steps - 1
            )
            if last >= WORKERS and not inj.pending:
                break
            rc = agent.poll()
            if rc is not None:
                recs += tail.poll()
                if rc != 0:
                    run.survived, run.why = False, f"torchrun exited {rc} (see {d}/torchrun.log)"
                    run.t_crash = time.time()
                break
            if time.monotonic() > deadline:
                run.survived, run.why = False, f"no end within {RUN_TIMEOUT_S:.0f} s"
                break
            time.sleep(0.02)
    finally:
        PROCS.stop(agent)
        PROCS.stop()
    recs = read_steplogs(sorted(d.glob("r*.jsonl")))
    run.commits = commits_from_steplog(recs, "attempt", WORKERS)
    run.faults = inj.marks
    if run.survived and run.commit_t(plan.steps - 1) is None:
        run.survived, run.why = False, "did not reach the last step"
    for f in run.faults:
        if f.kind == "kill":
            run.kill_s = next_lineage_commit(run.commits, f)
            run.back_s = back_to_reached(run.commits, f)
            t = first_commit_of(run.commits, f.victim, f.t, f.pid, participating=False)
            run.repl_s = t - f.t if t is not None else None
        else:
            run.hang_s = next_progress_commit(run.commits, f)
    run.recomputed = recomputed_steps(run.commits)
    attempts = {int(r.get("attempt", 0)) for r in recs if r.get("kind") == "start"}
    run.notes.append(f"restart rounds: {max(attempts, default=0)}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_torchft(plan: Plan, run: Run, mode: str, heartbeat_ms: int, pg_timeout_s: float) -> None:
    import torch.distributed as dist

    d = run.run_dir
    d.mkdir(parents=True, exist_ok=True)
    lh_port = free_port()
    lighthouse = str(Path(sys.executable).parent / "torchft_lighthouse")
    run.t_launch = time.time()
    lh = PROCS.start(
        [lighthouse, "--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms",
         "10000", "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"127.0.0.1:{lh_port}"],
        d / "lighthouse.log", child_env(),
    )  # fmt: skip
    gate = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = child_env()
    env["TORCHFT_LIGHTHOUSE"] = f"http://127.0.0.1:{lh_port}"
    procs: dict[int, subprocess.Popen[bytes]] = {}
    killed: set[int] = set()
    respawn: list[tuple[float, int]] = []
    lost = 0

    def spawn(g: int, join: bool) -> None:
        cmd = [
            sys.executable, str(VERSUS / "torchft_gpt.py"), "--out", str(d), "--group", str(g),
            "--groups", str(WORKERS), "--mode", mode, "--gate", f"127.0.0.1:{gate.port}",
            "--pg-timeout", f"{pg_timeout_s:g}", *shape_args(), *(["--join"] if join else []),
        ]  # fmt: skip
        procs[g] = PROCS.start(cmd, d / f"g{g}.log", env)

    def on_kill(g: int, pid: int) -> None:
        killed.add(pid)

    inj = Injector(plan, lambda g: procs[g].pid if g in procs else None, lambda g: f"g{g}")
    inj.on_kill = on_kill
    tail = Tail(d, "g*.jsonl")
    commit_t: dict[int, float] = {}
    max_step = -1
    first_death: float | None = None
    has_state: set[int] = set()  # PIDs that committed a step (they hold the model's state)
    last_logged: set[int] = set()  # PIDs that logged the last step, taking part in it
    last_expect = 0
    deadline = time.monotonic() + RUN_TIMEOUT_S
    kill_t: float | None = None
    try:
        for g in range(WORKERS):
            spawn(g, join=False)
        while True:
            now = time.monotonic()
            for r in tail.poll():
                if r.get("kind") != "commit":
                    continue
                s = int(r["step"])
                if s < max_step - 2:
                    run.survived = False
                    run.why = (
                        f"state lost: training restarted at step {s} after reaching {max_step}"
                    )
                max_step = max(max_step, s)
                commit_t.setdefault(s, float(r["t"]))
                has_state.add(int(r["pid"]))
                if s == plan.steps - 1 and r.get("participating"):
                    last_logged.add(int(r["pid"]))
                    last_expect = max(last_expect, int(r.get("participants", WORKERS)))
                if (
                    kill_t is not None and r.get("proc") == f"g{KILL_VICTIM}"
                    and int(r["pid"]) not in killed and r.get("participating")
                    and float(r["t"]) > kill_t
                ):  # fmt: skip
                    run.notes.append("replacement trained")
                    kill_t = math.inf
            if not run.survived:
                break
            committed = max(commit_t) + 1 if commit_t else 0
            n_kills = sum(1 for f in inj.marks if f.kind == "kill")
            inj.tick(committed, recent_step_s(commit_t), now)
            if kill_t is None and sum(1 for f in inj.marks if f.kind == "kill") > n_kills:
                kill_t = inj.marks[-1].t
                respawn.append((now + plan.replace_delay_s, KILL_VICTIM))
            for g, p in list(procs.items()):
                rc = p.poll()
                if rc is None or p.pid in killed or any(x[1] == g for x in respawn):
                    continue
                lost += 1
                first_death = first_death if first_death is not None else time.time()
                run.notes.append(f"survivor g{g} (pid {p.pid}) died with exit code {rc}")
                respawn.append((now + plan.replace_delay_s, g))
            for item in [x for x in respawn if x[0] <= now]:
                respawn.remove(item)
                spawn(item[1], join=True)
            if max_step >= 0 and not any(
                p.poll() is None and p.pid in has_state for p in procs.values()
            ):
                run.survived, run.why = False, "every replica holding the state died: state lost"
                run.t_crash = first_death
                break
            repl_done = kill_t is None or kill_t == math.inf
            too_late = kill_t not in (None, math.inf) and time.time() - kill_t > REPLACEMENT_CAP_S
            s_last = commit_t.get(plan.steps - 1)
            logged = s_last is not None and (
                len(last_logged) >= last_expect or time.time() - s_last > 2.0
            )
            if logged and not inj.pending and (repl_done or too_late):
                break
            if time.monotonic() > deadline:
                run.survived, run.why = False, f"no end within {RUN_TIMEOUT_S:.0f} s"
                break
            time.sleep(0.02)
    finally:
        for p in procs.values():
            PROCS.stop(p)
        PROCS.stop(lh)
        PROCS.stop()
    recs = read_steplogs(sorted(d.glob("g*.jsonl")))
    run.commits = commits_from_steplog(recs, "quorum", WORKERS)
    if run.t_crash is not None:
        run.commits = [c for c in run.commits if c.t < run.t_crash]
    run.faults = inj.marks
    run.survivors_lost = lost
    if run.survived and run.commit_t(plan.steps - 1) is None:
        run.survived, run.why = False, "did not reach the last step"
    for f in run.faults:
        if f.kind == "kill":
            run.kill_s = next_lineage_commit(run.commits, f)
            run.back_s = run.kill_s
            t = first_commit_of(run.commits, f.victim, f.t, f.pid, participating=True)
            run.repl_s = t - f.t if t is not None else None
        else:
            run.hang_s = next_lineage_commit(run.commits, f)
    run.recomputed = recomputed_steps(run.commits)
    aborts = sum(1 for r in recs if r.get("kind") == "abort")
    run.notes.append(f"uncommitted step attempts: {aborts}")


# ---- the benchmark -----------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    system: str  # elastrain | torchrun | torchft
    mode: str = ""
    heartbeat_ms: int = 0
    pg_timeout_s: float = 5.0
    default: bool = True


CASES = [
    Case("elastrain", "elastrain"),
    Case("torchrun restart", "torchrun"),
    Case("torchft ddp, hb 5 s", "torchft", "ddp", 5000, 5.0),
    Case("torchft ddp, hb 1 s", "torchft", "ddp", 1000, 1.0, default=False),
    Case("torchft flat, hb 5 s", "torchft", "flat", 5000, 5.0),
    Case("torchft flat, hb 1 s", "torchft", "flat", 1000, 1.0),
]
"""hb: the lighthouse's heartbeat timeout (5 s is its default); the gloo collective timeout
goes with it (5 s as in torchft's train_ddp.py example; 1 s in the "1 s" rows, since with
4 replicas a survivor that is not next to the dead one in the ring waits out the
collective timeout, so a 1 s heartbeat alone does not shorten the stall).
torchft's DDP wrapper at a 1 s heartbeat is left out by default (`--cases all` runs
it): the heartbeat's effect shows on the flat rows, and 3 repeats of 6 cases do not fit
in 15 minutes on the 2-core machine."""
REFERENCE = Case("failure-free reference (plain DDP, torchrun)", "torchrun")
"""The failure-free run every loss curve is compared with: the same job under plain
DDP, no faults. The systems agree with it to float rounding (checked on the steps
before the first fault of every run; ~1e-7 over 60 steps on the dev machine)."""


def execute(case: Case, plan: Plan, run: Run, ckpt_every: int) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    if case.system == "elastrain":
        run_elastrain(plan, run)
    elif case.system == "torchrun":
        run_torchrun(plan, run, ckpt_every)
    else:
        run_torchft(plan, run, case.mode, case.heartbeat_ms, case.pg_timeout_s)


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").replace("--", "-")


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def cell(xs: Sequence[float | None], nd: int = 2, unit: str = "") -> str:
    lo, med, hi, n = span(xs)
    if n == 0:
        return "n/a"
    if lo == hi:
        return f"{fmt(med, nd)}{unit}"
    return f"{fmt(med, nd)}{unit} ({fmt(lo, nd)}-{fmt(hi, nd)})"


def table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(header)) + " |"]
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        out.append("| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |")
    return "\n".join(out)


class LoadSampler:
    """1-minute load average every 2 s (the machine is shared)."""

    def __init__(self) -> None:
        self.samples: list[float] = []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="loadavg").start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(2.0)

    def summary(self) -> str:
        xs = self.samples or [os.getloadavg()[0]]
        return f"{min(xs):.1f} / {sum(xs) / len(xs):.1f} / {max(xs):.1f}"

    def stop(self) -> None:
        self._stop.set()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: 1 repeat, marked as such")
    ap.add_argument("--repeats", type=int, default=None, help="runs per case (3; --quick 1)")
    ap.add_argument("--steps", type=int, default=40, help="steps S every run reaches (40)")
    ap.add_argument("--kill-at", type=int, default=15, help="SIGKILL of worker 1 at (15)")
    ap.add_argument("--hang-at", type=int, default=25, help="SIGSTOP of worker 2 at (25)")
    ap.add_argument("--hang-s", type=float, default=6.0, help="SIGCONT after (6 s)")
    ap.add_argument("--replace-delay", type=float, default=2.0, help="replacement delay (2 s)")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun checkpoint interval (10)")
    ap.add_argument(
        "--cases", default=None,
        help="'all' or a comma-separated subset of: " + ", ".join(slug(c.name) for c in CASES),
    )  # fmt: skip
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    ap.add_argument(
        "--compare",
        default="latest",
        metavar="RUN_DIR",
        help="check reproducibility against this earlier run directory's summary.json "
        "('latest': the newest under benchmarks/runs; 'none': skip)",
    )
    args = ap.parse_args()
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if not 2 < args.kill_at < args.hang_at < args.steps or repeats < 1:
        ap.error("need 2 < --kill-at < --hang-at < --steps and --repeats >= 1")
    cases = [c for c in CASES if c.default]
    if args.cases == "all":
        cases = list(CASES)
    elif args.cases:
        want = set(args.cases.split(","))
        cases = [c for c in CASES if slug(c.name) in want]
        if not cases:
            ap.error(f"no case matches {args.cases!r}")

    import torch

    have_ft = (
        importlib.util.find_spec("torchft") is not None
        and (Path(sys.executable).parent / "torchft_lighthouse").exists()
    )
    ft_why = f"not run: torchft is not installed ({FT_INSTALL})"
    load = LoadSampler()
    load0 = os.getloadavg()
    t_start = time.monotonic()
    date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    uname = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
    py_abs = os.path.abspath(sys.executable)
    py_s = os.path.relpath(py_abs, ROOT) if py_abs.startswith(str(ROOT) + os.sep) else py_abs
    command = shlex.join([py_s, "benchmarks/versus.py", *sys.argv[1:]])
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    ft_ver = ""
    if have_ft:
        from importlib.metadata import version

        ft_ver = version("torchft")
    base = HERE / "runs" / f"versus-{time.strftime('%Y%m%d-%H%M%S')}"
    base.mkdir(parents=True, exist_ok=True)
    S, B = args.steps, SHAPE.global_batch
    log(f"load average {load0[0]:.1f} on {os.cpu_count()} cores; run dirs under {base}")
    log(f"job: demo GPT dim {SHAPE.dim}, {SHAPE.layers} layers, {WORKERS} workers, global "
        f"batch {B}, {S} steps; kill w{KILL_VICTIM}@{args.kill_at}, hang "
        f"w{HANG_VICTIM}@{args.hang_at}/{args.hang_s:g}s, replace delay "
        f"{args.replace_delay:g}s; {repeats} repeat(s) of {len(cases)} case(s)")  # fmt: skip

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # stop: the finally below stops every process by PID

    signal.signal(signal.SIGTERM, on_term)
    runs: dict[str, list[Run]] = {c.name: [] for c in cases}
    ref = Run(REFERENCE.name, 0, False, base / "reference")
    interrupted = False
    try:
        t = time.monotonic()
        plan0 = Plan(S, None, None, args.hang_s, args.replace_delay, 0)
        execute(REFERENCE, plan0, ref, args.ckpt_every)
        log(f"{REFERENCE.name}: {'ok' if ref.survived else 'FAILED ' + ref.why} in "
            f"{time.monotonic() - t:.0f} s, step {fmt(step_time_s(ref.commits, 2, S), 3)} s")  # fmt: skip
        for rep in range(repeats):
            order = cases if rep % 2 == 0 else cases[::-1]
            for c in order:
                if c.system == "torchft" and not have_ft:
                    continue
                plan = Plan(S, args.kill_at, args.hang_at, args.hang_s, args.replace_delay,
                            seed=rep + 1)  # fmt: skip
                run = Run(c.name, rep, True, base / f"{slug(c.name)}-r{rep}")
                t = time.monotonic()
                execute(c, plan, run, args.ckpt_every)
                runs[c.name].append(run)
                log(f"{c.name} #{rep}: {'survived' if run.survived else 'DID NOT SURVIVE: ' + run.why}"
                    f" in {time.monotonic() - t:.0f} s; kill->commit {fmt(run.kill_s)} s, "
                    f"hang->commit {fmt(run.hang_s)} s, replacement {fmt(run.repl_s)} s")  # fmt: skip
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: reporting what ran")
    finally:
        PROCS.stop()
        load.stop()
    runtime = time.monotonic() - t_start
    report = summarize(args, cases, runs, ref, have_ft, ft_why)
    notes = report["notes"] + [
        f"machine load (1-min load average min / mean / max during the benchmark): "
        f"{load.summary()}; {os.cpu_count()} cores shared with other work",
        f"torch {torch.__version__}" + (f", torchft {ft_ver}" if ft_ver else ", torchft missing"),
        f"total runtime {runtime:.0f} s; run dirs {base.relative_to(ROOT)}",
    ]
    report["targets"].append([
        "one command, at most 15 minutes", f"{runtime / 60:.1f} min",
        "PASS" if runtime <= 900 else "FAIL",
    ])  # fmt: skip
    # Reproducibility: against the newest earlier full run (or --compare), the
    # same cases' ranges over the repeats must overlap.
    prev_path = find_previous(args.compare, base)
    repro_table = ""
    if prev_path is not None and repeats >= 3:
        prev = json.loads(prev_path.read_text())
        rows = compare_runs(prev["stats"], report["stats"])
        bad = [r for r in rows if not r[4]]
        repro_table = table(
            ["case", "metric", f"previous run ({prev['date']})", "this run", "within noise"],
            [[a, b, c, d, "yes" if ok else "NO"] for a, b, c, d, ok in rows],
        )
        report["targets"].append([
            f"reproducible: ranges over the repeats overlap those of {prev_path.parent.name}",
            f"{len(rows) - len(bad)}/{len(rows)} case metrics",
            "PASS" if rows and not bad else "FAIL",
        ])  # fmt: skip
    if not interrupted and repeats >= 3:
        (base / "summary.json").write_text(
            json.dumps({"date": date, "commit": head, "stats": report["stats"]}, indent=1)
        )
    target_table = table(["target", "measured", "verdict"], report["targets"])
    print()
    print(report["main"])
    print()
    print(target_table)
    print()
    print(report["detail"])
    print()
    if repro_table:
        print(repro_table)
        print()
    for n in notes:
        print("- " + n)
    for a in report["anomalies"]:
        print("ANOMALY: " + a)
    if not args.no_record and not interrupted:
        res = HERE / "RESULTS.md"
        quick = (
            " (smoke run: fewer than 3 repeats, not the recorded figures)" if repeats < 3 else ""
        )
        sec = [
            "", f"## versus.py — {date}{quick}", "",
            f"Machine: `{uname}`, {os.cpu_count()} cores (shared with other work), load "
            f"average {load0[0]:.1f} at start. Code: commit {head}.", "",
            f"Command: `{command}`", "", "Targets:", "", target_table, "", report["main"], "",
            "Per run:", "", report["detail"], "",
            *(["Against the previous run:", "", repro_table, ""] if repro_table else []),
            *["- " + n for n in notes],
        ]  # fmt: skip
        if report["anomalies"]:
            sec += ["", "Anomalies:", ""] + ["- " + a for a in report["anomalies"]]
        with open(res, "a") as f:
            f.write("\n".join(sec) + "\n")
        log(f"appended to {res}")
    return 0 if not interrupted else 130


def find_previous(spec: str, current: Path) -> Path | None:
    """The summary.json to compare with: `spec` names a run directory, 'latest'
    the newest earlier one under benchmarks/runs, 'none' none."""
    if spec == "none":
        return None
    if spec != "latest":
        p = Path(spec) / "summary.json"
        if not p.is_file():
            raise SystemExit(f"--compare: no summary.json in {spec}")
        return p
    earlier = sorted(
        p for p in (HERE / "runs").glob("versus-*/summary.json") if p.parent != current
    )
    return earlier[-1] if earlier else None


def summarize(
    args: argparse.Namespace,
    cases: list[Case],
    runs: dict[str, list[Run]],
    ref: Run,
    have_ft: bool,
    ft_why: str,
) -> dict[str, Any]:
    """The tables, targets and notes from the runs (no I/O)."""
    S, B = args.steps, SHAPE.global_batch
    ref_curve = global_loss_curve(ref.commits)
    anomalies: list[str] = []
    if not ref.survived or len(ref_curve) < S:
        anomalies.append(f"the failure-free reference is incomplete ({ref.why or len(ref_curve)})")
    rows: list[list[str]] = []
    detail: list[list[str]] = []
    verdict: dict[str, dict[str, Any]] = {}
    stats: dict[str, dict[str, tuple[float, float, float, int]]] = {}
    for c in cases:
        rs = runs[c.name]
        if c.system == "torchft" and not have_ft:
            rows.append([c.name, ft_why])
            continue
        if not rs:
            rows.append([c.name, "not run"])
            continue
        step_s, wall, ideal, gp, dev, same = [], [], [], [], [], []
        for r in rs:
            ts = step_times(r.commits)
            r.dropped = samples_dropped(r.commits, B, 10**9)
            r.dropped_to_s = samples_dropped(r.commits, B, S)
            r.short = short_steps(r.commits, B, 10**9)
            st = step_time_s(r.commits, 2, args.kill_at)
            step_s.append(st)
            w = ts[S - 1] - r.t_launch if S - 1 in ts else math.nan
            wall.append(w)
            sp = ts[S - 1] - ts[0] if 0 in ts and S - 1 in ts else math.nan
            # What the same run would have taken without faults: its own start-up, then
            # S - 1 steps at its own pre-fault step time.
            ideal.append(ts[0] - r.t_launch + (S - 1) * st if 0 in ts else math.nan)
            g = goodput((S - 1) * st, sp, r.dropped_to_s, S, B) * 100
            gp.append(g)
            curve = global_loss_curve(r.commits)
            m = max_rel_dev(curve, ref_curve, S) if r.survived else math.nan
            pre = max_rel_dev(curve, ref_curve, args.kill_at)
            if not pre <= 1e-5:
                anomalies.append(
                    f"{c.name} #{r.rep}: before the first fault its loss differs from the "
                    f"reference by {pre:.1e}: not the same job? ({r.run_dir})"
                )
            missing = sum(1 for s in range(S) if s not in curve)
            if missing and r.survived:
                r.notes.append(f"{missing} step(s) without a complete loss")
            if r.survived:
                dev.append(m)
                same.append(m <= SAME_MATH_TOL)
            if r.kill_s is None and r.survived:
                anomalies.append(f"{c.name} #{r.rep}: no commit after the kill ({r.run_dir})")
            detail.append([
                c.name, str(r.rep), "yes" if r.survived else f"NO: {r.why}", fmt(st, 3),
                fmt(r.kill_s), fmt(r.back_s), fmt(r.hang_s), fmt(r.repl_s), str(r.recomputed),
                f"{r.dropped} ({r.short} steps)", fmt(w, 1), fmt(g, 0), f"{m:.1e}",
                str(r.survivors_lost), "; ".join(r.notes[:3]),
            ])  # fmt: skip
        crashed = sum(1 for r in rs if not r.survived)
        kills = [r.kill_s for r in rs]
        # A kill the job never recovered from counts as infinitely slow in the comparison.
        kill_or_inf = [math.inf if k is None else k for k in kills]
        verdict[c.name] = {
            "step_s": span(step_s)[1], "kill": span(kills),
            "kill_median_inf": statistics.median(kill_or_inf),
            "recomputed": sum(r.recomputed for r in rs), "dropped": sum(r.dropped for r in rs),
            "crashed": crashed, "runs": len(rs),
        }  # fmt: skip
        stats[c.name] = {
            "step (s)": span(step_s), "kill->next commit (s)": span(kills),
            "hang->next commit (s)": span([r.hang_s for r in rs]),
            "replacement training (s)": span([r.repl_s for r in rs]),
            f"wall to step {S} (s)": span(wall), "goodput (%)": span(gp),
        }  # fmt: skip
        n_same = sum(same)
        lost = sum(r.survivors_lost for r in rs)
        n_rec = span(kills)[3]
        n_repl = span([r.repl_s for r in rs])[3]
        repl_note = (
            f" [{n_repl}/{len(rs)} within {REPLACEMENT_CAP_S:g} s]" if n_repl < len(rs) else ""
        )
        rec_note = f" [{n_rec}/{len(rs)} recovered]" if n_rec < len(rs) else ""
        if not same:
            math_cell = "n/a (no run survived)"
        else:
            math_cell = ("same" if n_same == len(same) else f"changed in {len(same) - n_same}/"
                         f"{len(same)}") + f" (max {max(dev):.0e})"  # fmt: skip
        rows.append([
            c.name, cell(step_s, 3), cell(kills) + rec_note, fmt(span(kills)[2]),
            cell([r.back_s for r in rs]) if c.system == "torchrun" else "= next commit",
            cell([r.hang_s for r in rs]), cell([r.repl_s for r in rs], 1) + repl_note,
            cell([float(r.recomputed) for r in rs], 0), cell([float(r.dropped) for r in rs], 0),
            f"{cell(wall, 1)} [no faults: {fmt(span(ideal)[1], 1)}]", cell(gp, 0, "%"),
            math_cell,
            f"{crashed}/{len(rs)}" + (f"; {lost} survivor process(es) died" if lost else ""),
        ])  # fmt: skip
    header = [
        "case", "step (s)", "kill->next commit (s)", "max", "torchrun: back to step reached",
        "hang->next commit (s)", "replacement training (s after kill)", "steps recomputed",
        "samples dropped", f"wall to step {S} (s)", "goodput", "loss curve vs failure-free",
        "runs that did not survive",
    ]  # fmt: skip
    rows = [r + [""] * (len(header) - len(r)) for r in rows]
    detail_table = table(
        ["case", "rep", "survived", "step (s)", "kill->commit", "back", "hang->commit",
         "replacement", "recomputed", "dropped", f"wall to {S}", "goodput %", "loss dev",
         "survivors died", "notes"],
        detail,
    )  # fmt: skip

    targets: list[list[str]] = []
    e = verdict.get("elastrain")
    if e:
        lim = TARGET_ABS_S + e["step_s"]
        med = e["kill"][1]
        targets.append([
            f"elastrain median kill->next commit <= {TARGET_ABS_S} s + one step "
            f"({fmt(e['step_s'], 3)} s)", f"{fmt(med, 3)} s <= {fmt(lim, 3)} s",
            "PASS" if med <= lim else "FAIL",
        ])  # fmt: skip
        for other in ("torchft ddp, hb 5 s", "torchft flat, hb 5 s", "torchrun restart"):
            o = verdict.get(other)
            if o is None:
                targets.append([f"elastrain >= {TARGET_FACTOR:g}x faster than {other}",
                                "not run", "n/a"])  # fmt: skip
                continue
            om = o["kill_median_inf"]
            ratio = om / med if med > 0 else math.nan
            unrec = o["runs"] - o["kill"][3]
            why = (
                f" ({unrec} of {o['runs']} kills never recovered: counted as infinite)"
                if unrec
                else ""
            )
            targets.append([
                f"elastrain >= {TARGET_FACTOR:g}x faster than {other} (median kill->next commit)",
                f"{fmt(om)} s / {fmt(med, 3)} s = {fmt(ratio, 1)}x{why}",
                "PASS" if ratio >= TARGET_FACTOR else "FAIL",
            ])  # fmt: skip
        targets.append(
            [
                "elastrain: zero steps recomputed, zero samples dropped",
                f"{e['recomputed']} recomputed, {e['dropped']} dropped over {e['runs']} runs",
                "PASS" if e["recomputed"] == 0 and e["dropped"] == 0 else "FAIL",
            ]
        )
        survived = e["runs"] - e["crashed"]
        targets.append(
            [
                "elastrain survives every fault in every repeat",
                f"{survived}/{e['runs']} runs survived, {e['kill'][3]} kills recovered",
                "PASS" if e["crashed"] == 0 and e["kill"][3] == e["runs"] else "FAIL",
            ]
        )
    notes = [
        f"job: demo GPT (dim {SHAPE.dim}, {SHAPE.layers} layers, {SHAPE.heads} heads, context "
        f"{SHAPE.block}, byte vocabulary), AdamW lr {SHAPE.lr}, {WORKERS} workers, global batch "
        f"{B} in micro-batches of {SHAPE.micro_batch}, 1 thread per process",
        f"faults per run: SIGKILL of worker {KILL_VICTIM} once {args.kill_at} steps were "
        f"committed, SIGSTOP of worker {HANG_VICTIM} once {args.hang_at} were and SIGCONT "
        f"{args.hang_s:g} s later, each 0.2-0.8 step times into the step (seeded, the same "
        f"draws for every case of a repeat); replacement after {args.replace_delay:g} s; "
        f"cells: median (min-max) over the repeats",
        "step: median step time before the first fault, in the same run",
        "kill/hang->next commit: from the signal to the survivors' first commit that needed "
        "the fault dealt with (elastrain: first commit of the new generation; torchrun: of the "
        "restarted round, or after a hang the step in flight; torchft: in a new quorum)",
        f"torchrun: checkpoint every {args.ckpt_every} steps; 'back to step reached': until "
        "the restarted job committed again the highest step committed before the kill",
        "replacement training: from the kill to the replacement's first commit in which it "
        "took part (torchft: after healing; torchrun: the restarted rank)",
        f"samples dropped: global-batch samples missing from committed updates over the run "
        f"(the per-run table counts the short steps too); wall to step {S}: from launch, "
        "[no faults: the same run's start-up plus its pre-fault step time x steps]; goodput: "
        f"{S - 1} x the pre-fault step time over the wall time from step 0 to step {S - 1}, "
        "times the share of samples trained on",
        f"loss curve: largest relative deviation over steps 0..{S - 1} from a failure-free "
        f"run of the same job (plain DDP under torchrun, in this benchmark); 'same' if <= "
        f"{SAME_MATH_TOL:g}",
    ]
    return {
        "main": table(header, rows), "detail": detail_table, "targets": targets,
        "notes": notes, "anomalies": anomalies, "stats": stats,
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())

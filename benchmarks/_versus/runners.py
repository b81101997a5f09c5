"""One run of one case: elastrain, torchrun restarts, torchft (see versus.py)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from analysis import (
    Plan,
    back_to_reached,
    commits_from_steplog,
    first_commit_of,
    from_elastrain,
    next_lineage_commit,
    next_progress_commit,
    read_steplogs,
    recomputed_steps,
)
from job import (
    HANG_VICTIM,
    JOBS,
    KILL_VICTIM,
    REPLACEMENT_CAP_S,
    RUN_TIMEOUT_S,
    SHAPE,
    VERSUS,
    WORKERS,
    Case,
    Run,
    child_env,
    shape_args,
)
from procs import PROCS, Injector, Tail, alive, recent_step_s

from elastrain.chaos.injector import register as register_chaos
from elastrain.chaos.schedule import parse_fault
from elastrain.launch.launcher import LaunchConfig, Launcher, RunResult
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once
from elastrain.observe.recovery import joins, recoveries


def run_elastrain(plan: Plan, run: Run, spares: int = 0) -> None:
    faults = []
    # With a hot spare the five workers register in any order, and whichever four
    # did first train: the faults then pick their victims (seeded) among those.
    kill_at, hang_at = (f"{plan.kill_at}", f"{plan.hang_at}") if spares else (
        f"{plan.kill_at}:w{KILL_VICTIM}", f"{plan.hang_at}:w{HANG_VICTIM}")  # fmt: skip
    if plan.kill_at is not None:
        faults.append(parse_fault(f"kill@{kill_at}"))
    if plan.hang_at is not None:
        faults.append(parse_fault(f"hang@{hang_at}/{plan.hang_s:g}"))
    cfg = LaunchConfig(
        script=str(JOBS / "elastic_gpt.py"),
        script_args=shape_args(),
        workers=WORKERS,
        min_workers=2,
        spares=spares,
        replace_delay_s=plan.replace_delay_s,
        run_dir=str(run.run_dir),
        steps=plan.steps if not run.faulty else 1_000_000,
        faults=faults,
        seed=plan.seed,
        progress=False,
        extra_env={"OMP_NUM_THREADS": "1"},
    )
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
        if st.get("ready") and members and "originals" not in state:
            state["originals"] = set(members)  # the first generation's
        new = any(m not in state.get("originals", members) for m in members)
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

    register_chaos()  # its faults reach the launcher through the fault seam
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
                if r.promoted:
                    # A hot spare took the dead one's place: its first committed step
                    # is the resumed generation's first.
                    run.repl_s = r.total_s
                elif j is not None and j.first_step_s is not None:
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
                    run.survived, run.state_lost = False, True
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
                run.survived, run.state_lost = False, True
                run.why = "every replica holding the state died: state lost"
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


def execute(case: Case, plan: Plan, run: Run, ckpt_every: int) -> None:
    run.run_dir.mkdir(parents=True, exist_ok=True)
    if case.system == "elastrain":
        run_elastrain(plan, run, spares=1 if case.mode == "spare" else 0)
    elif case.system == "torchrun":
        run_torchrun(plan, run, ckpt_every)
    else:
        run_torchft(plan, run, case.mode, case.heartbeat_ms, case.pg_timeout_s)

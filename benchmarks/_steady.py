"""What the steady-state comparisons of the benchmarks share (recovery.py, sharded.py,
step_cost.py): report helpers, the sides of a comparison, and the interleaving.

A steady-state comparison starts every side at once (an elastrain job through the
Python API, baselines as plain processes, all gated the same way: _jobs/common.Gate)
and lets them take turns in blocks of steps (`interleave`), so that a shared
machine's changing load hits every side alike. `steady_elastrain_vs` is the whole
comparison of one elastrain job (_jobs/elastic_gpt.py) against DDP baselines
(_jobs/ddp_gpt.py) at one shape; `block_stats` derives the per-side figures that do
not come from step timings (wall per step, CPU per step, CPU while idle).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = HERE / "_jobs"
if str(JOBS) not in sys.path:
    sys.path.insert(0, str(JOBS))

from _harness import med, turns  # noqa: E402
from common import Shape  # noqa: E402

from elastrain.chaos.injector import register as register_chaos  # noqa: E402
from elastrain.launch.launcher import LaunchConfig, Launcher  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402
from elastrain.threads import WORKER_THREADS  # noqa: E402


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL and reap each of ``procs`` still running (a benchmark's cleanup)."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def shape_args(shape: Shape) -> list[str]:
    return [
        "--dim", str(shape.dim), "--layers", str(shape.layers), "--heads", str(shape.heads),
        "--block", str(shape.block), "--batch", str(shape.global_batch),
        "--micro", str(shape.micro_batch),
    ]  # fmt: skip


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of the given live processes (Linux /proc), in seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def thread_cpu(
    pids: list[int], coordinator: int | None
) -> dict[tuple[int, int], tuple[str, float]]:
    """CPU seconds (utime + stime) of every thread of the given live processes, by
    (pid, tid), with what the thread is (`thread_kind`)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[tuple[int, int], tuple[str, float]] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                base = Path(f"/proc/{pid}/task/{tid}")
                comm = (base / "comm").read_text().strip()
                fields = (base / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            kind = thread_kind(comm, pid == int(tid), pid == coordinator)
            out[(pid, int(tid))] = (kind, (int(fields[11]) + int(fields[12])) / tick)
    return out


THREAD_KINDS = ("main", "gloo", *WORKER_THREADS, "other", "coordinator")
"""The columns of the CPU-per-thread tables, in order."""


def thread_kind(comm: str, main: bool, coordinator: bool) -> str:
    """What a thread of a side is, from its native name: "coordinator" (any thread of
    elastrain's coordinator), "main" (a worker's first thread: the training loop),
    "gloo" (gloo's transport loop and work threads), one of the worker's own named
    threads (`elastrain.threads`), else "other"."""
    if coordinator:
        return "coordinator"
    if main:
        return "main"
    if comm.startswith(("gloo", "pt_gloo")):
        return "gloo"
    return comm if comm in WORKER_THREADS else "other"


def cpu_delta(
    before: dict[tuple[int, int], tuple[str, float]],
    after: dict[tuple[int, int], tuple[str, float]],
) -> dict[str, float]:
    """CPU seconds by thread kind between two `thread_cpu` samples (a thread born
    in between counts whole; one that ended in between is lost)."""
    out: dict[str, float] = {}
    for key, (kind, t) in after.items():
        out[kind] = out.get(kind, 0.0) + t - before.get(key, (kind, 0.0))[1]
    return out


# ---- the sides of a comparison -----------------------------------------------------------


class LauncherSide:
    """An elastrain job (the Launcher on a thread of this process) as one side."""

    def __init__(self, key: str, cfg: LaunchConfig) -> None:
        self.key = key
        self.run_dir = Path(cfg.run_dir or ".")
        register_chaos()  # its faults reach the launcher through the fault seam
        self.launcher = Launcher(cfg)
        self.result: dict[str, Any] = {}
        self.thread = threading.Thread(
            target=lambda: self.result.update(r=self.launcher.run()), daemon=True
        )

    def start(self) -> None:
        self.thread.start()

    def pids(self) -> list[int]:
        lc = self.launcher
        coord = [lc.coordinator.pid] if lc.coordinator else []
        return [w.proc.pid for w in lc.workers.values()] + coord

    def coordinator_pid(self) -> int | None:
        return self.launcher.coordinator.pid if self.launcher.coordinator else None

    def failed(self) -> bool:
        return not self.thread.is_alive()

    def wait(self, deadline: float) -> None:
        self.thread.join(timeout=max(1.0, deadline - time.monotonic()))

    def abort(self) -> None:
        if self.thread.is_alive():
            self.launcher.stop()
            self.thread.join(timeout=30)

    @property
    def status(self) -> str:
        return self.result["r"].status if "r" in self.result else "?"


class ProcSide:
    """A baseline of `workers` plain processes (one per rank) as one side."""

    def __init__(
        self, key: str, argv: Callable[[int], list[str]], log_dir: Path, workers: int
    ) -> None:
        self.key = key
        self.workers = workers
        self.procs: list[subprocess.Popen[bytes]] = []
        self._argv = argv
        self._log_dir = log_dir

    def start(self) -> None:
        for r in range(self.workers):
            with open(self._log_dir / f"{self.key}-r{r}.log", "wb") as logf:
                self.procs.append(
                    subprocess.Popen(
                        self._argv(r), stdout=logf, stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )  # fmt: skip

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def coordinator_pid(self) -> int | None:
        return None

    def failed(self) -> bool:
        return any(p.poll() not in (None, 0) for p in self.procs)

    def wait(self, deadline: float) -> None:
        for p in self.procs:
            try:
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break

    def abort(self) -> None:
        kill_all(self.procs)

    @property
    def status(self) -> str:
        rcs = [p.returncode for p in self.procs]
        return "done" if rcs and all(rc == 0 for rc in rcs) else f"exit {rcs}"


Side = LauncherSide | ProcSide


def interleave(
    store: Any,
    sides: list[Side],
    blocks: int,
    deadline: float,
    where: Path,
    optional: frozenset[str] = frozenset(),
) -> tuple[list[dict[str, Any]], list[str]]:
    """Let the sides (all started, all gated the same way: common.Gate) run their
    blocks one side at a time, in the order of `sides` and mirrored every other
    block; the others wait idle between steps. Returns one record per block: its
    side, wall times from the go to the last worker's report, the CPU the side's
    processes used, and the CPU each idle side used meanwhile; and the keys of the
    `optional` sides that died and were dropped from the rotation (a side not
    optional that dies ends the comparison: RuntimeError)."""
    live = list(sides)
    dropped: list[str] = []

    def drop_dead() -> None:
        for x in list(live):
            if x.failed() and not store.check([f"{x.key}/ready_all/{blocks}"]):
                if x.key not in optional:
                    raise RuntimeError(f"steady state: side {x.key} died; see {where}")
                live.remove(x)
                dropped.append(x.key)
                x.abort()

    def wait_key(side: Side, key: str) -> float | None:
        """The wall time the side's workers stored under `key`; None if it died."""
        # Poll (store.wait with a timeout logs a C++ warning each time it expires).
        while not store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"steady state: no {key} in time ({where})")
            drop_dead()
            if side not in live:
                return None
            time.sleep(0.02)
        return float(store.get(key))

    for s in sides:
        wait_key(s, f"{s.key}/ready_all/0")
    out: list[dict[str, Any]] = []
    for k in range(blocks):
        order = [x for x in turns(sides, k) if x in live]
        for j, side in enumerate(order):
            if side not in live:
                continue
            # The sides idle during this block that still have blocks to run (a side
            # that is done is exiting, and its CPU is not "idle waiting").
            idle = [x for x in live if x is not side and (k < blocks - 1 or x in order[j + 1 :])]
            c0 = {x.key: cpu_seconds(x.pids()) for x in idle}
            a0 = cpu_seconds(side.pids())
            th0 = thread_cpu(side.pids(), side.coordinator_pid())
            t_go = time.time()
            store.set(f"{side.key}/go/{k}", repr(t_go))
            t_done = wait_key(side, f"{side.key}/ready_all/{k + 1}")
            if t_done is None:
                continue
            out.append(
                {"k": k, "side": side.key, "t0": t_go, "t1": t_done,
                 "cpu_s": cpu_seconds(side.pids()) - a0,
                 "thread_cpu_s": cpu_delta(th0, thread_cpu(side.pids(), side.coordinator_pid())),
                 "idle_cpu_s": {x.key: cpu_seconds(x.pids()) - c0[x.key]
                                for x in idle if x in live}}
            )  # fmt: skip
    return out, dropped


def bench_store(procs: int) -> Any:
    """The comparison's TCPStore (port 0) that `procs` gated processes join."""
    import torch.distributed as dist

    return dist.TCPStore(
        "127.0.0.1", 0, procs + 1, is_master=True, timeout=dt.timedelta(seconds=900),
        wait_for_workers=False,
    )  # fmt: skip


def measured_step(warmup: int, block: int) -> Callable[[int], bool]:
    """Which steps' timings count: in a block, and not the block's first step (its
    start includes the wait for the go)."""
    return lambda step: step >= warmup and (step - warmup) % block != 0


def block_stats(
    blocks_out: list[dict[str, Any]], keys: list[str], block: int, blocks: int
) -> dict[str, dict[str, float]]:
    """Per side: `wall` (a block's wall seconds / its steps, median over blocks), `cpu`
    (CPU seconds per step of all the side's processes, median over its blocks but the
    last, when its processes start exiting: far less sensitive than wall time to other
    work on a shared machine), `threads` (the same by thread kind, `THREAD_KINDS`, a
    dict per side: the mean over those blocks) and `idle` (CPU it burned while
    waiting its turn, as a share of one core)."""
    out: dict[str, dict[str, Any]] = {"wall": {}, "cpu": {}, "idle": {}, "threads": {}}
    for x in keys:
        mine = [b for b in blocks_out if b["side"] == x]
        out["wall"][x] = med([(b["t1"] - b["t0"]) / block for b in mine])
        out["cpu"][x] = med([b["cpu_s"] / block for b in mine if b["k"] < blocks - 1])
        # Summed over the blocks, not a median of each: a thread using a clock tick
        # (10 ms) per block would otherwise read 0 or a tick.
        counted = [b for b in mine if b["k"] < blocks - 1]
        out["threads"][x] = {
            kind: sum(b["thread_cpu_s"].get(kind, 0.0) for b in counted) / (block * len(counted))
            if counted else math.nan
            for kind in THREAD_KINDS
        }  # fmt: skip
        cpu = sum(b["idle_cpu_s"][x] for b in blocks_out if x in b["idle_cpu_s"])
        dur = sum(b["t1"] - b["t0"] for b in blocks_out if x in b["idle_cpu_s"])
        out["idle"][x] = cpu / dur if dur > 0 else math.nan
    return out


def elastrain_steady(run_dir: Path, measured: Callable[[int], bool]) -> dict[str, Any]:
    """An elastrain side's run, from its events: `commits` (the measured steps'
    step_commit events, every member's), `all_commits` (every step's), `loss` by step, and what says whether it
    stayed steady: `gens` trained after the warm-up, each one's size (`sizes`), the
    number of `aborts`."""
    events = read_events(run_dir)
    commits = [e for e in events if e["kind"] == "step_commit"]
    ready = {e["gen"]: e.get("members", []) for e in events if e["kind"] == "generation_ready"}
    gens = sorted({e["gen"] for e in commits if measured(e["step"])})
    return {
        "commits": [e for e in commits if measured(e["step"])],
        "all_commits": commits,
        "loss": {e["step"]: e["loss"] for e in commits},
        "gens": gens,
        "sizes": {g: len(ready.get(g, [])) for g in gens},
        "aborts": sum(1 for e in events if e["kind"] == "step_abort"),
    }


def baseline_steady(
    out_dir: Path, key: str, workers: int, measured: Callable[[int], bool]
) -> dict[str, Any]:
    """A process side's per-rank JSON files (`<key>-r<rank>.json`, written by the
    _jobs baselines): `ranks` as read, the measured steps' `step_s`, `last_s`
    (the synchronising micro-batch) and `opt_s` over all ranks, and `loss` by step
    (the mean of the ranks' local losses)."""
    ranks = [json.loads((out_dir / f"{key}-r{r}.json").read_text()) for r in range(workers)]

    def pick(field: str) -> list[float]:
        return [x for r in ranks for s, x in enumerate(r[field]) if measured(s)]

    return {
        "ranks": ranks,
        "step_s": pick("step_s"),
        "last_s": pick("last_microbatch_s"),
        "opt_s": pick("opt_s"),
        "loss": {
            i: statistics.fmean(r["local_loss"][i] for r in ranks)
            for i in range(len(ranks[0]["local_loss"]))
        },
    }


def elastic_config(
    shape: Shape,
    run_dir: Path,
    steps: int,
    workers: int,
    job_args: tuple[str, ...] = (),
    **kw: Any,
) -> LaunchConfig:
    """The failure-tolerant elastrain job of the replicated benchmarks
    (_jobs/elastic_gpt.py); `job_args` go to the script after the shape's."""
    return LaunchConfig(
        script=str(JOBS / "elastic_gpt.py"),
        script_args=[*shape_args(shape), *job_args],
        workers=workers,
        min_workers=1,
        replace_delay_s=1.0,
        run_dir=str(run_dir),
        steps=steps,
        progress=False,
        **kw,
    )


def steady_elastrain_vs(
    shape: Shape,
    workers: int,
    baselines: dict[str, list[str]],
    warmup: int,
    block: int,
    blocks: int,
    out_dir: Path,
    timeout_s: float,
    job_args: tuple[str, ...] = (),
) -> dict[str, Any]:
    """A failure-free elastrain job ("E"; `job_args`: more arguments for its script) and
    DDP baselines (_jobs/ddp_gpt.py, one side per entry of `baselines`: its key and
    extra flags), `workers` processes each, alive at once, taking turns in blocks.

    Every side starts together and runs `warmup` steps (excluded), then `blocks`
    blocks of `block` steps each, one side at a time, elastrain second (D E T | T E D
    | ... with baselines D and T);
    the sides not running wait idle between steps (_jobs/common.Gate). Returns `E`
    (`elastrain_steady`), each baseline under its key (`baseline_steady`), their keys
    (`baselines`), `blocks` (the block records of `interleave`), `e_status` and `e_dir`. RuntimeError when a
    side fails, TimeoutError when the comparison runs past `timeout_s`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    store = bench_store(workers * (1 + len(baselines)))
    gate_args = ["--warmup-steps", str(warmup), "--block-steps", str(block), "--blocks", str(blocks)]  # fmt: skip
    e_dir = out_dir / "elastrain"
    e_side = LauncherSide(
        "E",
        elastic_config(
            shape, e_dir, warmup + block * blocks, workers, job_args,
            extra_env={"BENCH_GATE": f"127.0.0.1:{store.port},{warmup},{block},{blocks}",
                       "BENCH_WORLD": str(workers)},
        ),
    )  # fmt: skip

    def ddp_argv(key: str, flags: list[str]) -> Callable[[int], list[str]]:
        return lambda r: [
            sys.executable, str(JOBS / "ddp_gpt.py"), str(r), str(workers), str(store.port),
            str(out_dir / f"{key}-r{r}.json"), "--side", key, *gate_args, *shape_args(shape),
            *flags,
        ]  # fmt: skip

    base = [ProcSide(k, ddp_argv(k, flags), out_dir, workers) for k, flags in baselines.items()]
    sides: list[Side] = [*base[:1], e_side, *base[1:]]
    deadline = time.monotonic() + timeout_s
    try:
        for s in sides:
            s.start()
        blocks_out, _ = interleave(store, sides, blocks, deadline, out_dir)
        for s in sides:
            s.wait(deadline)
    finally:
        for s in sides:
            s.abort()
    for b in base:
        if b.status != "done":
            raise RuntimeError(f"DDP baseline {b.key} failed ({b.status}); see {out_dir}")
    measured = measured_step(warmup, block)
    return {
        "E": elastrain_steady(e_dir, measured),
        **{b.key: baseline_steady(out_dir, b.key, workers, measured) for b in base},
        "baselines": [b.key for b in base],
        "blocks": blocks_out,
        "e_status": e_side.status,
        "e_dir": e_dir,
    }


def loss_deviation(st: dict[str, Any], baselines: list[str], steps: int) -> tuple[float, int]:
    """The largest relative difference between elastrain's per-step loss and each
    baseline's over the first steps (at most 10, fewer in a shorter run), and that
    number of steps. Same model, data and math on every side: the losses agree until
    float rounding (different reduction orders) grows through the optimizer (~15 steps
    with the demo GPT); a larger difference means the sides do not train alike."""
    agree = min(10, steps)
    e_loss = st["E"]["loss"]
    dev = max(
        abs(e_loss.get(i, math.nan) - st[x]["loss"].get(i, math.nan))
        / abs(st[x]["loss"].get(i, math.nan))
        for x in baselines
        for i in range(agree)
    )
    return dev, agree


def steady_anomalies(
    st: dict[str, Any], workers: int, measured_steps: int, where: Path
) -> list[str]:
    """What makes a `steady_elastrain_vs` result untrustworthy: the elastrain job did not
    end "done" in one generation of `workers` members without an abort; a side has not
    `workers * measured_steps` step timings; the losses of elastrain and a baseline
    differ by more than 1e-4 (relative) over the first steps."""
    out: list[str] = []
    ev = st["E"]
    why = not_steady(st["e_status"], ev, workers, "elastrain", st["e_dir"])
    if why:
        out.append(why)
    baselines = st["baselines"]
    n = workers * measured_steps
    counts = {"E": len(ev["commits"]), **{k: len(st[k]["step_s"]) for k in baselines}}
    out += [f"side {k}: {c} step_s samples, expected {n}" for k, c in counts.items() if c != n]
    dev, agree = loss_deviation(st, baselines, len(ev["loss"]))
    if not dev <= 1e-4:
        out.append(
            f"elastrain and DDP losses differ by {dev:.1e} (relative) within the first "
            f"{agree} steps: the sides do not train the same thing ({where})"
        )
    return out


def pick_sizes(ap: argparse.ArgumentParser, text: str, sizes: Mapping[str, Any]) -> list[str]:
    """The names in the comma list `text`, each a key of `sizes` (else `ap.error`)."""
    names = [x for x in text.split(",") if x]
    unknown = [x for x in names if x not in sizes]
    if unknown or not names:
        ap.error(f"unknown size(s) {unknown}: choose from {', '.join(sizes)}")
    return names


def not_steady(
    status: str, run: dict[str, Any], workers: int, label: str, where: Any
) -> str | None:
    """Why a failure-free elastrain run cannot be compared (`elastrain_steady`'s
    `run`): it did not end "done" in one generation of `workers` members without an
    abort. None if it did."""
    if (
        status == "done"
        and not run["aborts"]
        and len(run["gens"]) == 1
        and all(v == workers for v in run["sizes"].values())
    ):
        return None
    return (
        f"failure-free {label} job not steady: status {status}, gens "
        f"{run['gens']}, sizes {run['sizes']}, aborts {run['aborts']} ({where})"
    )

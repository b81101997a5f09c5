"""The GPU check (issue 22): one prepared script for a machine with a single GPU.

Run from the repository root:

    .venv/bin/python benchmarks/gpu_check.py [--device auto|cuda|cpu] [--quick] [--no-record]
        [--parts 1,2,3,4,5]

Parts 1-3 took 77-94 s on a lent H200 with 16 cores (2026-12-04); the whole
check takes about 7 minutes on this 2-core CPU machine (under a minute with
--quick). Each part runs even when an earlier one failed; a failed part's rows
say FAILED and name its error. `--device cpu` runs every part that does not
need a GPU, so the test suite exercises this script (tests/test_gpu_check.py
runs it with `--device cpu --quick --no-record`); parts that need CUDA, NCCL or
NVML say "not run" and why. On a lent machine, whose python3 has its own torch
(2.11.0+cu130 on 2026-12-04) but not all of elastrain's dependencies, run it
from the working tree with those it lacks installed beside it: on 2026-12-04
`cryptography` (with `cffi` and `pycparser`) and, since the state digest moved
to XXH3 that day, `xxhash`, from carried cp312 wheels (`pip install --no-index
--no-deps --target /tmp/site`, then `PYTHONPATH=/tmp/site`).

Parts, each on the demo GPT (benchmarks/_jobs/gpu_gpt.py):

1. **One process**: the plain loop (`--plain`: the same model, micro-batches,
   data order and AdamW in an ordinary loop) and a one-worker elastrain job
   (`elastrain.launch.Launcher`) on the device, one after the other; median
   step time of each after the warm-up steps, their ratio, and elastrain's
   MFU and joules per step from its events (`observe.efficiency`: NVML where
   the GPU has it, RAPL or the CPU estimate otherwise, and which it was).
2. **Four processes sharing the device** over gloo (CUDA tensors through host
   copies): a 4-worker elastrain job; a SIGKILL of w1, then, once its
   replacement trains beside the others, a SIGSTOP of w2 (4 s, or 5 steady
   steps of part 1 if longer), and once w2 is
   back and trains, the check stops the job (`Pacer`: steps are too short to
   give a replacement time to start otherwise). Checked: every sample of every
   committed step was used once, every generation started with identical
   state, the members never killed kept their PIDs, the replacement and the
   continued member were healed; measured: kill -> survivors' next commit and
   hang -> next commit (`observe.recovery`).
3. **NCCL at world size 1** (CUDA only): elastrain's own generation group
   (`elastrain.runtime.collectives.build_nccl_group`, non-blocking, connected
   eagerly): create it, the first and a second all-reduce, then abort it, twice
   (the second generation's group is built after the first was aborted);
   seconds of each, and the NCCL version. Part 1's one-worker job runs its
   gradient all-reduce on such a group too (collectives "auto" on CUDA).
4. **A sticky device error**: two workers on the device over gloo; the chaos
   action `poison` breaks w1's CUDA context for real at step 4 (a device-side
   assert; on the CPU, CUDA's message is raised instead). Checked: w1 leaves
   with exit 74, a fresh process is healed and trains to the end, w0 keeps its
   PID, every sample once, identical state at every generation start.
5. **The heal on the host's cores** (no GPU needed): `benchmarks/heal_rate.py`
   with one sender (10 rounds; --quick: its smoke run), the digest heal of
   39.7 MB between two processes beside a warm gloo broadcast of the same
   bytes and beside the digest floor (the bytes alone, hashed as they land).
   On the 2-core machine the floor itself is below issue 42's 0.80 (the two
   copies of a broadcast keep both cores busy and the hash has none to run
   on, docs/design/heal-costs.md); a lent machine's 16 cores say what the heal
   reaches where the hash has a core of its own.

Prints a table and records the run in benchmarks/results/ (date, machine, device,
command, commit) unless --no-record or --quick. Exits 1 if a part failed or
one of its checks did.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure, fmt, log, med, table, target  # noqa: E402

JOB = HERE / "_jobs" / "gpu_gpt.py"
FULL: dict[str, int] = {"dim": 512, "layers": 8, "heads": 8, "batch": 16, "steps": 60, "warmup": 10}
QUICK: dict[str, int] = {"dim": 64, "layers": 2, "heads": 2, "batch": 8, "steps": 12, "warmup": 2}
KILL_AT, HANG_S, SETTLE, POISON_AT = 5, 4, 3, 4
"""Part 2: w1 killed at step KILL_AT; w2 stopped for HANG_S s (at least 5 steady steps
of part 1: a stop shorter than the watchdog's deadline is a slow step, not a hang) once the replacement
has trained SETTLE steps beside the others; the job stopped once w2 has too."""
STALL_S = 120.0
"""Part 2 gives up when no step was committed for this long."""


def pick_device(want: str) -> tuple[str, str]:
    """(device, why) for --device: "auto" is CUDA when torch sees a GPU, else the CPU."""
    import torch

    if want == "auto":
        return ("cuda", "torch sees a GPU") if torch.cuda.is_available() else ("cpu", "no GPU")
    if want == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no GPU here (run with --device cpu)")
    return want, "asked for"


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return str(torch.cuda.get_device_name(0))
    return f"CPU ({os.cpu_count()} cores)"


def job_args(device: str, shape: dict[str, int], collectives: str = "auto") -> list[str]:
    heads = shape["heads"]
    return ["--device", device, "--dim", str(shape["dim"]), "--layers", str(shape["layers"]),
            "--heads", str(heads), "--batch", str(shape["batch"]), "--micro", "1",
            "--collectives", collectives]  # fmt: skip


def env() -> dict[str, str]:
    return {"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run_plain(device: str, shape: dict[str, int], timeout_s: float) -> list[float]:
    """Part 1's baseline: step seconds of the plain loop."""
    out = subprocess.run(
        [sys.executable, str(JOB), "--plain", "--steps", str(shape["steps"]),
         *job_args(device, shape)],
        capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env()},
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"plain loop failed ({out.returncode}): {out.stderr[-800:]}")
    return [float(x) for x in json.loads(out.stdout.strip().splitlines()[-1])["step_s"]]


class Stopper:
    """A status callback that stops the launcher's job: `stop` once it is done, or
    when no step was committed for STALL_S (`stalled`)."""

    def __init__(self, launcher: Any) -> None:
        self.launcher = launcher
        self.done = self.stalled = False
        self._last = (-1, time.monotonic())

    def stop(self) -> None:
        self.done = True
        self.launcher.stop()

    def stalling(self, step: int) -> bool:
        """Whether the job has stalled (then it is stopped); call on every status."""
        if step != self._last[0]:
            self._last = (step, time.monotonic())
        elif time.monotonic() - self._last[1] > STALL_S:
            self.stalled = True
            self.stop()
        return self.stalled


class Pacer(Stopper):
    """Part 2's schedule, on the launcher's status callback: once a fault has fired,
    a newer generation has all 4 workers again and it committed SETTLE steps,
    the next fault (the hang) is added; after the last one settles, the job is
    stopped. Stops it too when no step was committed for STALL_S."""

    def __init__(self, launcher: Any, then: list[str]) -> None:
        super().__init__(launcher)
        self.then = list(then)
        self._fired = 1
        """Entries of the launcher's fault log that mean the current fault fired."""
        self._fault_gen: int | None = None
        """The generation running when it fired: recovery is a newer one..."""
        self._fault_step = 0
        """... or, when the fault passed without a regroup (a hang shorter than the
        watchdog's deadline, as with long CPU steps), 2 x SETTLE steps after it."""
        self._seen: dict[int, int] = {}

    def __call__(self, st: dict[str, Any]) -> None:
        from elastrain.chaos.schedule import parse_fault

        lc, step, gen = self.launcher, int(st.get("step", 0)), int(st.get("gen") or 0)
        if self.done or self.stalling(step):
            return
        if len(lc.fault_log) < self._fired:
            return
        if self._fault_gen is None:
            self._fault_gen, self._fault_step = gen, step
            return
        if len(st.get("members") or []) != 4 or not st.get("ready"):
            return
        if gen <= self._fault_gen and step < self._fault_step + 2 * SETTLE:
            return
        if step - self._seen.setdefault(gen, step) < SETTLE:
            return
        if self.then:
            fault = self.then.pop(0).replace("@NEXT", f"@{step + 1}")
            lc.schedule.pending.append(parse_fault(fault))
            self._fired, self._fault_gen = len(lc.fault_log) + 1, None
        else:
            self.stop()


class UntilJoined(Stopper):
    """Part 4's end, on the launcher's status callback: once a member other than
    `first` (the replacement) is in a ready generation that committed SETTLE steps,
    the job is stopped; also when no step was committed for STALL_S."""

    def __init__(self, launcher: Any, first: set[str]) -> None:
        super().__init__(launcher)
        self.first = first
        self._seen: dict[int, int] = {}

    def __call__(self, st: dict[str, Any]) -> None:
        step, gen = int(st.get("step", 0)), int(st.get("gen") or 0)
        if self.done or self.stalling(step):
            return
        if not st.get("ready") or not set(st.get("members") or []) - self.first:
            return
        if step - self._seen.setdefault(gen, step) >= SETTLE:
            self.stop()


def run_elastrain(
    device: str,
    shape: dict[str, int],
    workers: int,
    run_dir: Path,
    faults: list[str],
    then: list[str] | None = None,
    collectives: str = "auto",
    points: list[dict[str, Any]] | None = None,
    until_joined: bool = False,
) -> tuple[Any, list[dict[str, Any]], Stopper | None]:
    """One elastrain job of `workers` on the device, paced by a `Pacer` when `then`
    lists faults to add, or stopped by `UntilJoined` once a replacement trains, with
    the in-worker fault `points` (`elastrain.chaos.points`); (its result, its events,
    the pacer)."""
    from elastrain.chaos.injector import register as register_chaos
    from elastrain.chaos.schedule import parse_fault
    from elastrain.launch.launcher import LaunchConfig, Launcher
    from elastrain.observe.events import read_events

    cfg = LaunchConfig(
        script=str(JOB),
        script_args=job_args(device, shape, collectives),
        workers=workers,
        steps=shape["steps"] if then is None and not until_joined else 1_000_000,
        run_dir=str(run_dir),
        faults=[parse_fault(f) for f in faults],
        fault_points=json.dumps(points) if points else None,
        progress=False,
        extra_env=env(),
    )
    pacer: Stopper | None = None

    def on_status(st: dict[str, Any]) -> None:
        if pacer is not None:
            pacer(st)

    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=on_status)
    if then is not None:
        pacer = Pacer(launcher, then)
    elif until_joined:
        pacer = UntilJoined(launcher, {f"w{i}" for i in range(workers)})
    result = launcher.run()
    return result, read_events(run_dir), pacer


def steady_step_s(events: list[dict[str, Any]], warmup: int) -> float:
    """Median step_s of the committed steps after the warm-up, over every member."""
    xs = [float(e["step_s"]) for e in events
          if e["kind"] == "step_commit" and int(e["step"]) >= warmup]  # fmt: skip
    return med(xs) if xs else float("nan")


def single_process(device: str, shape: dict[str, int], out: Path) -> dict[str, Any]:
    from elastrain.observe.efficiency import efficiency
    from elastrain.observe.goodput import goodput

    plain = run_plain(device, shape, timeout_s=600)
    result, events, _ = run_elastrain(device, shape, 1, out / "one", [])
    if result.status != "done":
        raise RuntimeError(f"the one-worker job ended {result.status}: {result.message}")
    ef = efficiency(events, goodput(events))
    start = next(e for e in events if e["kind"] == "worker_start")
    return {
        "collectives": f"{start.get('collectives')} ({start.get('collectives_why')})",
        "plain_s": med(plain[shape["warmup"] :]),
        "elastrain_s": steady_step_s(events, shape["warmup"]),
        "mfu": ef.mfu_stepping if ef.mfu_stepping is not None else ef.mfu,
        "peak": ef.peak_tflops,
        "peak_estimate": ef.peak_estimate,
        "joules_per_step": ef.joules_per_step,
        "energy_estimate": ef.energy_estimate,
        "power": ", ".join(ef.power_labels) or "none",
    }


def sample_ledger_and_pids(
    events: list[dict[str, Any]], shape: dict[str, int], survivors: tuple[str, ...]
) -> tuple[Any, dict[str, int], bool]:
    """What the fault parts check alike: the exactly-once ledger of the job's samples
    (`observe.ledger`), each spawned member's PID, and whether every one of
    `survivors` committed its steps from the PID it was spawned with."""
    from elastrain.data import GlobalOrder
    from elastrain.demo.gpt import ByteBlocks, stdlib_corpus
    from elastrain.observe.ledger import check_exactly_once

    order = GlobalOrder(len(ByteBlocks(stdlib_corpus(), 64)), 0)
    b = shape["batch"]
    led = check_exactly_once(events, lambda s: order.ids(s * b, (s + 1) * b))
    spawned = {e["member"]: e["pid"] for e in events if e["kind"] == "worker_spawned"}
    kept = all(
        {e["pid"] for e in events if e.get("proc") == m and e["kind"] == "step_commit"}
        == {spawned.get(m)}
        for m in survivors
    )
    return led, spawned, kept


def shared_device(device: str, shape: dict[str, int], out: Path, hang_s: float) -> dict[str, Any]:
    """Part 2: four workers on the device, a kill and a hang; the checks and the times."""
    from elastrain.observe.ledger import check_same_state
    from elastrain.observe.recovery import recoveries

    faults = [f"kill@{KILL_AT}:w1", f"hang@NEXT:w2/{hang_s:g}"]
    # Four processes on one GPU: NCCL refuses two ranks on one device, so gloo.
    result, events, pacer = run_elastrain(
        device, shape, 4, out / "four", faults[:1], then=faults[1:], collectives="gloo"
    )
    assert pacer is not None
    led, _, kept = sample_ledger_and_pids(events, shape, ("w0", "w2", "w3"))
    healed = [e for e in events if e["kind"] == "heal_end" and e.get("role") == "recv"]
    by = {e["proc"] for e in healed}
    recs = {r.fault: r for r in recoveries(events)}
    checks = {
        "ran until both recoveries trained": pacer.done and not pacer.stalled,
        "every sample used once": not led.violations and led.committed_steps > 0,
        "identical state at every generation start": check_same_state(events) == [],
        "w0, w2, w3 kept their PIDs": kept,
        "the replacement and the continued w2 were healed": "w2" in by and len(by) >= 2,
    }
    return {
        "checks": checks,
        "faults": faults,
        "kill_s": recs["kill"].total_s if "kill" in recs else None,
        "hang_s": recs["hang"].total_s if "hang" in recs else None,
        "healed_mb": healed[0]["bytes"] / 1e6 if healed else None,
        "status": f"{result.status} after {led.committed_steps} steps "
        f"({'stalled' if pacer.stalled else 'stopped by the check'})",
    }


def poisoned_device(device: str, shape: dict[str, int], out: Path) -> dict[str, Any]:
    """Part 4: two workers on the device; w1 breaks its CUDA context for real at step
    POISON_AT (`poison` in `elastrain.chaos.points`: a device-side assert; on the CPU,
    CUDA's message raised instead) and must leave with exit 74 for a fresh process,
    which w0 heals while it trains on alone."""
    from elastrain.exitcodes import EXIT_DEVICE_POISONED
    from elastrain.observe.ledger import check_same_state

    result, events, stopper = run_elastrain(
        device, shape, 2, out / "poison", [], collectives="gloo", until_joined=True,
        points=[{"member": "w1", "step": POISON_AT, "phase": "compute", "action": "poison"}],
    )  # fmt: skip
    assert isinstance(stopper, UntilJoined)
    led, spawned, kept = sample_ledger_and_pids(events, shape, ("w0",))
    gone = [e for e in events if e["kind"] == "worker_exit" and e.get("proc") == "w1"]
    exited = [e for e in events if e["kind"] == "worker_exited" and e.get("member") == "w1"]
    joiner = next((m for m in spawned if m not in ("w0", "w1")), None)
    healed = next((e["mono"] for e in events if e["kind"] == "heal_end"
                   and e.get("proc") == joiner and e.get("role") == "recv"), None)  # fmt: skip
    trained = {e["step"] for e in events if e["kind"] == "step_commit" and e.get("proc") == joiner
               and healed is not None and e["mono"] > healed}  # fmt: skip
    # The check stops the workers one SIGTERM after another, each leaving at its next
    # step boundary: the first to see its signal leaves, and the other may commit one
    # more step alone. So "to the end" is the joiner's own exit being that leave.
    left = [e for e in events if e["kind"] == "worker_exit" and e.get("proc") == joiner]
    t_exit = next((e["mono"] for e in gone), None)
    later = [e["mono"] for e in events if e["kind"] == "step_commit" and e.get("proc") == "w0"
             and t_exit is not None and e["mono"] > t_exit]  # fmt: skip
    error = str(gone[0].get("error", "")) if gone else ""
    return {
        "checks": {
            "w1 left with exit 74 (device poisoned)": bool(exited)
            and exited[0].get("returncode") == EXIT_DEVICE_POISONED
            and bool(gone)
            and gone[0].get("reason") == "device_poisoned",
            "ran until a fresh process trained": stopper.done and not stopper.stalled,
            "the fresh process was healed, trained and left only when stopped": len(trained)
            >= SETTLE
            and [e.get("reason") for e in left] == ["left"],
            "w0 kept its PID": kept,
            "every sample used once": not led.violations and led.committed_steps > POISON_AT,
            "identical state at every generation start": check_same_state(events) == [],
        },  # fmt: skip
        "error": error,
        "exit_to_commit_s": (min(later) - t_exit) if later and t_exit is not None else None,
        "status": f"{result.status} after {led.committed_steps} steps "
        f"({'stalled' if stopper.stalled else 'stopped by the check'})",
    }


NCCL_PROBE = r"""
import json, os, tempfile, time
import torch, torch.distributed as dist
from elastrain.runtime.collectives import (build_nccl_group, choose_transport,
                                           runtime_nccl_version, version_text)
version = runtime_nccl_version()
choice = choose_transport("nccl", "cuda", sharded=False, nccl_version=version)
out = {"nccl": version_text(version), "how": "elastrain's generation group, non-blocking"}
store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
device = torch.device("cuda", 0)
x = torch.ones(1 << 20, device=device)
for gen in (1, 2):  # the second generation's group is built after the first is aborted
    t0 = time.perf_counter()
    group = build_nccl_group(store, f"gen{gen}/nccl", 0, 1, device, op_timeout_s=60)
    out[f"create{gen}_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); group.allreduce([x]).wait()
    out[f"first_allreduce{gen}_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); group.allreduce([x]).wait()
    out[f"allreduce{gen}_s"] = time.perf_counter() - t0
    assert float(x[0]) == 1.0, float(x[0])  # a sum over one rank
    t0 = time.perf_counter(); group.abort()
    out[f"abort{gen}_s"] = time.perf_counter() - t0
out.update(create_s=out["create1_s"], first_allreduce_s=out["first_allreduce1_s"],
           allreduce_s=out["allreduce1_s"], abort_s=out["abort1_s"])
print(json.dumps(out))
"""


def nccl_world_1(device: str) -> dict[str, Any]:
    """Part 3 (CUDA only): NCCL group create, first all-reduce and abort at world size 1."""
    if device != "cuda":
        return {"skipped": "no CUDA device: NCCL needs one"}
    got = subprocess.run([sys.executable, "-c", NCCL_PROBE], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    if got.returncode != 0:
        print(got.stderr, file=sys.stderr)
        raise RuntimeError(f"the probe exited {got.returncode}: {got.stderr.strip()[-300:]}")
    return dict(json.loads(got.stdout.strip().splitlines()[-1]))


def attempt(part: Any, *args: Any) -> tuple[Any, str | None]:
    """(part(*args), None), or (None, its error in one line) with the traceback on stderr."""
    try:
        return part(*args), None
    except Exception as e:  # noqa: BLE001 - any failure of a part is reported, not fatal
        traceback.print_exc()
        lines = str(e).strip().splitlines()
        return None, f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def part1_rows(one: dict[str, Any] | None, err: str | None) -> list[list[str]]:
    if one is None:
        return [["1 process", f"FAILED: {err}"]]
    ratio = one["elastrain_s"] / one["plain_s"]
    energy = (
        f"{fmt(one['joules_per_step'])} J ({one['power']}"
        + ("; an ESTIMATE" if one["energy_estimate"] else "") + ")"
        if one["joules_per_step"] is not None else f"not measured ({one['power']})"
    )  # fmt: skip
    return [
        ["1 process: step, plain loop / elastrain (median, s)",
         f"{fmt(one['plain_s'])} / {fmt(one['elastrain_s'])} ({ratio:.3f}x)"],
        ["1 process: elastrain's gradient all-reduce", one["collectives"]],
        ["1 process: elastrain MFU", (f"{100 * one['mfu']:.1f}% of {fmt(one['peak'], 1)} TFLOPS"
                                     + (" (peak estimated)" if one["peak_estimate"] else ""))
         if one["mfu"] is not None else "not measured"],
        ["1 process: energy per step", energy],
    ]  # fmt: skip


def part2_rows(four: dict[str, Any] | None, err: str | None, hang_s: float) -> list[list[str]]:
    head = f"4 processes: kill@{KILL_AT}:w1, then a {hang_s:g} s SIGSTOP of w2"
    if four is None:
        return [[head, f"FAILED: {err}"]]
    return [
        [head, four["status"]],
        *[[f"4 processes: {k}", "yes" if ok else "NO"] for k, ok in four["checks"].items()],
        ["4 processes: kill -> survivors' next commit (s)", fmt(four["kill_s"])],
        [f"4 processes: {hang_s:g} s SIGSTOP -> next commit (s)", fmt(four["hang_s"])],
        ["4 processes: replacement healed (MB)", fmt(four["healed_mb"], 1)],
    ]


def part4_rows(poison: dict[str, Any] | None, err: str | None) -> list[list[str]]:
    head = f"2 processes: poison@{POISON_AT}:w1 (a sticky device error in w1's step)"
    if poison is None:
        return [[head, f"FAILED: {err}"]]
    return [
        [head, poison["status"]],
        ["2 processes: the error w1 met", poison["error"][:120] or "none"],
        *[[f"2 processes: {k}", "yes" if ok else "NO"] for k, ok in poison["checks"].items()],
        ["2 processes: w1's exit -> w0's next commit (s)", fmt(poison["exit_to_commit_s"])],
    ]


def nccl_rows(nccl: dict[str, Any] | None, err: str | None) -> list[list[str]]:
    return [
        [f"NCCL world size 1, generation {g}: create / first all-reduce / abort (s)",
         f"FAILED: {err}" if nccl is None else nccl.get("skipped") or
         f"{fmt(nccl[f'create{g}_s'])} / {fmt(nccl[f'first_allreduce{g}_s'])} / "
         f"{fmt(nccl[f'abort{g}_s'])} (NCCL {nccl['nccl']}, {nccl['how']})"]
        for g in (1, 2)
    ]  # fmt: skip


def heal_on_host(quick: bool, out: Path) -> dict[str, Any]:
    """Part 5: heal_rate.py's run with one sender, unrecorded (`heal_rate.run_one`:
    its job's processes, as the benchmark runs them; --quick: its smoke shape), and
    from its rounds the medians of the warm broadcast, of the digest heal and of the
    digest floor, the last two as fractions of the first; the host's core count."""
    import heal_rate

    base = heal_rate.QUICK if quick else heal_rate.FULL
    shape = (int(base["dim"]), int(base["layers"]), int(base["heads"]))
    reps = int(base["reps"]) if quick else 10
    got = heal_rate.run_one(
        1, shape, reps, out / "heal-rate", 60.0 + 20.0 * reps, heal_rate.STRIPE_MIN_BYTES
    )
    warm, heal, dfloor = (med(got["rates"][k]) for k in ("warm", "heal", "dfloor"))
    return {"cores": os.cpu_count(), "warm": warm, "heal": heal / warm, "dfloor": dfloor / warm}


def part5_rows(heal: dict[str, Any] | None, err: str | None) -> list[list[str]]:
    head = "heal on the host's cores, 1 sender"
    if heal is None:
        return [[head, f"FAILED: {err}"]]
    return [
        [head, f"{heal['cores']} cores"],
        [f"{head}: warm broadcast (MB/s)", fmt(heal["warm"], 0)],
        [f"{head}: digest heal / warm broadcast (ratio)", fmt(heal["heal"], 2)],
        [f"{head}: digest floor / warm broadcast (ratio)", fmt(heal["dfloor"], 2)],
    ]


def main() -> int:
    bench = Bench("gpu_check.py", __doc__, quick="a small model and few steps", runs_dir=True)
    ap = bench.ap
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--parts", default="1,2,3,4,5", help="which parts to run (default: all)")
    args = bench.parse()
    try:
        parts = {int(x) for x in args.parts.split(",")}
    except ValueError:
        ap.error(f"--parts: comma-separated part numbers 1-5, got {args.parts!r}")
    if not parts or not parts <= {1, 2, 3, 4, 5}:
        ap.error(f"--parts: comma-separated part numbers 1-5, got {args.parts!r}")
    shape = QUICK if args.quick else FULL
    device, why = pick_device(args.device)
    out = bench.run_dir("gpu-check").resolve()
    name = device_name(device)
    log(f"device {device} ({why}): {name}; runs under {out}")

    # Each part runs even when an earlier one failed: a lent GPU is scarce, and one
    # run should say everything it can (a failed part's rows name its error).
    rows: list[list[str]] = [["device", f"{device}: {name}"]]
    anomalies: list[str] = []

    def run_part(n: int, what: str, part: Any, *args: Any) -> tuple[Any, str | None]:
        log(f"part {n}: {what}")
        got, err = attempt(part, *args)
        if err:
            anomalies.append(f"part {n} failed: {err}")
        if got is not None and "checks" in got:
            log(f"part {n}: {got['status']}; checks {got['checks']}")
            anomalies.extend(f"part {n} check failed: {k}"
                             for k, ok in got["checks"].items() if not ok)  # fmt: skip
        return got, err

    one: dict[str, Any] | None = None
    if 1 in parts:
        one, err = run_part(1, "one process, the plain loop, then a one-worker elastrain job",
                            single_process, device, shape, out)  # fmt: skip
        rows += part1_rows(one, err)
    if 2 in parts:
        hang_s = round(max(HANG_S, 5 * one["elastrain_s"] if one else HANG_S), 1)
        four, err = run_part(2, "four workers sharing the device, a kill and a hang",
                             shared_device, device, shape, out, hang_s)  # fmt: skip
        rows += part2_rows(four, err, hang_s)
    if 3 in parts:
        nccl, err = run_part(3, "NCCL at world size 1", nccl_world_1, device)
        rows += nccl_rows(nccl, err)
    if 4 in parts:
        poison, err = run_part(4, "two workers, a sticky device error in one",
                               poisoned_device, device, shape, out)  # fmt: skip
        rows += part4_rows(poison, err)
    if 5 in parts:
        heal, err = run_part(5, "the heal on the host's cores", heal_on_host, args.quick, out)
        rows += part5_rows(heal, err)
    t = table(["check", "result"], rows)
    notes = [
        f"model: demo GPT dim {shape['dim']}, {shape['layers']} layers, {shape['heads']} heads, "
        f"context 64; global batch {shape['batch']} in micro-batches of 1; {shape['steps']} "
        f"steps, the first {shape['warmup']} left out of the medians",
        "elastrain's reduce_dtype: auto (float64 on the CPU, native on a GPU); parts 2 and 4 "
        "share the one device among 4 and 2 processes over gloo (CUDA tensors through host "
        "copies); part 4 runs until its replacement trains, not a fixed number of steps",
        f"parts run: {', '.join(map(str, sorted(parts)))}; run dirs "
        f"{out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}",
    ]
    print()
    print(t)
    print()
    import torch

    bench.finish(f"device {device}: {name}; torch {torch.__version__}", *judged(rows), notes, t,
                 anomalies)  # fmt: skip
    return 1 if anomalies else 0


def judged(rows: list[list[str]]) -> tuple[list[Figure], list[Any]]:
    """The check table's yes/NO rows as targets, its rows of seconds as figures."""
    figures, targets = [], []
    for check, result in rows:
        if result in ("yes", "NO") or result.startswith("NO"):
            targets.append(target(check, "yes", result, result == "yes"))
            continue
        try:
            value = float(result)
        except ValueError:
            continue
        for mark, unit in ((" (s)", "s"), (" (MB/s)", "MB/s"), (" (ratio)", "")):
            if mark in check:
                key = "".join(c if c.isalnum() else "_" for c in check.lower()).strip("_")
                figures.append(Figure(key, check.replace(mark, ""), value, unit))
    return figures, targets


if __name__ == "__main__":
    sys.exit(main())

"""Sharded replica groups against plain FSDP2 HSDP (issue 16's benchmark acceptance).

Run from the repository root:

    .venv/bin/python benchmarks/sharded.py [--dim 256 --layers 8] [--quick] [--no-record]
        [--no-torchft] [--tft-heartbeat-ms 5000] [--parts all|kill]

Four processes as 2 replica groups x 2 shards, the demo GPT (dim 256, 8
layers, 4 heads, context 64 by default: 6.47M parameters, 77.6 MB of
training state; exact numbers printed), global batch 8, micro-batch 1, AdamW,
one thread per process, gloo over loopback. In order:

1. Steady state, side by side in one run. Four jobs of 4 processes are alive
   at once and take turns in blocks of steps (the others wait idle between
   steps; see recovery.py's steady state and _jobs/common.Gate), mirrored
   every other block (H E N F | F N E H | ...) so that the shared machine's
   changing load hits every side alike:
   E  elastrain 2 x 2: `Launcher(LaunchConfig(shard_size=2))` running
      _jobs/sharded_gpt.py (ElasticTrainer; the launcher's shard size sets
      TrainerConfig.shard_size), reduce_dtype "float64" (the default: exact);
   N  the same with reduce_dtype "native": FSDP2's own gradient accumulation,
      one float32 reduce-scatter per step, the twins' all-reduce in float32;
   H  plain FSDP2 HSDP, no elastrain (_jobs/hsdp_gpt.py): 4 processes joined
      through a TCPStore, `init_device_mesh("cpu", (2, 2), ("replicate",
      "shard"))`, `fully_shard` on every block and the root; gradient
      accumulation the FSDP2 way (`set_requires_gradient_sync(False)` on all
      but each rank's last micro-batch: one float32 reduction per step);
   F  the same HSDP communicating like elastrain's sharded step (which keeps
      the exact float64 gradient sum): a float64 reduce-scatter in the replica
      group after every micro-batch, one float64 all-reduce across the groups
      per step (`set_requires_all_reduce` on the last micro-batch only). The
      gap between H and F is about the price of that exactness, the gap
      between F and E (and between H and N) elastrain's own machinery;
   T  torchft's HSDP (where torchft 0.2.0 is installed: pyproject's `bench`
      extra), _jobs/torchft_hsdp_gpt.py: 2 replica groups of 2 ranks, each
      group its own gloo world with `fully_shard` on its 1-D shard mesh (plain
      FSDP2, as on H), the replicate dimension torchft's: a lighthouse
      (`torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
      --join_timeout_ms 10000 --heartbeat_timeout_ms 5000`), one
      `torchft.Manager` per rank (torchft.ProcessGroupGloo across the groups,
      gloo timeout 5 s: versus.py's default torchft setting), every FSDP
      module's all-reduce hook averaging its gradient shard over
      `ManagedProcessGroup(manager)`, `torchft.Optimizer` around AdamW. torchft
      0.2.0 no longer has `ft_init_device_mesh`; this is the recipe of its own
      FSDP test and of torchtitan's torchft integration. Gradient
      accumulation and float32 reduction as on H; a quorum and a should_commit
      every step. Alive and gated with the others (order H E N F T | T F N E H).
   Every side clips its gradient to a global norm of 1.0 (`CLIP`). Same model,
   initial weights, data order, micro-batches and per-micro-batch
   RNG on every side. Target: median step_s <= 1.05 x H's, reported for E and
   for N (the report says which meets it); T's row is reported beside them (no
   target). A side T that fails is dropped from the
   rotation and its error reported; the other sides go on.
2. Peak RSS per rank (/proc VmHWM, written by each worker at its end) of E, N,
   H and F, and of a short replicated elastrain run (the same script, shard size
   1) for reference, against the full training state (params + AdamW's two
   moments). Each member starts from the full materialised model today (the
   sharded trainer needs one; HSDP here does the same, for the same initial
   weights), so every peak includes the full parameters; the table shows the
   resident size after the imports, after building the model, and the peak,
   and whether a sharded member still holds the full model's parameters at
   its end (a weak reference its job script keeps after dropping its own).
3. Recovery: one elastrain 2 x 2 run with `kill@K:wN` (default w1 at step 8)
   and replace_delay_s 1; the launcher stops the job once the replacement's
   generation has committed --settle steps. From the run's events
   (`elastrain.observe.recovery`): kill -> next committed step and its phases,
   against 0.5 s + one step (E's median steady step_s from 1); the
   replacement's heal: bytes received against its shard's state (state / S)
   and the full state, and its rate against a plain gloo broadcast of a
   tensor of state / S bytes between two processes over loopback
   (_jobs/loopback_bcast.py), measured right after, in the same run. Target:
   heal rate >= 50% of the loopback rate. The same broadcast into freshly
   allocated memory each time is shown beside it: a heal's receiver lands its
   state in pages it has not touched yet, and their first-touch faults cost
   about as much as the copy (warm 2.0-3.1 GB/s, fresh 1.1 GB/s measured here).
3b'. Recovery with a hot spare: the same job and kill with `spares=1`: a fifth
   worker waits registered as a standby; the generation re-formed for the
   failure admits it into the dead rank's slot, it is healed that one shard
   from its twin, and no replica group runs short. Target: kill -> next
   commit <= 0.5 s + one step, as in 3 (the spare is what makes it reachable
   at R = 2: without it the step after a kill is computed by one group alone).
   Judged twice: against the steady phase's median step (measured minutes
   earlier, at another load) and against the median step_s of the same run's
   own steps before the kill (the same run, the same load).
3c. torchft recovery: one T run (no gate) where rank 1 of replica group 1 is
   SIGKILLed at the same step as 3 (kill@K: once the job committed K steps,
   after the same seeded mid-step offset elastrain's fault schedule draws with
   seed 0). Each replica group is restarted as a whole, the way torchft runs
   one (torchrun --max-restarts per group in its torchx component): this
   benchmark plays that agent, polling its ranks every 20 ms, SIGKILLing
   the group's other rank and starting both again after 1 s (elastrain's
   replace_delay_s); the restarted group skips the start barrier and heals from
   the survivors over torchft's HTTP transport. Stopped once the restarted
   group committed --settle steps taking part. Lighthouse heartbeat timeout 5 s
   (its default, versus.py's default rows; --tft-heartbeat-ms), which the
   survivors' stall is expected to equal (shared/PEERS.md). Measured from the
   ranks' JSON lines: kill -> the surviving group's next committed step, the
   steps it aborted meanwhile; the restarted group's spawn -> ready -> heal
   received -> first committed step taking part; the bytes each rank healed
   (tensor bytes of the state torchft's transport received, counted by the job
   script: torchft does not report them) against state / S and the full state.
4. torchft: if it is not importable, T is left out of 1 and 3c and the report
   says so (nothing is installed by this benchmark).
5. Prints the tables and records the run, with date, machine, load, command and
   commit, in benchmarks/results/ (unless --no-record).

3b. Resharding: one more 2 x 2 run with `--reshard-after 2` where w1's
   replacement is held back 20 s (`kill@K:w1/hold=20s`): the survivors regroup
   in memory as 1 x 3, then back to 2 x 2 when it returns; each regroup's bytes
   received (all members) and the slowest member's seconds (`reshard_end`).
3d. `--parts kill` runs only two recovery runs, nothing else: a 2 x 2 job
   (float64) where w1 SIGKILLs itself at an in-worker fault point of step K,
   early (after its first micro-batch: the healthy group keeps its shard sums
   and the next generation computes only the lost group's micro-batches) and
   late (once its twins' all-reduce started: the buffers were handed over, the
   step is computed again whole). Each: kill -> next commit against 0.5 s +
   that run's own median step before the kill; the resumed step's held and
   computed micro-batches per rank (`step_commit`).
Each measurement is one `measure_*` function returning a dict, each report
table one function over it.

Why this model size: on this 2-core machine time, not memory, bounds the
model (23 GB of RAM would hold a far larger one four times over). recovery.py's
10M-parameter GPT took 0.85-1.5 s per step as 4 DDP processes here
(results/archive-2026.md); compute scales about with the parameter count, so 6.5M
parameters should step in about 0.5-1 s and leave room for sharding's
gathers. It was not searched for by trial. "The largest GPT that fits" is, for
now, bounded by the full model fitting in each member (each starts from it),
not by the state / S it keeps: sharding does not raise that ceiling until
members can start from a meta-device model and a sharded checkpoint.

--quick is a smoke run (a tiny model, a few steps: no number in it means
anything) and is never recorded; it took 1.5-2.5 minutes at load
averages of 5-14 on this 2-core machine before the reshard run and the torchft
side were added, 4.5 minutes with them (load average 8-13); the N side adds a
fifth of the steady state. The default size took 5.1 minutes at load 0.8-9
(2026-12-01, four sides) and 8.6 minutes at load 11 (2026-12-02, five sides).
Run directories are kept under benchmarks/runs/sharded-<stamp>/ (git-ignored).
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
JOBS = HERE / "_jobs"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(JOBS))

from _harness import (  # noqa: E402
    Bench,
    Figure,
    fmt,
    log,
    med,
    pct,
    table,
    targets_from_rows,
    verdict,
)
from _kills import KillPacer, first_step_breakdown, run_bounded  # noqa: E402
from _loopback import measure_loopback  # noqa: E402
from _steady import (  # noqa: E402
    LauncherSide,
    ProcSide,
    Side,
    block_stats,
    interleave,
    not_steady,
    shape_args,
)
from common import Shape, build, param_count  # noqa: E402

from elastrain.chaos.injector import register as register_chaos  # noqa: E402
from elastrain.chaos.schedule import parse_fault  # noqa: E402
from elastrain.launch.launcher import LaunchConfig, Launcher  # noqa: E402
from elastrain.observe.events import read_events  # noqa: E402
from elastrain.observe.recovery import (  # noqa: E402
    PHASES,
    format_joins,
    format_recoveries,
    joins,
    recoveries,
)
from elastrain.runtime.sharded import shard_rows  # noqa: E402

WORKERS = 4
SHARDS = 2
TARGET_OVERHEAD = 0.05
TARGET_RECOVERY_FIXED_S = 0.5
"""kill -> next commit target: this plus one steady step."""
TARGET_HEAL_FRACTION = 0.5
"""The replacement's heal rate, as a fraction of the loopback broadcast rate."""
HEAL_BYTES_TOLERANCE = 0.05
"""A heal "moves state / S": its payload within this fraction of the shard's state."""
CLIP = 1.0
"""Every side clips its gradient to this global norm before the optimizer step, as
an LLM recipe does: elastrain by `max_grad_norm` (the norm over every shard), the
FSDP2 sides by `clip_grad_norm_` over their DTensor gradients."""
CLIP_ARGS = ["--clip", f"{CLIP:g}"]

BASELINES = {
    "H": ("HSDP", []),
    "F": ("HSDP fp64/micro", ["--scatter-every-micro", "--reduce-fp64"]),
}
"""The plain FSDP2 HSDP sides (no elastrain) and their hsdp_gpt.py flags. The
overhead target is judged against H, the way FSDP2 users accumulate gradients."""
TFT = "T"
"""The torchft HSDP side (_jobs/torchft_hsdp_gpt.py), where torchft is installed."""
TFT_HEARTBEAT_MS = 5000
"""The lighthouse's heartbeat timeout: its default, and versus.py's default torchft rows."""
TFT_PG_TIMEOUT_S = 5.0
"""torchft's gloo timeout across the groups (versus.py's, as torchft's train_ddp.py example)."""
TFT_VICTIM = (1, 1)
"""(replica group, rank in it) SIGKILLed in the torchft recovery run."""
TFT_INSTALL = (
    "pip install --no-deps torchft==0.2.0 opentelemetry-api opentelemetry-sdk "
    "opentelemetry-exporter-otlp-proto-http (pyproject's bench extra)"
)
ELASTRAIN_SIDES = {
    "E": ("elastrain 2x2", "float64"),
    "N": ("elastrain 2x2 native", "native"),
}
"""The elastrain sides of the steady state and their TrainerConfig.reduce_dtype: E the
exact default (a float64 reduce-scatter per micro-batch), N FSDP2's own reductions
(one reduce-scatter per step in float32, the twins' all-reduce in float32)."""
LABELS = {
    **{k: v[0] for k, v in ELASTRAIN_SIDES.items()},
    **{k: v[0] for k, v in BASELINES.items()},
    TFT: "torchft HSDP",
}
COMPARED = [("E", "H"), ("N", "H"), ("E", "F"), ("N", "F"), (TFT, "H")]
"""The steady-state table's difference columns: (side, against)."""
RSS_LABELS = {**LABELS, "R": "elastrain replicated"}
PROC_KEYS = [*BASELINES, TFT]
"""The sides run as plain processes writing the same per-rank JSON (not elastrain)."""

QUICK_SHAPE = Shape(dim=64, layers=2, heads=2, block=32, global_batch=8, micro_batch=1)
FULL_SHAPE = Shape(dim=256, layers=8, heads=4, block=64, global_batch=8, micro_batch=1)


# ---- sizes -------------------------------------------------------------------------------


def state_bytes(shape: Shape, shards: int) -> dict[str, Any]:
    """Parameter count, full training-state bytes (params + AdamW's exp_avg and
    exp_avg_sq, + its 4-byte step counter per parameter tensor) and each shard's
    share of it (the rows `shard_rows` gives shard s of every parameter: what a
    member holds and what a heal of it moves)."""
    import torch

    torch.set_num_threads(1)
    model, _, data = build(shape)
    full = 0
    per = [0] * shards
    params_b = 0
    for p in model.parameters():
        rows = p.shape[0] if p.dim() else 1
        per_row = p.numel() // rows if rows else 0
        size = p.element_size()
        params_b += p.numel() * size
        full += 3 * p.numel() * size + 4
        for s in range(shards):
            lo, hi = shard_rows(rows, shards, s)
            per[s] += 3 * (hi - lo) * per_row * size + 4
    out = {"params": param_count(model), "params_bytes": params_b, "full": full, "shard": per}
    del model, data
    return out


# ---- the sides of the steady-state comparison -----------------------------------------


def free_port() -> int:
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def lighthouse_argv(port: int, heartbeat_ms: int) -> list[str]:
    """torchft's lighthouse as versus.py runs it: a quorum of one group is enough
    (min_replicas 1), checked every 100 ms, stragglers awaited 10 s."""
    return [
        str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1",
        "--quorum_tick_ms", "100", "--join_timeout_ms", "10000",
        "--heartbeat_timeout_ms", str(heartbeat_ms), "--bind", f"127.0.0.1:{port}",
    ]  # fmt: skip


def tft_argv(
    shape: Shape, port: int, lighthouse: str, group: int, rank: int, log: Path, inc: int,
    extra: list[str],
) -> list[str]:  # fmt: skip
    """One rank of the torchft HSDP job (_jobs/torchft_hsdp_gpt.py)."""
    return [
        sys.executable, str(JOBS / "torchft_hsdp_gpt.py"), str(group), str(rank),
        "--groups", str(WORKERS // SHARDS), "--shard-size", str(SHARDS), "--port", str(port),
        "--log", str(log), "--incarnation", str(inc), "--lighthouse", lighthouse,
        "--pg-timeout", f"{TFT_PG_TIMEOUT_S:g}", *shape_args(shape), *CLIP_ARGS, *extra,
    ]  # fmt: skip


class TorchftSide(ProcSide):
    """The torchft HSDP side: its lighthouse, then `WORKERS` ranks (rank r is rank
    r % SHARDS of replica group r // SHARDS)."""

    def __init__(
        self, key: str, argv: Callable[[int, str], list[str]], log_dir: Path, heartbeat_ms: int
    ) -> None:
        self.lh_port = free_port()
        self.lighthouse: subprocess.Popen[bytes] | None = None
        self.heartbeat_ms = heartbeat_ms
        url = f"http://127.0.0.1:{self.lh_port}"
        super().__init__(key, lambda r: argv(r, url), log_dir, WORKERS)

    def start(self) -> None:
        with open(self._log_dir / f"{self.key}-lighthouse.log", "wb") as logf:
            self.lighthouse = subprocess.Popen(
                lighthouse_argv(self.lh_port, self.heartbeat_ms), stdout=logf,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        super().start()

    def pids(self) -> list[int]:
        return super().pids() + ([self.lighthouse.pid] if self.lighthouse else [])

    def abort(self) -> None:
        super().abort()
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            self.lighthouse.kill()
            self.lighthouse.wait()

    def error(self) -> str:
        """What the ranks printed last (the exception of a failed one), for the report."""
        out = []
        for r, proc in enumerate(self.procs):
            if proc.returncode not in (None, 0):
                last = log_tail(self._log_dir / f"{self.key}-r{r}.log")
                out.append(f"rank {r} exit {proc.returncode}: {last}")
        return "; ".join(out) or self.status


def log_tail(path: Path, lines: int = 3, width: int = 400) -> str:
    """The last non-empty lines of a log, joined (the exception that ended a process)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    tail = [x.strip() for x in text.splitlines() if x.strip()][-lines:]
    return " | ".join(tail)[-width:]


def elastrain_config(
    shape: Shape,
    run_dir: Path,
    steps: int,
    shard_size: int,
    reduce_dtype: str = "float64",
    **kw: Any,
) -> LaunchConfig:
    """The elastrain job of every measurement here (sharded, or shard_size 1)."""
    return LaunchConfig(
        script=str(JOBS / "sharded_gpt.py"),
        script_args=[*shape_args(shape), *CLIP_ARGS, "--reduce-dtype", reduce_dtype],
        workers=WORKERS,
        shard_size=shard_size,
        replace_delay_s=1.0,
        run_dir=str(run_dir),
        steps=steps,
        progress=False,
        **kw,
    )


def steps_before(events: list[dict[str, Any]], t0: float, skip: int = 2) -> float | None:
    """Median step_s of the steps a run committed before `t0` (its kill), leaving out
    its first `skip` steps (start-up): the step time of that run, at the load it ran
    under, where the steady phase's median was measured minutes earlier."""
    got = [
        float(e["step_s"])
        for e in events
        if e["kind"] == "step_commit" and e["t"] < t0 and int(e["step"]) >= skip
    ]
    return statistics.median(got) if got else None


def read_rss(rss_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(f.read_text()) for f in sorted(rss_dir.glob("*.json"))]


# ---- 1. steady state ---------------------------------------------------------------------


def measure_steady(
    shape: Shape,
    warmup: int,
    block: int,
    blocks: int,
    out_dir: Path,
    timeout_s: float,
    tft_heartbeat_ms: int | None = None,
) -> dict[str, Any]:
    """Elastrain 2 x 2 (float64 and native) and the HSDP baselines (and torchft's HSDP, unless
    `tft_heartbeat_ms` is None), alive at once, taking turns in blocks (see the
    module docstring). Returns per-side step samples (the first step of each block
    left out on every side), losses, block records and RSS per rank; `keys`, the
    sides that ran to the end, and `tft_error`, why T did not (None if it did)."""
    import torch.distributed as dist

    out_dir.mkdir(parents=True, exist_ok=True)
    n_proc = WORKERS * (1 + len(ELASTRAIN_SIDES) + len(BASELINES))
    store = dist.TCPStore(
        "127.0.0.1", 0, n_proc + 1, is_master=True, timeout=dt.timedelta(seconds=900),
        wait_for_workers=False,
    )  # fmt: skip
    gate = f"127.0.0.1:{store.port},{warmup},{block},{blocks}"
    gate_args = ["--warmup-steps", str(warmup), "--block-steps", str(block), "--blocks", str(blocks)]  # fmt: skip
    steps = warmup + block * blocks
    e_sides: dict[str, LauncherSide] = {}
    for key, (_, reduce_dtype) in ELASTRAIN_SIDES.items():
        rss_dir = out_dir / f"rss-elastrain-{reduce_dtype}"
        rss_dir.mkdir(parents=True, exist_ok=True)
        e_sides[key] = LauncherSide(
            key,
            elastrain_config(
                shape, out_dir / f"elastrain-{reduce_dtype}", steps, SHARDS, reduce_dtype,
                extra_env={"BENCH_GATE": gate, "BENCH_SIDE": key, "BENCH_WORLD": str(WORKERS),
                           "BENCH_RSS_DIR": str(rss_dir)},
            ),
        )  # fmt: skip

    def hsdp_argv(key: str, flags: list[str]) -> Callable[[int], list[str]]:
        return lambda r: [
            sys.executable, str(JOBS / "hsdp_gpt.py"), str(r), str(WORKERS), str(store.port),
            str(out_dir / f"{key}-r{r}.json"), "--side", key, "--shard-size", str(SHARDS),
            *gate_args, *shape_args(shape), *CLIP_ARGS, *flags,
        ]  # fmt: skip

    base_sides = [
        ProcSide(k, hsdp_argv(k, flags), out_dir, WORKERS) for k, (_, flags) in BASELINES.items()
    ]
    # H first: the order is H E N F (T) | (T) F N E H | ..., elastrain always in the middle.
    sides: list[Side] = [base_sides[0], *e_sides.values(), *base_sides[1:]]
    t_side: TorchftSide | None = None
    if tft_heartbeat_ms is not None:
        t_side = TorchftSide(
            TFT,
            lambda r, url: tft_argv(
                shape, store.port, url, r // SHARDS, r % SHARDS, out_dir / f"{TFT}-r{r}.jsonl", 0,
                ["--out", str(out_dir / f"{TFT}-r{r}.json"), *gate_args],
            ),
            out_dir,
            tft_heartbeat_ms,
        )  # fmt: skip
        sides.append(t_side)
    deadline = time.monotonic() + timeout_s
    try:
        for s in sides:
            s.start()
        blocks_out, dropped = interleave(
            store, sides, blocks, deadline, out_dir, optional=frozenset({TFT})
        )
        for s in sides:
            if s.key not in dropped:
                s.wait(deadline)
    finally:
        for s in sides:
            s.abort()
    for s in base_sides:
        if s.status != "done":
            raise RuntimeError(f"HSDP baseline {s.key} failed ({s.status}); see {out_dir}")
    tft_error = None
    if t_side is not None and t_side.status != "done":
        tft_error = f"torchft HSDP side failed: {t_side.error()} (logs {out_dir}/{TFT}-r*.log)"

    def measured(step: int) -> bool:  # in a block, and not the block's first step
        return step >= warmup and (step - warmup) % block != 0

    keys = [*ELASTRAIN_SIDES, *BASELINES] + (
        [TFT] if t_side is not None and tft_error is None else []
    )
    out: dict[str, Any] = {
        "step_s": {},
        "loss": {},
        "rss": {},
        "el": {},
        "blocks": [b for b in blocks_out if b["side"] in keys],
        "dir": out_dir,
        "steps": steps,
        "keys": keys,
        "tft_error": tft_error,
    }
    for key, side in e_sides.items():
        events = read_events(side.run_dir)
        commits = [e for e in events if e["kind"] == "step_commit"]
        ready = {e["gen"]: e.get("members", []) for e in events if e["kind"] == "generation_ready"}
        gens = sorted({e["gen"] for e in commits if e["step"] >= warmup})
        out["step_s"][key] = [e["step_s"] for e in commits if measured(e["step"])]
        out["loss"][key] = {e["step"]: e["loss"] for e in commits}
        out["rss"][key] = read_rss(out_dir / f"rss-elastrain-{ELASTRAIN_SIDES[key][1]}")
        out["el"][key] = {
            "compute_s": [e["compute_s"] for e in commits if measured(e["step"])],
            "allreduce_s": [e["allreduce_s"] for e in commits if measured(e["step"])],
            "status": side.status,
            "gens": gens,
            "sizes": {g: len(ready.get(g, [])) for g in gens},
            "aborts": sum(1 for e in events if e["kind"] == "step_abort"),
            "dir": side.run_dir,
        }
    for key in keys:
        if key in ELASTRAIN_SIDES:
            continue
        ranks = [json.loads((out_dir / f"{key}-r{r}.json").read_text()) for r in range(WORKERS)]
        out["step_s"][key] = [x for r in ranks for s, x in enumerate(r["step_s"]) if measured(s)]
        out[f"{key}_last_s"] = [
            x for r in ranks for s, x in enumerate(r["last_microbatch_s"]) if measured(s)
        ]
        out[f"{key}_opt_s"] = [x for r in ranks for s, x in enumerate(r["opt_s"]) if measured(s)]
        out["loss"][key] = {
            i: statistics.fmean(r["local_loss"][i] for r in ranks)
            for i in range(len(ranks[0]["local_loss"]))
        }
        out["rss"][key] = ranks
    if TFT in keys:
        recs = read_jsonl(sorted(out_dir.glob(f"{TFT}-r*.jsonl")))
        out["T_aborts"] = [r for r in recs if r["kind"] == "abort"]
    return out


def measure_replicated_rss(shape: Shape, steps: int, out_dir: Path, timeout_s: float) -> dict:
    """A short failure-free elastrain run with shard size 1 (the replicated trainer),
    same script and model: its RSS per rank, for reference."""
    rss_dir = out_dir / "rss"
    rss_dir.mkdir(parents=True, exist_ok=True)
    cfg = elastrain_config(shape, out_dir, steps, 1, extra_env={"BENCH_RSS_DIR": str(rss_dir)})
    register_chaos()  # its faults reach the launcher through the fault seam
    result, _ = run_bounded(Launcher(cfg), timeout_s)
    return {"status": result.status, "rss": read_rss(rss_dir), "dir": out_dir}


# ---- 3. recovery -------------------------------------------------------------------------


def measure_recovery(
    shape: Shape,
    kill_step: int,
    victim: str,
    settle: int,
    out_dir: Path,
    timeout_s: float,
    spares: int = 0,
) -> dict[str, Any]:
    """One elastrain 2 x 2 run, one SIGKILL of `victim` at `kill_step`; stopped once
    its replacement's generation committed `settle` steps (_kills.KillPacer).
    With `spares`, hot spares wait beside the 4 ranks and one takes the slot."""
    # With spares, which worker waits as the standby depends on who registered
    # last: let the fault schedule pick a member of the generation (seeded).
    fault = f"kill@{kill_step}" if spares else f"kill@{kill_step}:{victim}"
    cfg = elastrain_config(
        shape, out_dir, 100_000, SHARDS, faults=[parse_fault(fault)], seed=0, spares=spares
    )
    pacer = KillPacer(1, kill_step, settle, WORKERS)
    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=pacer)
    pacer.launcher = launcher
    result, wall_s = run_bounded(launcher, timeout_s)
    events = read_events(out_dir)
    recs = [r for r in recoveries(events) if r.fault == "kill"]
    js = joins(events)
    # The victim's slot (the generation_start events of a sharded member carry it).
    slots = {
        e["proc"]: (e.get("replica"), e.get("shard"))
        for e in events
        if e["kind"] == "generation_start" and "shard" in e
    }
    heal_ends = [e for e in events if e["kind"] == "heal_end"]
    return {
        "status": result.status,
        "wall_s": wall_s,
        "events": events,
        "recs": recs,
        "joins": js,
        "slots": slots,
        "heal_ends": heal_ends,
        "pacer_done": pacer.done,
        "stalled": pacer.stalled,
        "fault_log": launcher.fault_log,
        "pids": launcher.pids,
        "dir": out_dir,
    }


KILL_POINTS = {
    "early": ("compute", "once it computed its first micro-batch of the step"),
    "late": ("allreduce", "once it started its twins' all-reduce of the step (every "
             "micro-batch computed, the buffers handed over)"),
}  # fmt: skip
"""`--parts kill`: the in-worker fault points (`elastrain.chaos.points`) of the two kills."""


def measure_kill_point(
    shape: Shape, kill_step: int, victim: str, phase: str, out_dir: Path, timeout_s: float
) -> dict[str, Any]:
    """One elastrain 2 x 2 run (float64), `victim` SIGKILLing itself at the fault point
    (`kill_step`, `phase`); stopped once the job committed 4 steps past it (the
    survivors go on without waiting for the replacement)."""
    point = {"member": victim, "step": kill_step, "phase": phase, "action": "kill"}
    cfg = elastrain_config(
        shape, out_dir, 100_000, SHARDS, seed=0, fault_points=json.dumps([point])
    )

    def on_status(st: dict[str, Any]) -> None:
        if int(st.get("step", 0)) >= kill_step + 4:
            launcher.stop()

    register_chaos()  # the fault points reach the workers through the fault seam
    launcher = Launcher(cfg, on_status=on_status)
    result, wall_s = run_bounded(launcher, timeout_s)
    events = read_events(out_dir)
    recs = [r for r in recoveries(events) if r.fault == "kill"]
    rec = recs[0] if recs else None
    resumed = [
        e
        for e in events
        if rec is not None
        and e["kind"] == "step_commit"
        and e.get("gen") == rec.gen
        and int(e["step"]) == kill_step
    ]
    # Each member's replica group in the recovery's generation: kept or built, the
    # milliseconds its heal spent agreeing on it and building it, and of those in the
    # process group's rendezvous (0: an older worker).
    starts = [
        e
        for e in events
        if rec is not None and e["kind"] == "generation_start" and e.get("gen") == rec.gen
    ]
    sizes = Counter(e.get("replica") for e in starts)
    groups = {
        e["proc"]: (
            int(e.get("group_kept", 0)),
            int(e.get("group_ms", 0)),
            int(e.get("group_pg_ms", 0)),
            sizes[e.get("replica")] < int(e.get("shard_size", 0)),  # a shadow: no group
        )
        for e in starts
    }
    return {
        "status": result.status,
        "wall_s": wall_s,
        "rec": rec,
        "own_step_s": steps_before(events, rec.t0) if rec else None,
        "resumed": resumed,
        "groups": groups,
        "dir": out_dir,
    }


def kill_point_row(name: str, kp: dict[str, Any], kill_step: int, victim: str) -> list[str]:
    """A target row: kill -> next commit against 0.5 s + the run's own step."""
    rec, own = kp["rec"], kp["own_step_s"]
    limit = TARGET_RECOVERY_FIXED_S + own if own is not None else None
    total = rec.total_s if rec else None
    phases = ", ".join(f"{n} {fmt(rec.phase(n))}" for n in PHASES) if rec else "no recovery"
    computing = [e for e in kp["resumed"] if e.get("computed")]
    resumed = (
        f"resumed step {kill_step}: step_s "
        + "/".join(fmt(float(e["step_s"])) for e in computing)
        + ", per computing rank held "
        + "/".join(str(e.get("held")) for e in computing)
        + " and computed "
        + "/".join(str(e.get("computed")) for e in computing)
        + " micro-batches"
        if computing
        else "resumed step not seen"
    )
    groups = kp.get("groups") or {}
    if groups:
        resumed += "; replica group per rank: " + ", ".join(
            f"{w} a shadow {ms} ms"
            if shadow
            else f"{w} kept {ms} ms"
            if kept
            else f"{w} built {ms} ms (process group {pg} ms)"
            for w, (kept, ms, pg, shadow) in sorted(groups.items())
        )
    return [
        f"kill {name} in a step ({victim} {KILL_POINTS[name][1]}, step {kill_step}) -> next "
        f"commit <= {TARGET_RECOVERY_FIXED_S:g} s + one step (this run's median step_s "
        f"before the kill {fmt(own)} s; = {fmt(limit)} s)",
        f"{fmt(total)} s ({phases}; {resumed})",
        verdict(None if total is None or limit is None else total <= limit),
    ]


def kills_only(bench: Bench, shape: Shape, kill_step: int, victim: str, quick: bool) -> int:
    """`--parts kill`: the early and the late kill (`KILL_POINTS`), nothing else."""
    import torch

    base = bench.run_dir("sharded-kills")
    load = bench.load
    assert load is not None
    runs: dict[str, dict[str, Any]] = {}
    anomalies: list[str] = []
    for name, (phase, what) in KILL_POINTS.items():
        log(f"kill {name}: {victim} SIGKILLs itself {what} (step {kill_step})")
        kp = measure_kill_point(
            shape, kill_step, victim, phase, base / f"kill-{name}", 300 if quick else 420
        )
        rec = kp["rec"]
        log(f"kill {name}: status {kp['status']} in {kp['wall_s']:.1f} s, kill -> next commit "
            f"{fmt(rec.total_s if rec else None)} s ({kp['dir']})")  # fmt: skip
        if rec is None:
            anomalies.append(f"kill {name}: no kill recognised in the run ({kp['dir']})")
        runs[name] = kp
    rows = [kill_point_row(n, kp, kill_step, victim) for n, kp in runs.items()]
    targets = table(["target", "measured", "verdict"], rows)
    print()
    print(targets)
    print()
    judged, _ = targets_from_rows(rows)
    figures = [
        Figure(f"kill_to_next_commit_s[{n}]", f"kill -> next commit, kill {n} in a step",
               kp["rec"].total_s, "s")
        for n, kp in runs.items()
        if kp["rec"] is not None and kp["rec"].total_s is not None
    ]  # fmt: skip
    notes = [
        f"--parts kill: two elastrain 2 x 2 runs (float64 reductions, the default; demo GPT "
        f"dim {shape.dim}, {shape.layers} layers; global batch {shape.global_batch}, "
        f"micro-batch {shape.micro_batch}), no spare, replace_delay_s 1; the victim "
        "SIGKILLs itself at an in-worker fault point (elastrain.chaos.points); each run "
        f"stops 4 steps after the kill. 'One step' is each run's own median step_s before "
        "its kill (the same run, the same load), not a steady phase's",
        "early: the healthy group keeps its float64 shard sums of the interrupted step "
        "(runtime/held_sums.py) and the next generation computes only the lost group's "
        "micro-batches; late: the buffers were handed to the twins' all-reduce, which the "
        "kill broke, so the step is computed again whole by the healthy group alone",
        "runs: " + ", ".join(str(kp["dir"].relative_to(ROOT)) for kp in runs.values()),
    ]
    bench.finish(
        f"torch {torch.__version__}, gloo over loopback", figures, judged, notes,
        [targets], anomalies,
    )  # fmt: skip
    return 0


def measure_reshard(
    shape: Shape, kill_step: int, out_dir: Path, timeout_s: float, hold_s: float = 20.0
) -> dict[str, Any]:
    """One elastrain 2 x 2 run with `--reshard-after 2`: w1 SIGKILLed at `kill_step`
    with its replacement held back `hold_s` (`/hold=`), so the 3 survivors regroup in
    memory as 1 x 3; when the replacement registers the job goes back to 2 x 2. Stopped
    3 steps after it is back. Returns the run's `reshard_end` events and status."""
    cfg = elastrain_config(
        shape,
        out_dir,
        100_000,
        SHARDS,
        faults=[parse_fault(f"kill@{kill_step}:w1/hold={hold_s:g}s")],
        reshard_after_s=2.0,
        seed=0,
    )
    back: dict[str, int] = {}

    def on_status(st: dict[str, Any]) -> None:
        step = int(st.get("step", 0))
        if "step" not in back:
            events = read_events(out_dir)
            if any(e["kind"] == "reshard_end" and e["new_size"] == SHARDS for e in events):
                back["step"] = step
        elif step >= back["step"] + 3:
            launcher.stop()

    register_chaos()  # its faults reach the launcher through the fault seam
    launcher = Launcher(cfg, on_status=on_status)
    result, wall_s = run_bounded(launcher, timeout_s)
    events = read_events(out_dir)
    return {
        "status": result.status,
        "wall_s": wall_s,
        "back": "step" in back,
        "reshards": [e for e in events if e["kind"] == "reshard_end"],
        "dir": out_dir,
    }


def reshard_rows(rs: dict[str, Any], full_bytes: int) -> list[list[str]]:
    """One row per regroup: sizes, members, bytes received in all, the slowest member's
    seconds (every member's reshard is collective)."""
    by_gen: dict[int, list[dict[str, Any]]] = {}
    for e in rs["reshards"]:
        by_gen.setdefault(int(e["gen"]), []).append(e)
    rows = []
    for gen, es in sorted(by_gen.items()):
        moved = sum(int(e["received"]) for e in es)
        rows.append(
            [
                str(gen),
                f"{es[0]['old_size']} -> {es[0]['new_size']} ways",
                str(len(es)),
                f"{mb(moved, 2)} MB ({pct(moved, full_bytes)} of the full state)",
                f"{max(float(e['seconds']) for e in es):.3f} s",
            ]
        )
    return rows


# ---- 3c. torchft's recovery -------------------------------------------------------------


def read_jsonl(paths: list[Path]) -> list[dict[str, Any]]:
    """The records of JSON-lines files, by time; a torn last line is skipped."""
    out = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return sorted(out, key=lambda r: r["t"])


def tail_jsonl(paths: list[Path], state: dict[Path, tuple[int, str]]) -> list[dict[str, Any]]:
    """The records appended to `paths` since the last call (`state`: per file, the
    offset read so far and a partial last line)."""
    out = []
    for path in paths:
        off, part = state.get(path, (0, ""))
        try:
            with open(path) as f:
                f.seek(off)
                chunk = f.read()
                off = f.tell()
        except OSError:
            continue
        *lines, part = (part + chunk).split("\n")
        state[path] = (off, part)
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def recent_step_s(commit_t: dict[int, float]) -> float:
    """The median interval between the last ~10 consecutive commits (0.2 s if none)."""
    ks = sorted(commit_t)[-11:]
    d = [commit_t[b] - commit_t[a] for a, b in zip(ks, ks[1:], strict=False) if b == a + 1]
    return statistics.median(d) if d else 0.2


def measure_tft_recovery(
    shape: Shape,
    kill_step: int,
    settle: int,
    out_dir: Path,
    timeout_s: float,
    heartbeat_ms: int,
    replace_delay_s: float = 1.0,
) -> dict[str, Any]:
    """One torchft HSDP run (2 groups x 2 ranks, no gate), one SIGKILL of rank
    TFT_VICTIM[1] of group TFT_VICTIM[0] once `kill_step` steps are committed (plus
    elastrain's seeded mid-step offset); this loop restarts a group with a dead rank
    as a whole, `replace_delay_s` after it stopped the group's other ranks (what
    torchrun --max-restarts does per group in torchft's setup). Stopped once the
    restarted group committed `settle` steps taking part. Returns every rank's
    records, the kill, the group stops and spawns, and unexpected deaths."""
    import torch.distributed as dist

    from elastrain.chaos.schedule import FaultSchedule

    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, 1, is_master=True, timeout=dt.timedelta(seconds=300),
        wait_for_workers=False,
    )  # fmt: skip
    lh_port = free_port()
    url = f"http://127.0.0.1:{lh_port}"
    groups = WORKERS // SHARDS
    procs: dict[tuple[int, int], subprocess.Popen[bytes]] = {}
    all_procs: list[subprocess.Popen[bytes]] = []
    inc = dict.fromkeys(range(groups), 0)
    spawns: list[dict[str, Any]] = []
    downs: list[dict[str, Any]] = []
    deaths: list[str] = []
    with open(out_dir / "lighthouse.log", "wb") as logf:
        lh = subprocess.Popen(
            lighthouse_argv(lh_port, heartbeat_ms), stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip

    def spawn(g: int, join: bool) -> None:
        for r in range(SHARDS):
            argv = tft_argv(
                shape, store.port, url, g, r, out_dir / f"g{g}r{r}.jsonl", inc[g],
                ["--join"] if join else [],
            )  # fmt: skip
            with open(out_dir / f"g{g}r{r}-i{inc[g]}.log", "wb") as logf:
                procs[(g, r)] = subprocess.Popen(
                    argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True
                )
            all_procs.append(procs[(g, r)])
        spawns.append({"group": g, "inc": inc[g], "t": time.time(), "join": join})

    # The same first draw as elastrain's recovery run (its fault schedule, seed 0).
    sched = FaultSchedule([parse_fault(f"kill@{kill_step}:w1")], seed=0)
    kill: dict[str, Any] = {}
    due: float | None = None
    respawn_at: dict[int, float] = {}
    commit_t: dict[int, float] = {}
    tails: dict[Path, tuple[int, str]] = {}
    took: set[int] = set()
    done = False
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    try:
        for g in range(groups):
            spawn(g, join=False)
        while time.monotonic() < deadline and not done:
            now = time.monotonic()
            for r in tail_jsonl(sorted(out_dir.glob("g*r*.jsonl")), tails):
                if r["kind"] != "commit":
                    continue
                commit_t.setdefault(int(r["step"]), float(r["t"]))
                if kill and r["group"] == TFT_VICTIM[0] and r["inc"] > 0 and r["participating"]:
                    took.add(int(r["step"]))
            committed = max(commit_t) + 1 if commit_t else 0
            if not kill and committed >= kill_step:
                if due is None:
                    due = now + sched.offset(recent_step_s(commit_t))
                elif now >= due:
                    victim = procs[TFT_VICTIM]
                    kill = {"t": time.time(), "pid": victim.pid, "committed": committed}
                    os.kill(victim.pid, signal.SIGKILL)
            for g in range(groups):
                if g in respawn_at:
                    continue
                exits = {r: procs[(g, r)].poll() for r in range(SHARDS)}
                if all(rc is None for rc in exits.values()):
                    continue
                # A rank is gone: stop the rest of its group, start the group again.
                for r in range(SHARDS):
                    if procs[(g, r)].poll() is None:
                        procs[(g, r)].kill()
                        procs[(g, r)].wait()
                dead = {procs[(g, r)].pid: rc for r, rc in exits.items() if rc is not None}
                downs.append({"group": g, "inc": inc[g], "t": time.time(), "exits": exits})
                if not kill or kill["pid"] not in dead:
                    deaths.append(
                        f"group {g} (incarnation {inc[g]}): ranks exited {exits}: "
                        + "; ".join(log_tail(out_dir / f"g{g}r{r}-i{inc[g]}.log")
                                    for r, rc in exits.items() if rc is not None)
                    )  # fmt: skip
                respawn_at[g] = now + replace_delay_s
            for g, at in list(respawn_at.items()):
                if now >= at:
                    del respawn_at[g]
                    inc[g] += 1
                    spawn(g, join=True)
            done = len(took) >= settle
            time.sleep(0.02)  # also how soon a dead rank's group is stopped
    finally:
        for proc in all_procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lh.kill()
        lh.wait()
    run = {
        "kill": kill,
        "spawns": spawns,
        "downs": downs,
        "deaths": deaths,
        "done": done,
        "wall_s": time.monotonic() - t0,
        "heartbeat_ms": heartbeat_ms,
        "replace_delay_s": replace_delay_s,
    }
    # What only this loop knows, beside the ranks' records (tft_recovery_figures reads both).
    (out_dir / "run.json").write_text(json.dumps(run, indent=1))
    return {**run, "recs": read_jsonl(sorted(out_dir.glob("g*r*.jsonl"))), "dir": out_dir}


def tft_recovery_figures(rc: dict[str, Any]) -> dict[str, Any]:
    """The torchft recovery run's figures from its records (seconds; None where the
    run did not get there): the survivors' stall, the victim group's restart and
    heal. A group's step is committed when its last rank logged the commit."""
    recs, kill = rc["recs"], rc["kill"]
    gv = TFT_VICTIM[0]
    out: dict[str, Any] = {"killed": bool(kill)}
    if not kill:
        return out
    tk = float(kill["t"])
    commits = [r for r in recs if r["kind"] == "commit"]
    out["step_s_before"] = med([r["step_s"] for r in commits if r["t"] < tk])

    def group_commits(pred: Callable[[dict[str, Any]], bool]) -> list[tuple[float, dict]]:
        """(time the group committed it, a record) per step, for the records `pred` keeps."""
        by_step: dict[int, list[dict[str, Any]]] = {}
        for r in commits:
            if pred(r):
                by_step.setdefault(int(r["step"]), []).append(r)
        return sorted((max(x["t"] for x in xs), xs[0]) for xs in by_step.values())

    # The quorum the kill landed in: the newest one any survivor committed in before it.
    surv = [r for r in commits if r["group"] != gv]
    q_kill = max((r["quorum"] for r in surv if r["t"] < tk), default=-1)
    after = group_commits(lambda r: r["group"] != gv and r["t"] > tk)
    out["next_commit_s"] = after[0][0] - tk if after else None
    out["next_commit_participants"] = after[0][1]["participants"] if after else None
    new_q = [(t, r) for t, r in after if r["quorum"] > q_kill]
    out["new_quorum_s"] = new_q[0][0] - tk if new_q else None
    t_newq = new_q[0][0] if new_q else math.inf
    out["survivor_aborts"] = len(
        {r["step"] for r in recs if r["kind"] == "abort" and r["group"] != gv and tk < r["t"] <= t_newq}
    )  # fmt: skip
    downs = [d for d in rc["downs"] if d["group"] == gv and d["t"] >= tk]
    out["group_stopped_s"] = downs[0]["t"] - tk if downs else None
    sp = next((s for s in rc["spawns"] if s["group"] == gv and s["join"]), None)
    out["spawn_s"] = sp["t"] - tk if sp else None
    if sp is None:
        return out
    mine = [r for r in recs if r["group"] == gv and r["inc"] == sp["inc"]]

    def last_of(kind: str) -> float | None:
        """When the last rank of the restarted group logged its first `kind`."""
        firsts = {}
        for r in mine:
            if r["kind"] == kind:
                firsts.setdefault(r["rank"], r["t"])
        return max(firsts.values()) - sp["t"] if len(firsts) == SHARDS else None

    out["imported_s"] = last_of("imported")
    out["built_s"] = last_of("built")
    out["ready_s"] = last_of("ready")
    out["heal_recv_s"] = last_of("heal_recv")
    out["healed_s"] = last_of("healed")
    joined = group_commits(
        lambda r: r["group"] == gv and r["inc"] == sp["inc"] and r["participating"]
    )
    out["first_step_s"] = joined[0][0] - sp["t"] if joined else None
    out["kill_to_trains_s"] = joined[0][0] - tk if joined else None
    heals = {r["rank"]: r for r in mine if r["kind"] == "heal_recv"}
    out["heal_bytes"] = {k: int(v["bytes"]) for k, v in sorted(heals.items())}
    out["heal_seconds"] = {k: v["t"] - v["t0"] for k, v in sorted(heals.items())}
    out["heal_src"] = {k: v.get("src") for k, v in sorted(heals.items())}
    # Steps the survivors committed alone: the victim group's share of each was not trained on.
    t_back = joined[0][0] if joined else math.inf
    out["alone_steps"] = len(
        [1 for t, r in after if t < t_back and r["participants"] < WORKERS // SHARDS]
    )
    return out


def tft_recovery_table(
    tf: dict[str, Any], rc: dict[str, Any], sizes: dict[str, Any], e: dict[str, Any]
) -> str:
    """torchft's recovery beside elastrain's (`e`: kill -> next commit, the
    replacement's spawn -> first step and kill -> first step, heal bytes and seconds)."""
    g, r = TFT_VICTIM
    hb = rc["heartbeat_ms"] / 1000

    def per_rank(d: dict[int, float], f: Callable[[float], str]) -> str:
        return ", ".join(f"r{k} {f(v)}" for k, v in d.items()) if d else "n/a"

    rows = [
        ["lighthouse heartbeat timeout / torchft gloo timeout (s)", "",
         f"{hb:g} / {TFT_PG_TIMEOUT_S:g}"],
        ["torchft: step_s in this run before the kill (median, all ranks)", "",
         fmt(tf.get("step_s_before"))],
        ["kill -> survivors' next committed step (s)", fmt(e.get("total_s")),
         fmt(tf.get("next_commit_s"))],
        ["kill -> survivors' first commit in a new quorum, without the victim (s)", "",
         fmt(tf.get("new_quorum_s"))],
        ["survivors' steps aborted (not committed) meanwhile", "",
         str(tf.get("survivor_aborts", "n/a"))],
        ["kill -> the victim's group stopped by its agent (s)", "",
         fmt(tf.get("group_stopped_s"))],
        ["kill -> replacement spawned (s)", fmt(e.get("spawn_s")), fmt(tf.get("spawn_s"))],
        ["replacement: spawn -> imports done (torch, torchft) (s)", "",
         fmt(tf.get("imported_s"))],
        ["replacement: spawn -> its group's gloo world, model and FSDP2 shards built (s)", "",
         fmt(tf.get("built_s"))],
        ["replacement: spawn -> ready (elastrain: group built; torchft: manager built) (s)",
         fmt(e.get("group_s")), fmt(tf.get("ready_s"))],
        ["replacement: spawn -> heal received (s)", fmt(e.get("healed_s")),
         fmt(tf.get("heal_recv_s"))],
        ["replacement: spawn -> first committed step it takes part in (s)",
         fmt(e.get("first_step_s")), fmt(tf.get("first_step_s"))],
        ["kill -> the replacement trains (s)", fmt(e.get("kill_to_trains_s")),
         fmt(tf.get("kill_to_trains_s"))],
        ["heal: bytes received per replacement rank (MB)", mb(e.get("heal_bytes"), 2),
         per_rank(tf.get("heal_bytes", {}), lambda v: mb(v, 2))],
        [f"heal: a shard's state, state / {SHARDS} / full state (MB)",
         f"{mb(max(sizes['shard']), 2)} / {mb(sizes['full'], 2)}", ""],
        ["heal: seconds (receiver)", fmt(e.get("heal_s")),
         per_rank(tf.get("heal_seconds", {}), fmt)],
        ["survivors' steps committed without the victim group's share of the batch",
         "none (the resumed step computes all)", str(tf.get("alone_steps", "n/a"))],
    ]  # fmt: skip
    return table(
        [f"recovery: 1 SIGKILL (torchft: rank {r} of group {g})", LABELS["E"], LABELS[TFT]], rows
    )


def torchft_status() -> tuple[bool, str]:
    """Whether torchft and its lighthouse are installed here (this benchmark installs
    nothing), and a line saying so."""
    if importlib.util.find_spec("torchft") is None:
        return False, f"torchft is not installed here ({TFT_INSTALL})"
    if not Path(lighthouse_argv(0, 0)[0]).exists():
        return False, f"torchft is importable but {lighthouse_argv(0, 0)[0]} is missing"
    try:
        from importlib.metadata import version

        v = version("torchft")
    except Exception:
        v = "?"
    return True, f"torchft {v}"


# ---- report tables -----------------------------------------------------------------------


def mb(nbytes: float | None, nd: int = 1) -> str:
    return "n/a" if nbytes is None else f"{nbytes / 1e6:.{nd}f}"


def steady_table(st: dict[str, Any], block: int, blocks: int) -> tuple[str, str, dict]:
    """The steady-state comparison and its per-block detail. Returns the two tables
    and the derived numbers the targets use. One column per side, then the
    differences `COMPARED` names (each elastrain side against both HSDPs, torchft
    against plain HSDP)."""
    keys = st["keys"]
    pairs = [(a, b) for a, b in COMPARED if a in keys and b in keys]
    meds = {k: med(st["step_s"][k]) for k in keys}
    bl = st["blocks"]
    bs = block_stats(bl, keys, block, blocks)
    bw, cps, idle_share = bs["wall"], bs["cpu"], bs["idle"]
    header = ["steady state (4 ranks, interleaved)", *(LABELS[k] for k in keys)]
    header += [f"{LABELS[a]} vs {LABELS[b]}" for a, b in pairs]

    def row(name: str, vals: dict[str, float]) -> list[str]:
        return [name, *(fmt(vals[k]) for k in keys), *(pct(vals[a], vals[b]) for a, b in pairs)]

    def cells(name: str, per_side: Callable[[str], str]) -> list[str]:
        return [name, *(per_side(k) for k in keys), *([""] * len(pairs))]

    rows = [
        row("median step_s, all ranks (s)", meds),
        row("wall per step, median over blocks (s)", bw),
        row("CPU s per step, all processes of the side (median over blocks)", cps),
        cells("step_s samples (ranks x steps)", lambda k: str(len(st["step_s"][k]))),
        cells("elastrain compute_s / twins' all-reduce_s (median)",
              lambda k: f"{fmt(med(st['el'][k]['compute_s']))} / "
                        f"{fmt(med(st['el'][k]['allreduce_s']))}" if k in st["el"] else ""),
        cells("HSDP last micro-batch (fwd+bwd+reduce) / optimizer (torchft: with should_commit) "
              "(median)",
              lambda k: f"{fmt(med(st[f'{k}_last_s']))} / {fmt(med(st[f'{k}_opt_s']))}"
                        if k in PROC_KEYS else ""),
        cells("CPU used while idle, waiting its turn (% of a core)",
              lambda k: fmt(idle_share[k] * 100, 1)),
    ]  # fmt: skip
    per_block = table(
        ["block", "side", "wall per step (s)", "CPU s per step", "load avg (1 min)"],
        [[str(b["k"]), LABELS[b["side"]], fmt((b["t1"] - b["t0"]) / block),
          fmt(b["cpu_s"] / block), fmt(b.get("load", math.nan), 1)] for b in bl],
    )  # fmt: skip
    return table(header, rows), per_block, {"meds": meds}


def rss_table(rss: dict[str, list[dict[str, Any]]], sizes: dict[str, Any]) -> tuple[str, dict]:
    """Resident size per rank (medians over ranks; max for the peak too)."""
    keys = [k for k in RSS_LABELS if rss.get(k)]

    def kb(k: str, field: str, how: Callable[[list[float]], float] = med) -> float:
        xs = [r[field] * 1024 for r in rss[k] if r.get(field, -1) >= 0]
        return how(xs) if xs else math.nan

    full = sizes["full"]
    shard = max(sizes["shard"])
    above = {k: med([(r["hwm_kb"] - r["rss_imports_kb"]) * 1024 for r in rss[k]]) for k in keys}
    rows = [
        ["ranks reporting"] + [str(len(rss[k])) for k in keys],
        ["after the imports, before the model (MB)"] + [mb(kb(k, "rss_imports_kb")) for k in keys],
        ["after building the full model (MB)"] + [mb(kb(k, "rss_built_kb")) for k in keys],
        ["HSDP: after fully_shard (AdamW's moments come at the first step) (MB)"]
        + [mb(kb(k, "rss_sharded_kb")) if k in PROC_KEYS else "" for k in keys],
        ["at the end (MB)"] + [mb(kb(k, "rss_end_kb")) for k in keys],
        ["peak, VmHWM: median over ranks (MB)"] + [mb(kb(k, "hwm_kb")) for k in keys],
        ["peak, VmHWM: max over ranks (MB)"] + [mb(kb(k, "hwm_kb", max)) for k in keys],
        ["peak - after the imports, median (MB)"] + [mb(above[k]) for k in keys],
        ["(peak - after the imports) / full training state"]
        + [fmt(above[k] / full, 2) for k in keys],
        # How much of the full model's parameters anything still holds at the end
        # (the job script drops its own references): a sharded member needs only its
        # rows; the replicated trainer trains those very parameters.
        ["full model's parameter bytes still held at the end, max over ranks (MB)"]
        + [mb(max((r.get("full_params_bytes", 0) for r in rss[k]), default=0))
           if k in (*ELASTRAIN_SIDES, "R") else "" for k in keys],
    ]  # fmt: skip
    head = ["resident size per rank"] + [RSS_LABELS[k] for k in keys]
    note = (
        f"full training state {mb(full)} MB (params {mb(sizes['params_bytes'])} MB + AdamW's "
        f"two moments), state / {SHARDS} = {mb(shard)} MB (largest shard)"
    )
    return table(head, rows) + "\n\n" + note, {"above": above}


def recovery_tables(
    rc: dict[str, Any], sizes: dict[str, Any], lb: dict[str, Any] | None, step_s: float
) -> tuple[str, str, dict[str, Any]]:
    """Kill -> next commit and phases; the replacement's join and heal against the
    loopback broadcast and the shard's state."""
    recs, js, events = rc["recs"], rc["joins"], rc["events"]
    r = recs[0] if recs else None
    gs, first = first_step_breakdown(events, recs)
    rows = [
        ["kill -> next commit (s)", fmt(r.total_s if r else None)],
        *[[f"  {name}", fmt(r.phase(name) if r else None)] for name in PHASES],
        ["    within first_step: group built -> generation start (FSDP2 wrapper, state hash)",
         fmt(gs[0] if gs else None)],
        ["    within first_step: the resumed step's step_s (one group computes all "
         "micro-batches)", fmt(first[0] if first else None)],
        [f"target: {TARGET_RECOVERY_FIXED_S:g} s + one steady step ({fmt(step_s)} s)",
         fmt(TARGET_RECOVERY_FIXED_S + step_s)],
    ]  # fmt: skip
    victim = r.member if r else None
    vslot = rc["slots"].get(victim or "", (None, None))
    repl = r.replacement if r else None
    j = next((x for x in js if x.member == repl), None)
    recv = [e for e in rc["heal_ends"] if e["proc"] == repl and e.get("role") == "recv"]
    send = [e for e in rc["heal_ends"] if e.get("role") == "send" and e["gen"] in {x["gen"] for x in recv}]  # fmt: skip
    h = recv[0] if recv else None
    expect = sizes["shard"][vslot[1]] if vslot[1] is not None else max(sizes["shard"])
    lb_med = lb["median"] if lb else math.nan
    lb_fresh = lb["fresh_median"] if lb else math.nan
    rate = float(h["rate_mb_s"]) if h else math.nan
    jrows = [
        [f"victim {victim} (replica {vslot[0]}, shard {vslot[1]}); replacement", str(repl)],
        *[[f"spawn -> {lab} (s)", fmt(getattr(j, attr) if j else None)]
          for lab, attr in (("registered", "registered_s"), ("group built", "group_s"),
                            ("healed", "healed_s"), ("first step", "first_step_s"))],
        ["heal: bytes received (MB)", mb(h["bytes"] if h else None, 2)],
        [f"heal: its shard's state, state / {SHARDS} (MB)", mb(expect, 2)],
        ["heal: full training state (MB)", mb(sizes["full"], 2)],
        ["heal: received / shard's state", fmt(h["bytes"] / expect if h else None, 3)],
        ["heal: senders (heal_end role send) and bytes sent (MB)",
         ", ".join(f"{e['proc']} {mb(e['bytes'], 2)}" for e in send) or "none"],
        ["heal: seconds (whole heal call, receiver)", fmt(float(h["seconds"]) if h else None)],
        ["heal: rate (MB/s)", fmt(rate, 1)],
        [f"loopback gloo broadcast of {mb(lb['bytes'] if lb else None, 2)} MB, median of "
         f"{len(lb['rates']) if lb else 0} (MB/s)", fmt(lb_med, 1)],
        ["loopback broadcast min / max (MB/s)",
         f"{fmt(min(lb['rates']), 1)} / {fmt(max(lb['rates']), 1)}" if lb and lb["rates"] else "n/a"],
        ["heal rate / loopback rate", fmt(rate / lb_med if lb_med > 0 else math.nan, 2)],
        ["loopback broadcast into fresh memory each time, median (MB/s)", fmt(lb_fresh, 1)],
        ["heal rate / fresh-memory loopback rate (the heal lands in memory it has not "
         "touched yet)", fmt(rate / lb_fresh if lb_fresh > 0 else math.nan, 2)],
    ]  # fmt: skip
    t1 = table(["recovery: 1 SIGKILL in a 2x2 job", "seconds"], rows)
    t2 = table(["the replacement's join and heal", "value"], jrows)
    derived = {
        "total_s": r.total_s if r else None,
        "heal_bytes": h["bytes"] if h else None,
        "expect": expect,
        "rate": rate,
        "lb_med": lb_med,
        "lb_fresh": lb_fresh,
        "healed": h is not None,
        "committed": j is not None and j.first_step_s is not None,
        # For the torchft table: the replacement's timeline from the kill and its spawn.
        "spawn_s": j.spawned_t - r.t0 if j and r else None,
        "group_s": j.group_s if j else None,
        "healed_s": j.healed_s if j else None,
        "first_step_s": j.first_step_s if j else None,
        "kill_to_trains_s": (
            j.spawned_t - r.t0 + j.first_step_s if j and r and j.first_step_s is not None else None
        ),
        "heal_s": float(h["seconds"]) if h else None,
    }
    return t1, t2, derived


# ---- main --------------------------------------------------------------------------------


def main(script: str = "sharded.py", parts: str | None = None) -> int:
    """`parts` None: the `--parts` option decides; "kill": only the two kills, recorded
    as `script`'s run (benchmarks/sharded_kills.py)."""
    bench = Bench(script, __doc__, quick="smoke run: tiny model, few steps")
    ap = bench.ap
    ap.add_argument("--dim", type=int, default=None, help="model width (256; --quick 64)")
    ap.add_argument("--layers", type=int, default=None, help="transformer blocks (8; --quick 2)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (4; --quick 2)")
    ap.add_argument("--warmup", type=int, default=None, help="steady warm-up steps (4; --quick 2)")
    ap.add_argument("--block-steps", type=int, default=None, help="steps per block (4; --quick 3)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per side (8; --quick 2)")
    ap.add_argument("--kill-step", type=int, default=8, help="step of the SIGKILL (8)")
    ap.add_argument("--victim", default="w1", help="member killed (w1)")
    ap.add_argument(
        "--settle", type=int, default=3, help="steps the replacement's generation commits (3)"
    )
    ap.add_argument("--bcast-reps", type=int, default=None, help="loopback broadcasts (10; 3)")
    ap.add_argument(
        "--tft-heartbeat-ms", type=int, default=TFT_HEARTBEAT_MS,
        help=f"torchft lighthouse heartbeat timeout ({TFT_HEARTBEAT_MS}: its default)",
    )  # fmt: skip
    ap.add_argument("--no-torchft", action="store_true", help="leave torchft's side out")
    if parts is None:
        ap.add_argument(
            "--parts", choices=["all", "kill"], default="all",
            help="all (default), or kill: only an early and a late kill (KILL_POINTS), "
            "each against 0.5 s + the run's own step, recorded as sharded.py's run (use "
            "benchmarks/sharded_kills.py to record them as their own benchmark)",
        )  # fmt: skip
    args = bench.parse()
    parts = parts or args.parts
    q = args.quick
    base_shape = QUICK_SHAPE if q else FULL_SHAPE
    shape = Shape(
        dim=args.dim or base_shape.dim,
        layers=args.layers or base_shape.layers,
        heads=args.heads or base_shape.heads,
        block=base_shape.block,
        global_batch=base_shape.global_batch,
        micro_batch=base_shape.micro_batch,
    )
    warmup = args.warmup if args.warmup is not None else (2 if q else 4)
    block = args.block_steps if args.block_steps is not None else (3 if q else 4)
    blocks = args.blocks if args.blocks is not None else (2 if q else 8)
    reps = args.bcast_reps if args.bcast_reps is not None else (3 if q else 10)
    if warmup < 1 or block < 2 or blocks < 1 or reps < 1 or args.settle < 1:
        ap.error("need --warmup >= 1, --block-steps >= 2, --blocks >= 1, --bcast-reps >= 1")
    if shape.dim % shape.heads:
        ap.error(f"--dim {shape.dim} is not a multiple of --heads {shape.heads}")
    mbs = shape.global_batch // shape.micro_batch
    if mbs % WORKERS:
        ap.error(f"{mbs} micro-batches per step do not split evenly over {WORKERS} ranks")
    if parts == "kill":
        return kills_only(bench, shape, args.kill_step, args.victim, q)

    t_wall0 = time.time()
    load0 = os.getloadavg()[0]
    load = bench.load
    assert load is not None
    cores = os.cpu_count()
    import torch

    tft_ok, tft_line = torchft_status()
    if args.no_torchft:
        tft_ok, tft_line = False, f"{tft_line}; left out (--no-torchft)"
    log(f"torchft: {tft_line}" + ("" if tft_ok else ": no torchft side"))
    sizes = state_bytes(shape, SHARDS)
    base = bench.run_dir("sharded")
    log(f"load average now {load0:.1f} on {cores} cores")
    log(f"model: demo GPT dim={shape.dim} layers={shape.layers} heads={shape.heads} "
        f"block={shape.block}: {sizes['params']:,} parameters; full training state "
        f"{mb(sizes['full'])} MB (params + AdamW's 2 moments), per shard "
        f"{', '.join(mb(x) for x in sizes['shard'])} MB")  # fmt: skip
    log(f"{WORKERS} ranks as {WORKERS // SHARDS} x {SHARDS}, global batch {shape.global_batch}, "
        f"micro-batch {shape.micro_batch}, 1 thread per process; run dirs under {base}")  # fmt: skip
    anomalies: list[str] = []

    # ---- 1. steady state -----------------------------------------------------------------
    side_keys = ["H", *ELASTRAIN_SIDES, *list(BASELINES)[1:]] + ([TFT] if tft_ok else [])
    log(f"steady state: {', '.join(LABELS[k] for k in side_keys)} "
        f"together, {warmup} warm-up steps, then {blocks} blocks of {block} steps each")  # fmt: skip
    t = time.monotonic()
    try:
        st = measure_steady(
            shape, warmup, block, blocks, base / "steady", timeout_s=300 if q else 900,
            tft_heartbeat_ms=args.tft_heartbeat_ms if tft_ok else None,
        )  # fmt: skip
    except (RuntimeError, TimeoutError) as err:
        print(f"\nFATAL: steady-state comparison failed: {err}; nothing recorded.")
        load.stop()
        return 1
    steady_wall = time.monotonic() - t
    for b in st["blocks"]:
        b["load"] = load.mean(b["t0"] - 2, b["t1"] + 2)
    for k, el in st["el"].items():
        if why := not_steady(el["status"], el, WORKERS, LABELS[k], el["dir"]):
            anomalies.append(why)
    n_meas = WORKERS * blocks * (block - 1)
    if st["tft_error"]:
        anomalies.append(st["tft_error"])
    if st.get("T_aborts"):
        anomalies.append(
            f"torchft HSDP: {len(st['T_aborts'])} step(s) not committed in the failure-free "
            f"steady state, e.g. {st['T_aborts'][0].get('error')} ({st['dir']})"
        )
    for k in st["keys"]:
        if len(st["step_s"][k]) != n_meas:
            anomalies.append(f"{LABELS[k]}: {len(st['step_s'][k])} step_s samples, not {n_meas}")
        if len(st["rss"][k]) != WORKERS:
            anomalies.append(f"{LABELS[k]}: {len(st['rss'][k])} of {WORKERS} ranks reported RSS")
    # Same model, data and math: the losses agree until float rounding (elastrain's exact
    # float64 sum, or native's sums in another order, against FSDP2's reductions) grows
    # through the optimizer.
    agree = min(10, st["steps"])
    loss_dev = max(
        abs(st["loss"][e].get(i, math.nan) - st["loss"][k].get(i, math.nan))
        / abs(st["loss"][k].get(i, math.nan))
        for e in ELASTRAIN_SIDES
        for k in BASELINES
        for i in range(agree)
    )
    if not loss_dev <= 1e-4:
        anomalies.append(
            f"elastrain and HSDP losses differ by {loss_dev:.1e} (relative) within the first "
            f"{agree} steps: the sides do not train the same thing ({st['dir']})"
        )
    tft_loss_dev = (
        max(
            abs(st["loss"][TFT].get(i, math.nan) - st["loss"]["H"].get(i, math.nan))
            / abs(st["loss"]["H"].get(i, math.nan))
            for i in range(agree)
        )
        if TFT in st["keys"]
        else None
    )
    if tft_loss_dev is not None and not tft_loss_dev <= 1e-4:
        anomalies.append(
            f"torchft HSDP and HSDP losses differ by {tft_loss_dev:.1e} (relative) within "
            f"the first {agree} steps: they do not train the same thing ({st['dir']})"
        )
    t_steady, t_blocks, sd = steady_table(st, block, blocks)
    meds = sd["meds"]
    overheads = {k: meds[k] / meds["H"] - 1 if meds["H"] > 0 else math.nan for k in ELASTRAIN_SIDES}
    meets = [LABELS[k] for k, ov in overheads.items() if ov <= TARGET_OVERHEAD]
    misses = [LABELS[k] for k, ov in overheads.items() if not ov <= TARGET_OVERHEAD]
    meets_line = (
        f"steady overhead target (<= {TARGET_OVERHEAD:.0%} vs plain HSDP): met by "
        f"{', '.join(meets) or 'neither elastrain side'}"
        + (f"; not met by {', '.join(misses)}" if misses else "")
    )
    log(f"steady state done in {steady_wall:.0f} s: median step_s "
        + ", ".join(f"{LABELS[k]} {fmt(v)}" for k, v in meds.items())
        + "".join(f"; {LABELS[k]} vs HSDP {ov * 100:+.1f}%" for k, ov in overheads.items())
        + (f"; torchft HSDP vs HSDP {pct(meds[TFT], meds['H'])}" if TFT in meds else ""))  # fmt: skip

    # ---- 2. the replicated job's RSS, for reference -----------------------------------------
    rep_steps = 2 if q else 4
    log(f"replicated elastrain run ({rep_steps} steps, shard size 1) for its RSS")
    rep = measure_replicated_rss(shape, rep_steps, base / "replicated", timeout_s=300)
    if rep["status"] != "done" or len(rep["rss"]) != WORKERS:
        anomalies.append(
            f"replicated reference run: status {rep['status']}, {len(rep['rss'])} of {WORKERS} "
            f"ranks reported RSS ({rep['dir']})"
        )
    rss = {**st["rss"], "R": rep["rss"]}
    t_rss, rs = rss_table(rss, sizes)
    held = sum(r.get("full_params_bytes", 0) > 0 for r in rss["E"])
    held_note = (
        f"{held} of {len(rss['E'])} elastrain 2x2 ranks still held storage of the full model's "
        f"parameters ({mb(sizes['params_bytes'])} MB in all) at their end, after the job "
        "script dropped its own references: something in the trainer keeps it beside the shard"
        if held
        else "no elastrain 2x2 rank held the full model's parameters at its end"
    )

    # ---- 3. recovery, then the loopback reference -------------------------------------------
    log(f"recovery run: kill@{args.kill_step}:{args.victim}, replace delay 1 s, stop once the "
        f"replacement's generation committed {args.settle} steps")  # fmt: skip
    t_kill0 = time.time()
    rc = measure_recovery(
        shape, args.kill_step, args.victim, args.settle, base / "kill", timeout_s=300 if q else 420
    )
    how = "stopped once the replacement trained" if rc["pacer_done"] else "did not finish"
    log(f"recovery run {how} (status {rc['status']}) in {rc['wall_s']:.1f} s ({rc['dir']})")
    if rc["stalled"] or not rc["recs"]:
        why = "no step committed for 90 s" if rc["stalled"] else "the kill was not injected"
        anomalies.append(f"recovery run unusable: {why} ({rc['dir']})")
    elif not rc["pacer_done"]:
        anomalies.append(
            f"recovery run ended {rc['status']!r} before its replacement trained ({rc['dir']})"
        )
    victim_shard = rc["slots"].get(rc["recs"][0].member if rc["recs"] else "", (None, None))[1]
    nbytes = sizes["shard"][victim_shard] if victim_shard is not None else max(sizes["shard"])
    log(f"loopback gloo broadcast of {mb(nbytes, 2)} MB between 2 processes, {reps} times")
    lb: dict[str, Any] | None
    try:
        lb = measure_loopback(nbytes, reps, base / "loopback", timeout_s=120)
    except (RuntimeError, subprocess.TimeoutExpired) as err:
        anomalies.append(f"loopback broadcast failed: {err}")
        lb = None
    t_rec, t_join, rd = recovery_tables(rc, sizes, lb, meds["E"])
    if rc["recs"] and not rd["healed"]:
        anomalies.append(f"the replacement has no heal_end as receiver ({rc['dir']})")
    if rc["recs"] and not rd["committed"]:
        anomalies.append(f"the replacement never committed a step ({rc['dir']})")
    refused = [e for e in rc["heal_ends"] if e.get("refused")]
    if refused:
        anomalies.append(f"{len(refused)} heal(s) refused a sender ({rc['dir']})")
    origin = next((e["t"] for e in rc["events"] if e["kind"] == "job_start"), None)
    detail_rec = format_recoveries(rc["recs"], origin)
    detail_join = format_joins(rc["joins"], origin)
    survivors = rc["recs"][0].survivors if rc["recs"] else []
    kept = [m for m in survivors if len(rc["pids"].get(m, [])) == 1]

    # ---- 3b. a reshard in memory and back -------------------------------------------------
    log(f"reshard run: kill@{args.kill_step}:w1 with its replacement held 20 s, "
        "--reshard-after 2: 2x2 -> 1x3 in memory, then back to 2x2")  # fmt: skip
    rsh = measure_reshard(shape, args.kill_step, base / "reshard", timeout_s=300 if q else 420)
    log(f"reshard run {'came back to 2x2' if rsh['back'] else 'did not come back'} "
        f"(status {rsh['status']}) in {rsh['wall_s']:.1f} s ({rsh['dir']})")  # fmt: skip
    if not rsh["back"]:
        anomalies.append(f"reshard run never came back to 2x2 ({rsh['dir']})")
    r_rows = reshard_rows(rsh, sizes["full"])
    t_reshard = table(["gen", "regroup", "members", "moved", "time"], r_rows)

    # ---- 3b'. recovery with a hot spare -----------------------------------------------------
    log(f"recovery run with 1 hot spare: kill@{args.kill_step} (a seeded member of the "
        "generation, never the standby), the spare takes the slot")  # fmt: skip
    sp = measure_recovery(
        shape, args.kill_step, args.victim, args.settle, base / "kill-spare",
        timeout_s=300 if q else 420, spares=1,
    )  # fmt: skip
    sp_rec = sp["recs"][0] if sp["recs"] else None
    sp_promoted = sp_rec.promoted[0] if sp_rec and sp_rec.promoted else None
    sp_recv = [e for e in sp["heal_ends"] if e["proc"] == sp_promoted and e.get("role") == "recv"]
    sp_heal = sp_recv[0] if sp_recv else None
    log(f"spare recovery run (status {sp['status']}) in {sp['wall_s']:.1f} s: promoted "
        f"{sp_promoted}, kill -> next commit {fmt(sp_rec.total_s if sp_rec else None)} s "
        f"({sp['dir']})")  # fmt: skip
    if sp_rec is None:
        anomalies.append(f"spare recovery run: the kill was not injected ({sp['dir']})")
    elif sp_promoted is None:
        anomalies.append(
            f"spare recovery run: no spare was promoted (not registered by the kill?) ({sp['dir']})"
        )
    sp_phases = (
        " (" + ", ".join(f"{n} {fmt(sp_rec.phase(n))}" for n in PHASES) + ")" if sp_rec else ""
    )
    sp_own = steps_before(sp["events"], sp_rec.t0) if sp_rec else None
    sp_line = (
        f"{fmt(sp_rec.total_s if sp_rec else None)} s{sp_phases}; spare {sp_promoted} healed "
        f"{mb(sp_heal['bytes'] if sp_heal else None, 2)} MB at "
        f"{fmt(float(sp_heal['rate_mb_s']) if sp_heal else None, 1)} MB/s"
    )

    # ---- 3c. torchft's recovery ------------------------------------------------------------
    tf: dict[str, Any] = {}
    t_tft = ""
    tft_rec_line = "not run: " + tft_line
    if tft_ok:
        log(f"torchft recovery run: SIGKILL of rank {TFT_VICTIM[1]} of replica group "
            f"{TFT_VICTIM[0]} at step {args.kill_step}, lighthouse heartbeat timeout "
            f"{args.tft_heartbeat_ms} ms, the group restarted 1 s after it stopped")  # fmt: skip
        try:
            rt = measure_tft_recovery(
                shape, args.kill_step, args.settle, base / "tft-kill",
                timeout_s=300 if q else 420, heartbeat_ms=args.tft_heartbeat_ms,
            )  # fmt: skip
        except Exception as err:  # torchft's failure is a result to report, not a crash
            anomalies.append(f"torchft recovery run failed: {type(err).__name__}: {err}")
            rt = None
        if rt is not None:
            tf = tft_recovery_figures(rt)
            log(f"torchft recovery run {'done' if rt['done'] else 'did NOT finish'} in "
                f"{rt['wall_s']:.1f} s ({rt['dir']})")  # fmt: skip
            anomalies += [f"torchft recovery run: {d}" for d in rt["deaths"]]
            if not rt["kill"]:
                anomalies.append(f"torchft recovery run: the kill was not injected ({rt['dir']})")
            elif not rt["done"]:
                anomalies.append(
                    f"torchft recovery run: the restarted group did not commit {args.settle} "
                    f"steps in time ({rt['dir']})"
                )
            t_tft = tft_recovery_table(tf, rt, sizes, {**rd, "step_s": meds["E"]})
            tft_rec_line = (
                f"kill -> survivors' next commit {fmt(tf.get('next_commit_s'))} s (new quorum "
                f"{fmt(tf.get('new_quorum_s'))} s) at a {args.tft_heartbeat_ms / 1000:g} s "
                f"heartbeat timeout; restarted group trains {fmt(tf.get('kill_to_trains_s'))} s "
                f"after the kill, healed "
                + (", ".join(mb(v, 2) for v in tf.get("heal_bytes", {}).values()) or "n/a")
                + " MB per rank"
            )

    # ---- report ------------------------------------------------------------------------------
    limit = TARGET_RECOVERY_FIXED_S + meds["E"]
    tot = rd["total_s"]
    heal_frac = rd["rate"] / rd["lb_med"] if rd["lb_med"] > 0 else math.nan
    hb = rd["heal_bytes"]
    target_rows = (
        [
            *([f"steady step_s overhead vs plain HSDP <= {TARGET_OVERHEAD:.0%}: {LABELS[k]} "
               f"(reduce_dtype {ELASTRAIN_SIDES[k][1]}"
               f"{', exact, the default' if k == 'E' else ''})",
               f"{ov * 100:+.1f}% ({fmt(meds[k])} s vs {fmt(meds['H'])} s)",
               verdict(None if math.isnan(ov) else ov <= TARGET_OVERHEAD)]
              for k, ov in overheads.items()),
            [f"kill -> next commit <= {TARGET_RECOVERY_FIXED_S:g} s + one step "
             f"(= {fmt(limit)} s)", f"{fmt(tot)} s",
             verdict(None if tot is None or math.isnan(limit) else tot <= limit)],
            [f"kill -> next commit <= {TARGET_RECOVERY_FIXED_S:g} s + one step (= "
             f"{fmt(limit)} s), 1 hot spare (`--spares 1`: the spare takes the dead rank's "
             "slot, no group runs short)", sp_line,
             verdict(None if sp_rec is None or sp_promoted is None or math.isnan(limit)
                     else sp_rec.total_s is not None and sp_rec.total_s <= limit)],
            [f"same, 1 hot spare, against that run's own steps before the kill (median "
             f"step_s {fmt(sp_own)} s: the same run, the same load; = "
             f"{fmt(TARGET_RECOVERY_FIXED_S + sp_own if sp_own else None)} s)",
             f"{fmt(sp_rec.total_s if sp_rec else None)} s",
             verdict(None if sp_rec is None or sp_promoted is None or sp_own is None
                     or sp_rec.total_s is None
                     else sp_rec.total_s <= TARGET_RECOVERY_FIXED_S + sp_own)],
            [f"replacement heal rate >= {TARGET_HEAL_FRACTION:.0%} of the loopback broadcast",
             f"{fmt(rd['rate'], 1)} MB/s = {fmt(heal_frac * 100, 0)}% of "
             f"{fmt(rd['lb_med'], 1)} MB/s (into fresh memory: "
             f"{fmt(rd['lb_fresh'], 1)} MB/s)",
             verdict(None if math.isnan(heal_frac) else heal_frac >= TARGET_HEAL_FRACTION)],
            [f"the heal moves state / {SHARDS}, not the full state (within "
             f"{HEAL_BYTES_TOLERANCE:.0%})",
             f"{mb(hb, 2)} MB received; shard {mb(rd['expect'], 2)} MB, full "
             f"{mb(sizes['full'], 2)} MB",
             verdict(None if hb is None
                     else abs(hb / rd["expect"] - 1) <= HEAL_BYTES_TOLERANCE)],
            ["peak RSS per rank against the full state (no threshold set)",
             ", ".join(f"{RSS_LABELS[k]} {fmt(v / sizes['full'], 2)}x"
                       for k, v in rs["above"].items()) + " (peak - after imports)",
             "report"],
            ["reshard time and bytes moved (no threshold set)",
             "; ".join(f"{r[1]}: {r[3]} in {r[4]}" for r in r_rows) or "no reshard seen",
             "report"],
            ["torchft HSDP beside ours (no threshold set)",
             (f"step_s {fmt(meds[TFT])} s ({pct(meds[TFT], meds['H'])} vs HSDP; elastrain "
              f"{pct(meds['E'], meds[TFT])} vs torchft); " if TFT in meds
              else f"steady state: {st['tft_error'] or 'not run: ' + tft_line}; ")
             + "recovery: " + tft_rec_line,
             "report"],
        ]
    )  # fmt: skip
    targets = table(["target", "measured", "verdict"], target_rows)
    notes = [
        f"model: demo GPT (dim {shape.dim}, {shape.layers} layers, {shape.heads} heads, context "
        f"{shape.block}, vocab 256): {sizes['params']:,} parameters; AdamW (lr {shape.lr}, "
        f"weight decay 0.01); full training state {mb(sizes['full'])} MB",
        f"{WORKERS} ranks as {WORKERS // SHARDS} replica groups x {SHARDS} shards, global batch "
        f"{shape.global_batch}, micro-batch {shape.micro_batch} ({mbs} micro-batches per step, "
        f"{mbs // WORKERS} per rank), torch.set_num_threads(1) in every process, gloo over "
        "loopback",
        f"{meets_line}. "
        f"every side clips its gradient to a global norm of {CLIP:g}. "
        "steady state: elastrain 2x2 (Launcher, shard_size 2, _jobs/sharded_gpt.py) with "
        "reduce_dtype float64 (exact: a float64 reduce-scatter per micro-batch, the default) "
        "and native (one float32 reduce-scatter per step, FSDP2's own accumulation, float32 "
        "twins' all-reduce), plain FSDP2 HSDP (_jobs/hsdp_gpt.py: 2-D mesh (replicate 2, shard 2), fully_shard on each "
        "block and the root, set_requires_gradient_sync(False) on all but each rank's last "
        "micro-batch, float32 reduction) and the same HSDP communicating like elastrain "
        "(float64 reduce-scatter after every micro-batch, one float64 all-reduce across "
        "the groups per step) alive together, taking turns: "
        f"{warmup} warm-up steps each (excluded), then {blocks} blocks of {block} steps per "
        f"side in the order {' '.join(side_keys)} | {' '.join(side_keys[::-1])} | ...; an "
        "idle side waits between steps. step_s "
        "medians leave out the first step of every block on every side. The overhead target "
        "is judged against plain HSDP, for both elastrain sides. The recovery and reshard "
        "runs below are the float64 default's. Same computation on every side: the per-step "
        "losses "
        f"agree within {loss_dev:.0e} (relative) over the first {agree} steps. "
        f"{steady_wall:.0f} s, run dir {st['dir'].relative_to(ROOT)}",
        "RSS: /proc VmRSS and VmHWM of each worker process, read by the worker itself (after "
        "its imports, after building the full model, at its end). Each member starts from the "
        "full materialised model (elastrain's sharded trainer needs one today; HSDP here does "
        "the same, for the same initial weights), so every peak includes the full parameters "
        f"({mb(sizes['params_bytes'])} MB). 'Peak - after the imports' also holds what every "
        "side allocates besides the model: the dataset (the corpus as int64, 16 MB), gloo's "
        "buffers, the allocator's slack. The replicated reference is a separate "
        f"{rep_steps}-step run of the same script with shard size 1 "
        f"({rep['dir'].relative_to(ROOT)}). {held_note}",
        f"recovery run: kill@{args.kill_step}:{args.victim}, replace_delay_s 1, the job stopped "
        f"once the replacement's generation committed {args.settle} steps; {rc['wall_s']:.0f} "
        f"s, run dir {rc['dir'].relative_to(ROOT)}; {len(kept)} of {len(survivors)} survivors "
        "kept a single PID (survivors are not restarted). The target's 'one step' is elastrain 2x2's "
        "median steady step_s; the resumed step is computed by one replica group alone (twice "
        "the micro-batches per rank), see its own row",
        f"recovery run with a hot spare: the same job with `spares=1` (a fifth worker "
        f"registered as a standby) and kill@{args.kill_step} of a member of the generation picked "
        "by the seeded fault schedule (which worker is the standby depends on who registered "
        "last); the failure's re-formed generation admits it into the dead "
        "rank's slot, it is healed that shard from its twin, and every generation has both "
        f"replica groups whole; {sp['wall_s']:.0f} s, run dir {sp['dir'].relative_to(ROOT)}",
        f"loopback reference: _jobs/loopback_bcast.py, one float32 tensor of the victim's shard "
        f"state size broadcast between 2 processes over gloo, {reps} times after a warm-up, "
        "right after the recovery run; the heal rate is the receiver's heal_end rate (payload "
        "bytes / the whole heal call: manifest, seals, verdicts)",
        f"torchft: {tft_line}. "
        + (
            "T (torchft HSDP): _jobs/torchft_hsdp_gpt.py, 2 replica groups x 2 ranks; each "
            "group a gloo world of its own with fully_shard on its 1-D shard mesh; across the "
            "groups a torchft lighthouse (min_replicas 1, quorum tick 100 ms, join timeout "
            f"10 s, heartbeat timeout {args.tft_heartbeat_ms} ms), a torchft.Manager per rank "
            f"(ProcessGroupGloo, timeout {TFT_PG_TIMEOUT_S:g} s; manager timeout 30 s), each "
            "FSDP module's all-reduce hook averaging over ManagedProcessGroup(manager), "
            "torchft.Optimizer around AdamW, init_sync off (same seeded weights), HTTP "
            "healing. Gated and interleaved with the other sides. "
            + (
                f"Its losses agree with HSDP's within {tft_loss_dev:.0e} (relative) over the "
                f"first {agree} steps. "
                if tft_loss_dev is not None
                else ""
            )
            + f"Recovery run: rank {TFT_VICTIM[1]} of group {TFT_VICTIM[0]} SIGKILLed at "
            f"kill@{args.kill_step} (elastrain's seeded mid-step offset); the benchmark, as the "
            "group's agent (torchrun --max-restarts per group in torchft's own setup), stops "
            "the group's other rank within ~20 ms and starts the group again 1 s later; it "
            "heals from the other group (rank r from rank r). Heal bytes: tensor bytes of "
            "the state torchft's HTTP transport delivered, counted by the job script. "
            "Survivors commit steps over their own share of the batch while alone (torchft's "
            "DYNAMIC world size): the rest of those steps' samples are not trained on"
            if tft_ok
            else "no torchft side"
        ),
        f"machine load (1-min load average, {cores} cores): {load0:.1f} at the start, "
        f"{load.mean(t_wall0, time.time()):.1f} mean over the benchmark, "
        f"{load.mean(t_kill0, t_kill0 + rc['wall_s']):.1f} during the recovery run",
    ]
    text = "\n\n".join(
        [targets, t_steady, t_blocks, t_rss, t_rec, t_join, t_reshard] + ([t_tft] if t_tft else [])
    )
    print()
    print(text)
    print()
    details = [
        targets, "", t_steady, "", t_blocks, "", t_rss, "", t_rec, "", t_join, "",
        "Regroups in memory (reshard run):", "", t_reshard, "",
        *(["torchft HSDP's recovery beside elastrain's:", "", t_tft, ""] if t_tft else []),
        "Per kill (seconds; t0 from job start):", "", "```", detail_rec, "```", "",
        "Per replacement (seconds from its spawn):", "", "```", detail_join, "```",
    ]  # fmt: skip
    judged, reported = targets_from_rows(target_rows)
    figures = [
        *(Figure(f"steady_overhead_pct[{LABELS[k]}]", f"steady step_s vs plain HSDP, {LABELS[k]}",
                 ov * 100, "%") for k, ov in overheads.items()),
        Figure("kill_to_next_commit_s", "kill -> next commit", tot, "s"),
        Figure("kill_to_next_commit_s[1 hot spare]", "kill -> next commit, 1 hot spare",
               sp_rec.total_s if sp_rec else None, "s"),
        Figure("heal_over_loopback", "heal rate / loopback broadcast rate", heal_frac, ""),
    ]  # fmt: skip
    bench.finish(
        f"torch {torch.__version__}, gloo over loopback",
        [f for f in figures if f.value is not None and math.isfinite(f.value)],
        judged, reported + notes, details, anomalies,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint storage benchmark (issue 3's benchmark acceptance).

Run from the repository root:

    .venv/bin/python benchmarks/checkpoint.py [--gib 1] [--shards 4] [--rounds 3] [--dir DIR]
        [--step-tokens 128] [--format flat|dcp] [--no-record]

The state is ``--gib`` GiB of float32 (tensors of 128 MiB plus a few small
ones) striped over ``--shards`` members that share this host's disk; each
member is simulated in this process by its own `Snapshot` and
`CheckpointWriter` (its own writer thread), as members on one host would be.
``--shards 1`` is one member writing the whole state. ``--format`` (default
flat): the files the members write. ``flat``: `Snapshot` stripes, `CheckpointWriter`,
`commit`, `load`. ``dcp``: a replicated job's ``--ckpt-format dcp`` checkpoint,
each member its rows of every tensor (`elastrain.checkpoint.replicated_parts`'s
split: torch.chunk's rows; the one-element tensor by member 0) as a
`ShardSnapshot` written by a `ShardedWriter` (one torch.save blob per chunk in a
``.distcp`` file), `commit_sharded` (also writes DCP's ``.metadata``), and the
restore reads every tensor with `ShardedReader`.

1. ``df -h`` of the target directory (default: a fresh directory under
   ``benchmarks/runs/``); refuses to run with less than 3.5x the state free.
2. ``--rounds`` saves (default 3), alternating with the reference
   ``dd if=/dev/zero of=<dir>/ddtest bs=4M count=N conv=fsync`` for the same
   number of bytes (dd, save, dd, save, ..., dd), because the disk is shared
   and its speed drifts; the reference is the median dd time. The first save
   is *cold* (fresh host buffers, page faults included); the others are
   *warm* (buffers reused with ``Snapshot.take(..., into=previous)``, the
   steady state of a training job). Each save is taken as a trainer takes
   it: `Snapshot.take` copies at once what forward may write and defers the
   parameters (``defer=``, every ``model/`` tensor here) to a background
   copy; then the training thread runs the next step's compute, which does
   not touch the state (a float32 matmul loop of 6 x N x T FLOPs: N = the
   state's bytes / 12, parameters of a model trained with Adam, whose state
   is the float32 parameters and two moments; T = ``--step-tokens`` tokens
   per member and step, default 128; its duration alone is measured first
   and printed); then it settles the copy (`DeferredCopy.settle`, what the
   trainer does before the next optimizer step). Per save: blocking time =
   the longest take of one member plus the training thread's wait from the
   end of the compute until every member's copy is settled (members take
   and settle in parallel in a real job; here takes run one after another,
   each timed alone); write time = all members' `save_async` until every
   shard file and manifest is durable (fsync included, and the copy the
   writers wait for); `commit` (reads and CRC-checks every shard) is reported
   apart. `apply_retention` with keep_last=1 runs after each commit. For
   comparison, in the same round, the old synchronous `Snapshot.take` (no
   ``defer``) of the same state into the same warm buffers is timed (and not
   written).
3. Restore: this benchmark's files are dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` (only these files), then `latest_verified`
   (reads and CRC-checks every shard) and `load` (reads them again into new
   tensors) are timed; the restored state is compared bit for bit.
4. Prints a table and records the run in benchmarks/results/ (unless
   --no-record) with date, machine, command and PASS/FAIL for the targets,
   judged on the warm saves' medians: blocking <= 5% of the write time,
   write throughput >= 70% of dd. Deletes everything it wrote. Takes about
   2 minutes for 1 GiB on a disk of about 150 MB/s.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _harness import Bench, Figure, log, target  # noqa: E402

from elastrain.checkpoint import (  # noqa: E402
    CheckpointConfig,
    CheckpointFormat,
    CheckpointWriter,
    Snapshot,
    apply_retention,
    commit,
    latest_verified,
    load,
)
from elastrain.checkpoint.dcp import (  # noqa: E402
    ShardedReader,
    ShardedWriter,
    ShardParts,
    ShardSnapshot,
    commit_sharded,
)
from elastrain.checkpoint.replicated_parts import replicated_parts  # noqa: E402
from elastrain.transfer import TorchState  # noqa: E402

MIB = 1 << 20


def make_state(gib: float) -> dict[str, torch.Tensor]:
    total = int(gib * 1024 * MIB) // 4 * 4  # whole float32s (else the loop never ends)
    g = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    i = 0
    while total > 0:
        n = min(128 * MIB, total) // 4
        state[f"model/layer{i}.weight"] = torch.rand(n, generator=g)
        state[f"model/layer{i}.bias"] = torch.rand(1000, generator=g)
        total -= n * 4
        i += 1
    state["optim/step"] = torch.tensor(1234.0)
    return state


def drop_cache(path: Path) -> None:
    """posix_fadvise(DONTNEED) on every file under ``path`` (only our own files)."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def run_dd(d: Path, nbytes: int) -> float:
    """Seconds for dd to write ``nbytes`` (rounded up to 4 MiB) with conv=fsync."""
    count = -(-nbytes // (4 * MIB))
    target = d / "ddtest"
    t0 = time.perf_counter()
    subprocess.run(
        ["dd", "if=/dev/zero", f"of={target}", "bs=4M", f"count={count}", "conv=fsync"],
        check=True,
        capture_output=True,
    )
    seconds = time.perf_counter() - t0
    drop_cache(target)
    target.unlink()
    return seconds * nbytes / (count * 4 * MIB)  # scaled to exactly nbytes


MATMUL_N = 1024
"""The compute's matmuls are MATMUL_N x MATMUL_N float32 (2 x MATMUL_N^3 FLOPs each)."""


def step_compute(state_bytes: int, tokens: int) -> tuple[Callable[[], float], float]:
    """The next step's compute for a model with ``state_bytes`` of parameters and Adam
    state: a matmul loop of 6 x N x ``tokens`` FLOPs on tensors of its own (it reads
    and writes nothing of the state). Returns (run it -> seconds, GFLOP per step)."""
    params = state_bytes // 12
    flops = 6 * params * tokens
    a, b = torch.randn(MATMUL_N, MATMUL_N), torch.randn(MATMUL_N, MATMUL_N)
    out = torch.empty(MATMUL_N, MATMUL_N)
    iters = max(1, round(flops / (2 * MATMUL_N**3)))

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        return time.perf_counter() - t0

    return run, iters * 2 * MATMUL_N**3 / 1e9


@dataclass(frozen=True)
class SaveTimes:
    """One round's seconds: the deferred save as a trainer takes it, and the old take."""

    take: float
    """The longest member's `Snapshot.take` (what it copies at once)."""
    wait: float
    """From the end of the next step's compute until every member's copy settled."""
    compute: float
    """The next step's compute, overlapping the deferred copy (and the writes)."""
    write: float
    """From the first `save_async` until every shard is durable."""
    commit: float
    """`commit`: verify every shard, write the marker."""
    sync: float
    """The longest member's old synchronous `Snapshot.take` of the same state."""
    sync_compute: float
    """The next step's compute overlapping the old way's write (no deferred copy)."""

    @property
    def blocking(self) -> float:
        """The training thread's blocking: the take plus its wait at the mutation point."""
        return self.take + self.wait


Snap = Snapshot | ShardSnapshot


class _Layers(torch.nn.Module):
    """This state's ``model/`` tensors as a model's parameters, aliasing them (no copy),
    so that a DCP checkpoint of it is split by elastrain's own `replicated_parts`, as
    a replicated job's is. The state's one-element ``optim/step`` has no place in it
    (an SGD without momentum keeps no optimizer state): 4 bytes of a flat save only."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, t in state.items():
            if not name.startswith("model/"):
                continue
            layer, kind = name.removeprefix("model/").split(".")
            if not hasattr(self, layer):
                self.add_module(layer, torch.nn.Module())
            getattr(self, layer).register_parameter(
                kind, torch.nn.Parameter(t, requires_grad=False)
            )


def dcp_parts(model: TorchState, shard: int, shards: int, defer: bool) -> ShardParts:
    """Member ``shard``'s part of a replicated DCP checkpoint of ``model``
    (`replicated_parts`); ``defer`` False: every chunk copied on the training thread
    (the old synchronous way)."""
    parts = replicated_parts(model, {}, shard, shards)
    if not defer:
        parts = ShardParts(
            parts.tensors, [dataclasses.replace(c, defer=False) for c in parts.chunks], parts.meta
        )
    return parts


def take(
    fmt: CheckpointFormat,
    state: dict[str, torch.Tensor] | TorchState,
    step: int,
    shards: int,
    prev: list[Snap] | None,
    defer: bool,
) -> list[Snap]:
    """Every member's snapshot (``into`` its previous one: warm buffers)."""
    if isinstance(state, TorchState):
        return [
            ShardSnapshot.take(
                dcp_parts(state, i, shards, defer),
                shard=i,
                num_shards=shards,
                into=p if isinstance(p := prev[i] if prev else None, ShardSnapshot) else None,
            )
            for i in range(shards)
        ]
    assert fmt == CheckpointFormat.FLAT
    stable = frozenset(n for n in state if n.startswith("model/")) if defer else frozenset()
    return [
        Snapshot.take(
            state,
            {"step": step},
            shard=i,
            num_shards=shards,
            into=p if isinstance(p := prev[i] if prev else None, Snapshot) else None,
            defer=stable,
        )
        for i in range(shards)
    ]


def writers(fmt: CheckpointFormat, d: Path, shards: int) -> list[CheckpointWriter]:
    cls = ShardedWriter if fmt == CheckpointFormat.DCP else CheckpointWriter
    return [cls(CheckpointConfig(directory=str(d))) for _ in range(shards)]


def one_save(
    fmt: CheckpointFormat,
    d: Path,
    step: int,
    state: dict[str, torch.Tensor] | TorchState,
    shards: int,
    prev: list[Snap] | None,
    compute: Callable[[], float],
) -> tuple[SaveTimes, list[Snap]]:
    """One checkpoint by ``shards`` members with the next step's compute overlapping
    its deferred copy, then the old synchronous take into the same buffers."""
    members = [f"w{i}" for i in range(shards)]
    ws = writers(fmt, d, shards)
    snaps = take(fmt, state, step, shards, prev, defer=True)
    t_write = time.perf_counter()  # members write in parallel once each took its snapshot
    handles = [
        w.save_async(step, snap, generation=1, members=members)  # type: ignore[arg-type]
        for w, snap in zip(ws, snaps, strict=True)
    ]
    compute_s = compute()  # the next step's forward and backward
    t_settle = time.perf_counter()
    for snap in snaps:  # before the next optimizer step
        snap.deferred.settle()
    wait_s = time.perf_counter() - t_settle
    results = [h.wait() for h in handles]
    write_s = time.perf_counter() - t_write
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"save failed: {bad}")
    t0 = time.perf_counter()
    (commit_sharded if fmt == CheckpointFormat.DCP else commit)(
        d, step, generation=1, members=members, num_shards=shards
    )
    commit_s = time.perf_counter() - t0
    for w in ws:
        w.close()
    # The old way, for comparison: everything copied on the training thread (warm
    # buffers), then the same write overlapping the same compute, into a directory
    # of its own (this one keeps the new path's checkpoints only).
    sync = take(fmt, state, step, shards, snaps, defer=False)
    old_dir = Path(tempfile.mkdtemp(prefix="sync-", dir=d.parent))
    try:
        old_writers = writers(fmt, old_dir, shards)
        old_handles = [
            w.save_async(step, snap, generation=1, members=members)  # type: ignore[arg-type]
            for w, snap in zip(old_writers, sync, strict=True)
        ]
        sync_compute_s = compute()
        for h in old_handles:
            h.wait()
        for w in old_writers:
            w.close()
    finally:
        shutil.rmtree(old_dir, ignore_errors=True)
    take_s = max(s.take_s for s in snaps)
    times = SaveTimes(
        take_s, wait_s, compute_s, write_s, commit_s, max(s.take_s for s in sync), sync_compute_s
    )
    return times, sync


def restore(fmt: CheckpointFormat, ckpt: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Every tensor of the checkpoint, by this state's names, and its meta."""
    if fmt == CheckpointFormat.DCP:
        with ShardedReader(ckpt) as reader:
            out = {n.replace(".", "/", 1): reader.read(n) for n in reader.tensors}
        return out, ckpt.meta
    return load(ckpt)


def main() -> None:
    bench = Bench("checkpoint.py", __doc__)
    ap = bench.ap
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--shards", type=int, default=4, help="members writing shards (default 4)")
    ap.add_argument("--dir", default=None, help="directory to write in (default under runs/)")
    ap.add_argument("--rounds", type=int, default=3, help="saves, alternating with dd (>= 2)")
    ap.add_argument("--step-tokens", type=int, default=128,
                    help="tokens per member and step of the overlapping compute (default 128)")  # fmt: skip
    ap.add_argument("--format", choices=[f.value for f in CheckpointFormat], default="flat",
                    help="the checkpoint files: flat stripes or a replicated job's DCP format")  # fmt: skip
    args = bench.parse()
    fmt = CheckpointFormat(args.format)
    if args.rounds < 2 or args.shards < 1 or args.gib <= 0 or args.step_tokens < 1:
        raise SystemExit(
            "need --rounds >= 2 (one cold save, then warm ones), --shards >= 1, --gib > 0, "
            "--step-tokens >= 1"
        )
    cores = os.cpu_count() or 0

    parent = Path(args.dir) if args.dir else HERE / "runs"
    parent.mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="checkpoint-", dir=parent))
    df = subprocess.run(["df", "-h", str(d)], capture_output=True, text=True).stdout.strip()
    log(f"df -h {d}:\n{df}")
    need = int(args.gib * 1024 * MIB * 3.5)
    if shutil.disk_usage(d).free < need:
        shutil.rmtree(d)
        raise SystemExit(f"need {need / 2**30:.1f} GiB free in {d}; pass --dir elsewhere")
    log(f"load average {os.getloadavg()[0]:.1f} on {cores} cores; torch {torch.__version__}")
    try:
        state = make_state(args.gib)
        total = sum(t.numel() * t.element_size() for t in state.values())
        layers = _Layers(state)
        saved = (
            TorchState(layers, torch.optim.SGD(layers.parameters(), lr=0.0))
            if fmt == CheckpointFormat.DCP
            else state
        )
        log(f"state: {len(state)} tensors, {total / MIB:.0f} MiB, {args.shards} shard(s), "
            f"{fmt} format")  # fmt: skip
        compute, gflop = step_compute(total, args.step_tokens)
        compute()  # warm-up
        alone = statistics.median(compute() for _ in range(3))
        step_note = (
            f"{gflop:.1f} GFLOP = 6 x {total // 12 / 1e6:.1f} M params x {args.step_tokens} "
            f"tokens; {alone:.3f} s alone ({gflop / alone:.0f} GFLOP/s)"
        )
        log(f"next step's compute: {step_note}")
        dds: list[float] = []
        saves: list[SaveTimes] = []
        snaps: list[Snap] | None = None
        keep1 = CheckpointConfig(directory=str(d), keep_last=1)
        for r in range(args.rounds + 1):  # dd, save, dd, save, ..., dd
            dds.append(run_dd(d, total))
            log(f"dd: {dds[-1]:.2f} s ({total / dds[-1] / MIB:.0f} MiB/s)")
            if r == args.rounds:
                break
            step = 100 * (r + 1)
            t, snaps = one_save(fmt, d, step, saved, args.shards, snaps, compute)
            saves.append(t)
            log(f"save step {step} ({'cold' if r == 0 else 'warm'}): blocking {t.blocking:.3f} s "
                f"(take {t.take:.3f} + wait {t.wait:.3f}; old sync take {t.sync:.3f}), compute "
                f"{t.compute:.3f} s, write {t.write:.2f} s, commit {t.commit:.2f} s")  # fmt: skip
            deleted = apply_retention(d, keep1, verified_step=step)
            assert [p.name for p in deleted] == ([] if r == 0 else [f"step-{step - 100:08d}"])
        snaps = None  # free the host buffers before restoring
        drop_cache(d)
        t0 = time.perf_counter()
        ckpt = latest_verified(d)
        verify_s = time.perf_counter() - t0
        last = 100 * args.rounds
        assert ckpt is not None and ckpt.step == last
        t0 = time.perf_counter()
        tensors, meta = restore(fmt, ckpt)
        load_s = time.perf_counter() - t0
        same = (fmt == CheckpointFormat.DCP or meta == {"step": last}) and all(
            torch.equal(tensors[k].reshape(v.shape), v)
            for k, v in state.items()
            if fmt == CheckpointFormat.FLAT or k.startswith("model/")
        )
        if not same:
            raise SystemExit("restored state differs from the saved one")
        del tensors
    finally:
        shutil.rmtree(d, ignore_errors=True)
    log(f"removed {d}")

    mibs = total / MIB
    med = statistics.median

    def spread(xs: list[float], unit: str = "s") -> str:
        return f"{min(xs):.2f}-{max(xs):.2f} {unit}" if len(xs) > 1 else ""

    dd_s = med(dds)
    warm = saves[1:] or saves
    cold = saves[0]
    blk, wrt, com = ([x.blocking for x in warm], [x.write for x in warm], [x.commit for x in warm])
    syn = [x.sync for x in saves]
    rows = [
        (f"dd conv=fsync (median of {len(dds)})", f"{dd_s:.2f} s", f"{mibs / dd_s:.0f} MiB/s", spread(dds)),
        ("next step's compute alone", f"{alone:.3f} s", f"{gflop:.1f} GFLOP", ""),
        ("next step's compute during the copy (median)", f"{med([x.compute for x in saves]):.3f} s",
         "", spread([x.compute for x in saves])),
        ("cold save: blocking (take + wait)", f"{cold.blocking:.3f} s",
         f"{100 * cold.blocking / cold.write:.1f}% of write", ""),
        ("cold save: write (all shards durable)", f"{cold.write:.2f} s",
         f"{mibs / cold.write:.0f} MiB/s", f"{100 * dd_s / cold.write:.0f}% of dd"),
        (f"warm save: blocking (take + wait, median of {len(warm)})", f"{med(blk):.3f} s",
         f"{100 * med(blk) / med(wrt):.1f}% of write", spread(blk)),
        ("warm save: of which take (median)", f"{med([x.take for x in warm]):.3f} s", "", ""),
        ("warm save: of which wait after compute (median)", f"{med([x.wait for x in warm]):.3f} s",
         "", ""),
        # Not blocking, but paid by the training thread all the same on a CPU host:
        # the copy, the CRC and the write share the cores with the step's compute.
        # The old way's write slows it too; the difference is the deferred copy's.
        ("warm save: the compute's slowdown (during - alone, median)",
         f"{med([x.compute for x in warm]) - alone:+.3f} s",
         f"{100 * (med([x.compute for x in warm]) - alone) / med(wrt):+.1f}% of write", ""),
        ("old way: the compute's slowdown during its write (median)",
         f"{med([x.sync_compute for x in warm]) - alone:+.3f} s",
         f"{100 * (med([x.sync_compute for x in warm]) - alone) / med(wrt):+.1f}% of write", ""),
        ("training thread's loss, new (blocking + slowdown) / old (take + slowdown)",
         f"{med([x.blocking + x.compute for x in warm]) - alone:.3f} s",
         f"{med([x.sync + x.sync_compute for x in warm]) - alone:.3f} s", ""),
        (f"old synchronous take, warm (median of {len(syn)})", f"{med(syn):.3f} s",
         f"{100 * med(syn) / med(wrt):.1f}% of write", spread(syn)),
        (f"warm save: write (median of {len(warm)})", f"{med(wrt):.2f} s",
         f"{mibs / med(wrt):.0f} MiB/s", f"{100 * dd_s / med(wrt):.0f}% of dd"),
        ("warm save: write range", spread(wrt), "", ""),
        ("save: commit (verify + marker, median)", f"{med(com):.2f} s",
         f"{mibs / med(com):.0f} MiB/s", ""),
        ("restore: latest_verified (read + crc)", f"{verify_s:.2f} s", f"{mibs / verify_s:.0f} MiB/s", ""),
        ("restore: load (read + crc)", f"{load_s:.2f} s", f"{mibs / load_s:.0f} MiB/s", ""),
    ]  # fmt: skip
    w0 = max(len(r[0]) for r in rows)
    table = "\n".join(f"{r[0]:<{w0}}  {r[1]:>12}  {r[2]:>16}  {r[3]:>12}".rstrip() for r in rows)
    t_block = med(blk) <= 0.05 * med(wrt)
    t_tput = dd_s / med(wrt) >= 0.70
    blocking_pct, tput_pct = 100 * med(blk) / med(wrt), 100 * dd_s / med(wrt)
    targets = [
        target("blocking per save (warm saves, medians)", "<= 5% of the full write time",
               f"{blocking_pct:.1f}%", t_block),
        target("write throughput (medians)", ">= 70% of dd conv=fsync to the same directory",
               f"{tput_pct:.0f}%", t_tput),
    ]  # fmt: skip
    print()
    print(table)
    print()
    print("\n".join(f"- {t.target} {t.threshold}: {t.measured} -> {t.verdict.value}"
                    for t in targets))  # fmt: skip
    figures = [
        Figure("blocking_pct", "warm save: blocking, % of the write", blocking_pct, "%"),
        Figure("write_vs_dd_pct", "warm save: write throughput, % of dd", tput_pct, "%"),
        Figure("write_mib_s", "warm save: write throughput", mibs / med(wrt), "MiB/s"),
        Figure("restore_s", "restore: load (read + crc)", load_s, "s"),
    ]
    state_note = (
        f"state: {len(state)} float32 tensors, {mibs:.0f} MiB, "
        + (
            f"in {fmt} format, each of {args.shards} member(s) writing its rows of every tensor"
            if fmt == CheckpointFormat.DCP
            else f"striped over {args.shards} member(s)"
        )
        + " (writer threads in one process) on one disk. "
        f"Next step's compute overlapping the deferred copy: {step_note}"
    )
    bench.finish(f"torch {torch.__version__}", figures, targets, [state_note],
                 ["```", df, "```", "", "```", table, "```"])  # fmt: skip


if __name__ == "__main__":
    main()

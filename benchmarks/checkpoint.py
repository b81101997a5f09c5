"""Checkpoint storage benchmark (issue 3's benchmark acceptance).

Run from the repository root:

    .venv/bin/python benchmarks/checkpoint.py [--gib 1] [--shards 4] [--rounds 3] [--dir DIR]
        [--no-record]

The state is ``--gib`` GiB of float32 (tensors of 128 MiB plus a few small
ones) striped over ``--shards`` members that share this host's disk; each
member is simulated in this process by its own `Snapshot` and
`CheckpointWriter` (its own writer thread), as members on one host would be.
``--shards 1`` is one member writing the whole state.

1. ``df -h`` of the target directory (default: a fresh directory under
   ``benchmarks/runs/``); refuses to run with less than 3.5x the state free.
2. ``--rounds`` saves (default 3), alternating with the reference
   ``dd if=/dev/zero of=<dir>/ddtest bs=4M count=N conv=fsync`` for the same
   number of bytes (dd, save, dd, save, ..., dd), because the disk is shared
   and its speed drifts; the reference is the median dd time. The first save
   is *cold* (fresh host buffers, page faults included); the others are
   *warm* (buffers reused with ``Snapshot.take(..., into=previous)``, the
   steady state of a training job). Per save: blocking time = the longest
   `Snapshot.take` of one member (members take their snapshots in parallel
   in a real job; here one after another, each timed alone); write time =
   all members' `save_async` until every shard file and manifest is durable
   (fsync included); `commit` (reads and CRC-checks every shard) is reported
   apart. `apply_retention` with keep_last=1 runs after each commit.
3. Restore: this benchmark's files are dropped from the page cache with
   ``posix_fadvise(DONTNEED)`` (only these files), then `latest_verified`
   (reads and CRC-checks every shard) and `load` (reads them again into new
   tensors) are timed; the restored state is compared bit for bit.
4. Prints a table and appends it to benchmarks/RESULTS.md (unless
   --no-record) with date, machine, command and PASS/FAIL for the targets,
   judged on the warm saves' medians: blocking <= 5% of the write time,
   write throughput >= 70% of dd. Deletes everything it wrote. Takes about
   2 minutes for 1 GiB on a disk of about 150 MB/s.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from elastrain.checkpoint import (  # noqa: E402
    CheckpointConfig,
    CheckpointWriter,
    Snapshot,
    apply_retention,
    commit,
    latest_verified,
    load,
)

MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_state(gib: float) -> dict[str, torch.Tensor]:
    total = int(gib * 1024 * MIB)
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


def one_save(
    d: Path,
    step: int,
    state: dict[str, torch.Tensor],
    shards: int,
    prev: list[Snapshot] | None,
) -> tuple[float, float, float, list[Snapshot]]:
    """(blocking s, write s, commit s, snapshots) of one checkpoint by ``shards`` members."""
    members = [f"w{i}" for i in range(shards)]
    writers = [CheckpointWriter(CheckpointConfig(directory=str(d))) for _ in range(shards)]
    snaps = [
        Snapshot.take(
            state, {"step": step}, shard=i, num_shards=shards, into=prev[i] if prev else None
        )
        for i in range(shards)
    ]
    t_write = time.perf_counter()  # members write in parallel once each took its snapshot
    handles = [
        w.save_async(step, snap, generation=1, members=members)
        for w, snap in zip(writers, snaps, strict=True)
    ]
    results = [h.wait() for h in handles]
    write_s = time.perf_counter() - t_write
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"save failed: {bad}")
    t0 = time.perf_counter()
    commit(d, step, generation=1, members=members, num_shards=shards)
    commit_s = time.perf_counter() - t0
    for w in writers:
        w.close()
    return max(s.take_s for s in snaps), write_s, commit_s, snaps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=1.0, help="state size in GiB (default 1)")
    ap.add_argument("--shards", type=int, default=4, help="members writing shards (default 4)")
    ap.add_argument("--dir", default=None, help="directory to write in (default under runs/)")
    ap.add_argument("--rounds", type=int, default=3, help="saves, alternating with dd (>= 2)")
    ap.add_argument("--no-record", action="store_true", help="do not append to RESULTS.md")
    args = ap.parse_args()
    if args.rounds < 2 or args.shards < 1 or args.gib <= 0:
        raise SystemExit(
            "need --rounds >= 2 (one cold save, then warm ones), --shards >= 1, --gib > 0"
        )
    uname = subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip()
    cores = os.cpu_count() or 0
    py_abs = os.path.abspath(sys.executable)
    py_s = os.path.relpath(py_abs, ROOT) if py_abs.startswith(str(ROOT) + os.sep) else py_abs
    command = shlex.join([py_s, "benchmarks/checkpoint.py", *sys.argv[1:]])

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
        log(f"state: {len(state)} tensors, {total / MIB:.0f} MiB, {args.shards} shard(s)")
        dds: list[float] = []
        saves: list[tuple[float, float, float]] = []
        snaps: list[Snapshot] | None = None
        keep1 = CheckpointConfig(directory=str(d), keep_last=1)
        for r in range(args.rounds + 1):  # dd, save, dd, save, ..., dd
            dds.append(run_dd(d, total))
            log(f"dd: {dds[-1]:.2f} s ({total / dds[-1] / MIB:.0f} MiB/s)")
            if r == args.rounds:
                break
            step = 100 * (r + 1)
            block_s, write_s, commit_s, snaps = one_save(d, step, state, args.shards, snaps)
            saves.append((block_s, write_s, commit_s))
            log(f"save step {step} ({'cold' if r == 0 else 'warm'}): blocking {block_s:.3f} s, "
                f"write {write_s:.2f} s, commit {commit_s:.2f} s")  # fmt: skip
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
        tensors, meta = load(ckpt)
        load_s = time.perf_counter() - t0
        same = meta == {"step": last} and all(torch.equal(tensors[k], v) for k, v in state.items())
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
    blk, wrt, com = ([x[i] for x in warm] for i in range(3))
    rows = [
        (f"dd conv=fsync (median of {len(dds)})", f"{dd_s:.2f} s", f"{mibs / dd_s:.0f} MiB/s", spread(dds)),
        ("cold save: blocking (Snapshot.take)", f"{saves[0][0]:.3f} s",
         f"{100 * saves[0][0] / saves[0][1]:.1f}% of write", ""),
        ("cold save: write (all shards durable)", f"{saves[0][1]:.2f} s",
         f"{mibs / saves[0][1]:.0f} MiB/s", f"{100 * dd_s / saves[0][1]:.0f}% of dd"),
        (f"warm save: blocking (median of {len(warm)})", f"{med(blk):.3f} s",
         f"{100 * med(blk) / med(wrt):.1f}% of write", spread(blk)),
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
    targets = [
        f"- blocking per save <= 5% of the full write time (warm saves, medians): "
        f"{100 * med(blk) / med(wrt):.1f}% -> {'PASS' if t_block else 'FAIL'}",
        f"- write throughput >= 70% of dd conv=fsync to the same directory (medians): "
        f"{100 * dd_s / med(wrt):.0f}% -> {'PASS' if t_tput else 'FAIL'}",
    ]
    print()
    print(table)
    print()
    print("\n".join(targets))
    if not args.no_record:
        res = HERE / "RESULTS.md"
        if not res.exists():
            res.write_text("# elastrain benchmark results\n")
        sec = [
            "",
            f"## checkpoint.py — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
            "",
            f"Machine: `{uname}`, {cores} cores (shared with other work; load average "
            f"{os.getloadavg()[0]:.1f} at the end). torch {torch.__version__}.",
            "",
            f"Command: `{command}`",
            "",
            f"State: {len(state)} float32 tensors, {mibs:.0f} MiB, striped over "
            f"{args.shards} member(s) (writer threads in one process) on one disk:",
            "",
            "```",
            df,
            "```",
            "",
            "Targets:",
            "",
            *targets,
            "",
            "```",
            table,
            "```",
            "",
        ]
        with open(res, "a") as f:
            f.write("\n".join(sec))
        log(f"appended to {res}")


if __name__ == "__main__":
    main()

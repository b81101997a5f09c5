"""What every benchmark script shares: its common arguments, the facts of a run (date,
machine, command, commit), the machine's load while it ran, and its record.

A benchmark script keeps only what is its own (its job, its measurement, its tables)
and ends with `Bench.finish`, which prints its notes and, unless --no-record or --quick,
writes the run's record (benchmarks/results/<script>-<minute>.json, see _records.py) and renders
RESULTS.md, HISTORY.md and README.md's headline table from all records (render.py).

    bench = Bench("digest.py", __doc__, quick="one round, to check it works")
    bench.ap.add_argument("--rounds", type=int, default=12)
    args = bench.parse()
    ... measure ...
    bench.finish(software, figures, targets, notes, details)
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RUNS = HERE / "runs"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import render  # noqa: E402
from _records import (  # noqa: E402
    DATE_FORMAT,
    RESULTS_DIR,
    Figure,
    Record,
    Target,
    Verdict,
    load_records,
    write_record,
)

__all__ = [
    "Bench", "Figure", "LoadSampler", "RunContext", "Target", "Verdict", "log", "run_context",
    "target", "targets_from_rows", "turns", "at_least", "at_most", "fmt", "med", "pct", "table",
    "verdict",
]  # fmt: skip


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class LoadSampler:
    """The 1-minute load average every `every_s` seconds from its start until `stop`, so
    each measured window can be reported with the load it ran under (the machines
    these benchmarks run on are shared)."""

    def __init__(self, every_s: float = 2.0) -> None:
        self.samples: list[tuple[float, float]] = [(time.time(), os.getloadavg()[0])]
        self._stop = threading.Event()
        self._every_s = every_s
        threading.Thread(target=self._run, daemon=True, name="loadavg").start()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            self.samples.append((time.time(), os.getloadavg()[0]))

    def mean(self, t0: float, t1: float) -> float:
        """Mean of the samples taken between wall times `t0` and `t1` (NaN if none)."""
        xs = [v for t, v in self.samples if t0 <= t <= t1]
        return statistics.fmean(xs) if xs else float("nan")

    def summary(self) -> str:
        """ "min / mean / max" over every sample so far."""
        xs = [v for _, v in self.samples]
        return f"{min(xs):.1f} / {statistics.fmean(xs):.1f} / {max(xs):.1f}"

    def stop(self) -> None:
        self._stop.set()


class RunContext(NamedTuple):
    """The facts of a run a record states, taken at its start (`run_context`)."""

    date: str
    """UTC, minutes (`DATE_FORMAT`)."""
    uname: str
    cores: int
    command: str
    """As run from the repository root."""
    code: str
    """The commit, and how many files differ from it."""


def run_context(
    script: str,
    paths: tuple[str, ...] = ("elastrain", "benchmarks"),
    argv: Sequence[str] | None = None,
) -> RunContext:
    """The run's `RunContext`; `code` counts the files under `paths` that differ from
    the commit (the rendered pages and records themselves not counted); the command's
    arguments are `argv` (default: this process's)."""
    py_abs = os.path.abspath(sys.executable)
    py_s = os.path.relpath(py_abs, ROOT) if py_abs.startswith(str(ROOT) + os.sep) else py_abs

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True
        ).stdout

    head = git("rev-parse", "--short", "HEAD").strip()
    generated = ("RESULTS.md", "HISTORY.md", "benchmarks/results/")
    dirty = [
        x for x in git("status", "--porcelain", "--", *paths).splitlines()
        if x.strip() and not any(g in x for g in generated)
    ]  # fmt: skip
    where = " or ".join(f"{p}/" for p in paths)
    return RunContext(
        dt.datetime.now(dt.UTC).strftime(DATE_FORMAT),
        subprocess.run(["uname", "-srm"], capture_output=True, text=True).stdout.strip(),
        os.cpu_count() or 0,
        shlex.join([py_s, f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)]),
        head + (f" + {len(dirty)} uncommitted file(s) in {where}" if dirty else ""),
    )


# ---- report helpers: the tables a benchmark prints ------------------------------------


def med(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def fmt(x: float | None, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def pct(x: float, y: float) -> str:
    """x against y as a signed percentage ("+3.1%"); n/a without a positive y."""
    return f"{(x / y - 1) * 100:+.1f}%" if y > 0 and not math.isnan(x) else "n/a"


def verdict(ok: bool | None) -> str:
    """PASS, FAIL, or n/a where nothing was measured (None)."""
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def at_most(x: float, target: float) -> bool | None:
    """Whether ``x <= target``; None for a NaN (nothing measured)."""
    return None if math.isnan(x) else x <= target


def at_least(x: float, target: float) -> bool | None:
    """Whether ``x >= target``; None for a NaN (nothing measured)."""
    return None if math.isnan(x) else x >= target


def table(header: list[str], rows: list[list[str]]) -> str:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = ["| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(header)) + " |"]
    out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        out.append("| " + " | ".join(c.ljust(w[i]) for i, c in enumerate(r)) + " |")
    return "\n".join(out)


T = TypeVar("T")


def turns(sides: Sequence[T], k: int) -> list[T]:
    """The order the sides take their turns in round ``k``: as given in even rounds,
    reversed in odd ones (A B | B A | ...), so that no side always runs first, or
    always right after a given other, on a machine whose load drifts."""
    return list(sides) if k % 2 == 0 else list(sides)[::-1]


def target(name: str, threshold: str, measured: str, ok: bool | None) -> Target:
    """A judged target; `ok` None: not measured in this run."""
    verdict = Verdict.NOT_RUN if ok is None else Verdict.PASS if ok else Verdict.FAIL
    return Target(name, threshold, measured, verdict)


def targets_from_rows(rows: Sequence[Sequence[str]]) -> tuple[list[Target], list[str]]:
    """A printed target table's rows ([target, measured, verdict]) as `Target`s, the
    threshold being the target's first "<=" / ">=" clause (up to a ":" or "("); rows
    with the verdict "report" (measured, no threshold set) come back as notes."""
    targets, reported = [], []
    for name, measured, verdict in rows:
        if verdict == "report":
            reported.append(f"{name}: {measured}")
            continue
        m = re.search(r" (<=|>=) ([^:(]*)", name)
        what, bar = name, ""
        if m:
            what = f"{name[: m.start()]} {name[m.end() :]}".strip().replace(" :", ":")
            bar = f"{m.group(1)} {m.group(2).strip()}"
        targets.append(Target(what, bar, measured, Verdict(verdict)))
    return targets, reported


class Bench:
    """One run of a benchmark script: its argument parser with the arguments every
    benchmark shares, its `RunContext` and `LoadSampler` (from `parse`), its record
    (`finish`).

    Shared arguments: --no-record always; --quick where the script has a smoke mode
    (`quick` is its help text; a quick run is never recorded); --repeats where it
    repeats a measurement (`repeats` its default); --runs-dir where it keeps run
    directories."""

    def __init__(
        self,
        script: str,
        doc: str | None,
        *,
        quick: str | None = None,
        repeats: int | None = None,
        runs_dir: bool = False,
        paths: tuple[str, ...] = ("elastrain", "benchmarks"),
        root: Path = ROOT,
    ) -> None:
        self.script = script
        self.paths = paths
        self.root = root
        """The checkout whose benchmarks/results/ gets the record and whose pages are
        rendered (another only in tests)."""
        self.ap = argparse.ArgumentParser(
            description=(doc or script).split("\n\n")[0],
        )
        self.ap.add_argument(
            "--no-record", action="store_true",
            help="do not write a record to benchmarks/results/ (nor re-render RESULTS.md)",
        )  # fmt: skip
        if quick is not None:
            self.ap.add_argument("--quick", action="store_true", help=quick + "; not recorded")
        if repeats is not None:
            self.ap.add_argument(
                "--repeats", type=int, default=repeats, help=f"runs per side ({repeats})"
            )
        if runs_dir:
            self.ap.add_argument(
                "--runs-dir", type=Path, default=RUNS,
                help="where the run directories go (benchmarks/runs)",
            )  # fmt: skip
        self.args: argparse.Namespace | None = None
        self.ctx: RunContext | None = None
        self.load: LoadSampler | None = None
        self.t0 = time.monotonic()

    def parse(self, argv: Sequence[str] | None = None) -> argparse.Namespace:
        """Parse the arguments, take the run's context and start sampling the load."""
        self.args = self.ap.parse_args(argv)
        repeats = getattr(self.args, "repeats", None)  # None: the script's own default
        if repeats is not None and repeats < 1:
            self.ap.error("--repeats must be >= 1")
        self.ctx = run_context(self.script, self.paths, argv)
        self.load = LoadSampler()
        self.t0 = time.monotonic()
        return self.args

    def run_dir(self, stem: str) -> Path:
        """A fresh directory for this run's files: <runs dir>/<stem>-<local time>."""
        base = getattr(self.args, "runs_dir", RUNS)
        d = Path(base) / f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def recording(self) -> bool:
        """Whether `finish` writes a record: not with --no-record, nor --quick."""
        a = self.args
        return a is not None and not a.no_record and not getattr(a, "quick", False)

    def elapsed_s(self) -> float:
        return time.monotonic() - self.t0

    def finish(
        self,
        software: str,
        figures: Sequence[Figure],
        targets: Sequence[Target],
        notes: Sequence[str] = (),
        details: str | Sequence[str] = (),
        anomalies: Sequence[str] = (),
        extra: dict[str, Any] | None = None,
    ) -> Path | None:
        """Print the notes and anomalies; when `recording`, write the run's record and
        render the pages from all records. Returns the record's path (None if none)."""
        assert self.ctx is not None and self.load is not None, "parse() first"
        self.load.stop()
        for n in notes:
            print("- " + n)
        if anomalies:
            print("\nANOMALIES:")
            for a in anomalies:
                print("- " + a)
        if not self.recording:
            return None
        if isinstance(details, str):
            details = details.splitlines()
        rec = Record(
            benchmark=self.script, date=self.ctx.date,
            machine=f"{self.ctx.uname}, {self.ctx.cores} cores", software=software,
            command=self.ctx.command, commit=self.ctx.code,
            load=f"{self.load.summary()} (min / mean / max)",
            figures=tuple(figures), targets=tuple(targets),
            notes=(*notes, *(f"ANOMALY: {a}" for a in anomalies),
                   f"total runtime {self.elapsed_s():.0f} s"),
            details=tuple(details), extra=extra or {},
        )  # fmt: skip
        path = write_record(rec, self.root / RESULTS_DIR.relative_to(ROOT))
        log(f"recorded {path.relative_to(self.root)}")
        rerender(self.root)
        return path


def rerender(root: Path = ROOT) -> None:
    """Render RESULTS.md, HISTORY.md and README.md's headline from every record."""
    pages = render.render_all(load_records(root / RESULTS_DIR.relative_to(ROOT)), root=root)
    for p in render.stale(pages):
        p.write_text(pages.files[p])
        log(f"rendered {p.relative_to(root)}")

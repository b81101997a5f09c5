"""A benchmark run's record: the JSON file every run writes under benchmarks/results/.

One file per run, never edited after it is written: RESULTS.md, HISTORY.md and the
README's headline table are all rendered from these files (`render.py`), so what a
reader sees is what a run measured. `parse_record` is the one place that says what a
well-formed record is; `load_records` refuses a directory holding a malformed one.
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS_DIR = HERE / "results"
SCHEMA = 1
DATE_FORMAT = "%Y-%m-%d %H:%M UTC"


class Verdict(enum.Enum):
    """A target's outcome in one run."""

    PASS = "PASS"
    FAIL = "FAIL"
    NOT_RUN = "n/a"
    """The run did not measure it (a side not installed, a part not asked for)."""


@dataclass(frozen=True)
class Figure:
    """One measured value, named."""

    key: str
    """Stable identifier within the benchmark ("kill_to_next_commit_s[elastrain]"): what
    the README's headline table and later comparisons look figures up by."""
    label: str
    """What a reader sees ("kill -> survivors' next commit, elastrain")."""
    value: float | None
    """None where the run measured nothing (every repeat failed, a side not run)."""
    unit: str
    """"s", "ms", "%", "x", "MB/s", "steps", "" for a plain count or ratio."""


@dataclass(frozen=True)
class Target:
    """One judged target of a run."""

    target: str
    """What is judged ("median kill -> next commit")."""
    threshold: str
    """The bar it is judged against ("<= 2 s"); "" where the target names none."""
    measured: str
    """The run's value as the benchmark worded it ("0.938 s", "0.79 x (of 5)")."""
    verdict: Verdict


@dataclass(frozen=True)
class Record:
    """One benchmark run."""

    benchmark: str
    """The script's file name ("recovery.py"); RESULTS.md shows the latest per name."""
    date: str
    """UTC start of the run, `DATE_FORMAT` ("2026-12-04 20:09 UTC")."""
    machine: str
    """uname, cores, device: where it ran."""
    software: str
    """Versions that matter to the figures ("torch 2.13.0+cpu, gloo over loopback")."""
    command: str
    """The command line that reproduces it, from the repository root."""
    commit: str
    """The code's commit (short hash, "+ N uncommitted file(s)" where dirty); "" if not
    recorded (some imported runs)."""
    load: str
    """The machine's 1-minute load average as measured during the run ("2.3 / 2.9 / 3.6
    (min / mean / max)"); "" if not recorded."""
    figures: tuple[Figure, ...]
    targets: tuple[Target, ...]
    notes: tuple[str, ...] = ()
    """How it was measured, in sentences; anomalies included."""
    details: tuple[str, ...] = ()
    """The run's full printed tables (markdown lines); kept in the record, not rendered
    in RESULTS.md."""
    imported: bool = False
    """Parsed from the archive of hand-appended runs (results/archive-2026.md) rather
    than written by the run itself."""
    source: str = ""
    """For an imported record: where in the archive its text is."""
    schema: int = SCHEMA
    extra: dict[str, Any] = field(default_factory=dict)
    """Benchmark-specific structured data (per-repeat rows, run dirs)."""

    @property
    def when(self) -> dt.datetime:
        return dt.datetime.strptime(self.date, DATE_FORMAT).replace(tzinfo=dt.UTC)

    @property
    def stem(self) -> str:
        """The record's file name without ".json": script stem and start minute."""
        return f"{Path(self.benchmark).stem}-{self.when.strftime('%Y%m%d-%H%M')}"

    def figure(self, key: str) -> Figure | None:
        return next((f for f in self.figures if f.key == key), None)


class MalformedRecord(ValueError):
    """A results/*.json file that is not a well-formed `Record`."""


_REQUIRED_STR = ("benchmark", "date", "machine", "software", "command", "commit", "load")


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise MalformedRecord(f"{where}: {what}")


def parse_record(data: Any, where: str = "record") -> Record:
    """`data` (a decoded JSON object) as a `Record`; `MalformedRecord` naming the first
    thing wrong with it."""
    _need(isinstance(data, dict), where, "not a JSON object")
    _need(data.get("schema") == SCHEMA, where, f"schema {data.get('schema')!r}, expected {SCHEMA}")
    known = {"schema", "figures", "targets", "notes", "details", "imported", "source", "extra"}
    unknown = set(data) - known - set(_REQUIRED_STR)
    _need(not unknown, where, f"unknown fields {sorted(unknown)}")
    for k in _REQUIRED_STR:
        _need(isinstance(data.get(k), str), where, f"{k!r} missing or not a string")
    _need(re.fullmatch(r"[a-z_]+\.py", data["benchmark"]) is not None, where,
          f"benchmark {data['benchmark']!r} is not a script name")  # fmt: skip
    try:
        dt.datetime.strptime(data["date"], DATE_FORMAT)
    except ValueError:
        raise MalformedRecord(f"{where}: date {data['date']!r} is not {DATE_FORMAT!r}") from None
    _need(bool(data["command"].strip()), where, "empty command")
    figs = data.get("figures")
    _need(isinstance(figs, list), where, "'figures' missing or not a list")
    figures = []
    for i, f in enumerate(figs):
        w = f"{where}: figures[{i}]"
        _need(isinstance(f, dict) and set(f) == {"key", "label", "value", "unit"}, w,
              "needs exactly key, label, value, unit")  # fmt: skip
        _need(all(isinstance(f[k], str) for k in ("key", "label", "unit")), w, "not strings")
        v = f["value"]
        _need(v is None or (isinstance(v, int | float) and not isinstance(v, bool)), w,
              f"value {v!r} is not a number or null")  # fmt: skip
        _need(v is None or math.isfinite(v), w, f"value {v!r} is not finite")
        figures.append(Figure(f["key"], f["label"], v, f["unit"]))
    keys = [f.key for f in figures]
    _need(len(keys) == len(set(keys)), where, "figure keys repeat")
    tgts = data.get("targets")
    _need(isinstance(tgts, list), where, "'targets' missing or not a list")
    targets = []
    for i, t in enumerate(tgts):
        w = f"{where}: targets[{i}]"
        _need(isinstance(t, dict) and set(t) == {"target", "threshold", "measured", "verdict"},
              w, "needs exactly target, threshold, measured, verdict")  # fmt: skip
        _need(all(isinstance(t[k], str) for k in t), w, "not strings")
        try:
            verdict = Verdict(t["verdict"])
        except ValueError:
            raise MalformedRecord(f"{w}: verdict {t['verdict']!r}") from None
        targets.append(Target(t["target"], t["threshold"], t["measured"], verdict))
    for k in ("notes", "details"):
        v = data.get(k, [])
        _need(isinstance(v, list) and all(isinstance(x, str) for x in v), where,
              f"{k!r} is not a list of strings")  # fmt: skip
    _need(isinstance(data.get("imported", False), bool), where, "'imported' is not a bool")
    _need(isinstance(data.get("source", ""), str), where, "'source' is not a string")
    _need(isinstance(data.get("extra", {}), dict), where, "'extra' is not an object")
    return Record(
        benchmark=data["benchmark"], date=data["date"], machine=data["machine"],
        software=data["software"], command=data["command"], commit=data["commit"],
        load=data["load"], figures=tuple(figures), targets=tuple(targets),
        notes=tuple(data.get("notes", [])), details=tuple(data.get("details", [])),
        imported=data.get("imported", False), source=data.get("source", ""),
        extra=data.get("extra", {}),
    )  # fmt: skip


def to_json(rec: Record) -> str:
    """The record's file text (stable key order, one trailing newline)."""
    d = asdict(rec)
    for t in d["targets"]:
        t["verdict"] = t["verdict"].value
    return json.dumps(d, indent=1, ensure_ascii=False) + "\n"


def load_records(directory: Path = RESULTS_DIR) -> list[Record]:
    """Every record under `directory`, oldest first; `MalformedRecord` if any file is
    malformed or named other than its `Record.stem`."""
    out = []
    for p in sorted(directory.glob("*.json")):
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise MalformedRecord(f"{p.name}: not JSON ({e})") from None
        rec = parse_record(data, p.name)
        m = re.fullmatch(re.escape(rec.stem) + r"(?:-(\d+))?", p.stem)
        _need(m is not None, p.name, f"named other than its run ({rec.stem}.json)")
        assert m is not None
        out.append((rec.when, rec.benchmark, int(m.group(1) or 1), rec))
    return [r for *_, r in sorted(out, key=lambda x: x[:3])]


def write_record(rec: Record, directory: Path = RESULTS_DIR) -> Path:
    """Write `rec` as a new file, never over another: a second run of one benchmark
    within a minute gets "-2" appended (`load_records` accepts the suffix)."""
    directory.mkdir(parents=True, exist_ok=True)
    parse_record(json.loads(to_json(rec)), rec.stem)  # refuse to write what cannot be read
    path, n = directory / f"{rec.stem}.json", 1
    while path.exists():
        n += 1
        path = directory / f"{rec.stem}-{n}.json"
    path.write_text(to_json(rec))
    return path

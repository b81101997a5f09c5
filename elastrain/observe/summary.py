"""The tables printed at the end of `elastrain run` and `elastrain demo`: worker
PIDs and their fates, the recovery of each recognised failure, the joiners.

Pure formatting over a run's events; both commands print `format_run_tables`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from elastrain.observe.failures import Failure, recognise_failures
from elastrain.observe.recovery import format_joins, format_recoveries, joins, recoveries

Event = Mapping[str, Any]


def committed_steps(events: Sequence[Event]) -> int:
    """The job's committed step count: one past the highest committed step."""
    steps = [
        e["step"]
        for e in events
        if e.get("kind") == "step_commit" and isinstance(e.get("step"), int)
    ]
    return max(steps) + 1 if steps else 0


def last_pids(events: Sequence[Event]) -> dict[str, int]:
    """PID each member wrote its last committed step from (measured, not assumed)."""
    out: dict[str, int] = {}
    for e in events:
        if e.get("kind") == "step_commit":
            out[str(e["proc"])] = e["pid"]
    return out


def format_pid_table(events: Sequence[Event], failures: Sequence[Failure]) -> str:
    """One line per spawned worker: its PID at spawn, the PID that committed its last
    step, whom it replaced, and its fate (its recognised failures, or survivor)."""
    spawned = [e for e in events if e.get("kind") == "worker_spawned"]
    after = last_pids(events)
    final = committed_steps(events) - 1
    finishers = {
        e["proc"] for e in events if e.get("kind") == "step_commit" and e.get("step") == final
    }
    lines = [f"  {'member':8} {'pid':>8} {'last':>8} {'replaces':8}  fate"]
    for e in spawned:
        m = str(e.get("member"))
        b, a = e.get("pid"), after.get(m)
        mine = [f for f in failures if f.member == m]
        what = ", ".join(f"{f.kind.value} ({f.how})" for f in mine)
        if m in finishers:
            fate = "survivor, same process" if a == b else "DIFFERENT PROCESS"
            if mine:
                fate += f"; rejoined after: {what}"
        else:
            fate = what or "gone"
        lines.append(
            f"  {m:8} {b!s:>8} {a if a is not None else '-':>8} {e.get('replaces') or '-':8}  {fate}"
        )
    return "\n".join(lines)


def format_run_tables(events: Sequence[Event], *, healed_only: bool = False) -> str:
    """The PID table, the recovery table (one row per recognised failure) and the
    joiners table; `healed_only` keeps the joiners that were healed from peers."""
    failures = recognise_failures(events)
    origin = next((e["t"] for e in events if e.get("kind") == "job_start"), None)
    parts = [
        "workers (pid: spawned; last: the PID that committed its last step):",
        format_pid_table(events, failures),
    ]
    recs = recoveries(events, failures)
    if recs:
        parts += [
            "",
            f"failures: {len(recs)}; recovery of the survivors, per failure (seconds from the failure):",
            format_recoveries(recs, origin),
        ]
    else:
        parts += ["", "failures: 0"]
    js = [j for j in joins(events) if j.heal_bytes > 0 or not healed_only]
    if js:
        parts += [
            "",
            "joiners (spawned replacements and rejoined members; seconds from the spawn or rejoin):",
            format_joins(js, origin),
        ]
    return "\n".join(parts)

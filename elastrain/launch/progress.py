"""Live progress of a job: a rich panel on a terminal, plain lines elsewhere.

Fed with coordinator status dicts by the launcher (step, loss, members/target,
samples/s); with `attach(run_dir)` it also follows the run's events on a
background thread and shows the goodput so far, the last failure with its
recovery time and the script's own scalars (`trainer.log`, last values) (the launcher's own loop never waits for that computation).
"""

from __future__ import annotations

import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

SHOWN_SCALARS = 6
"""The script's scalars the live view shows (the first logged names); all are in
the report."""

LEDGER_INTERVAL_S = 2.0
"""How often the goodput so far is recomputed (at least; longer when it is slow)."""


@dataclass(frozen=True)
class Observed:
    """What the events say so far."""

    time_goodput: float | None = None
    failures: int = 0
    last_failure: str | None = None
    """e.g. "kill w1 at 25.4 s"."""
    last_recovery_s: float | None = None
    """Kill-to-first-commit of the last failure; None while it is still recovering."""
    scalars: tuple[tuple[str, float], ...] = ()
    """The script's own scalars (`trainer.log`): the last value per name."""
    stragglers: tuple[tuple[str, float], ...] = ()
    """Members computing slower than their peers now, with their score
    (`elastrain.observe.stragglers`)."""


def observe(events: list[dict[str, Any]]) -> Observed:
    """Goodput so far and the last failure, from the events seen until now."""
    from elastrain.observe.goodput import goodput
    from elastrain.observe.recovery import recoveries
    from elastrain.observe.scalars import last_scalars
    from elastrain.observe.stragglers import current_stragglers

    if not events:
        return Observed()
    gp = goodput(events)
    recs = recoveries(events)
    scalars = tuple((n, v) for n, (v, _) in last_scalars(events).items())
    slow = tuple(current_stragglers(events).items())
    t0 = next((e["t"] for e in events if e.get("kind") == "job_start"), events[0]["t"])
    if not recs:
        return Observed(
            gp.time_goodput if gp.total_s > 0 else None, scalars=scalars, stragglers=slow
        )
    r = recs[-1]
    return Observed(
        gp.time_goodput if gp.total_s > 0 else None,
        len(recs),
        f"{r.fault} {r.member} at {r.t0 - t0:.1f} s",
        r.total_s,
        scalars,
        slow,
    )


class Progress:
    """Fed with coordinator status dicts by the launcher (its own thread)."""

    def __init__(self, total_steps: int | None, *, plain: bool | None = None) -> None:
        self.total = total_steps
        self.plain = not sys.stdout.isatty() if plain is None else plain
        self._live: Any = None
        self._last_plain = 0.0
        self._last_line = ""
        self.start = time.monotonic()
        self.observed = Observed()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if not self.plain:
            from rich.live import Live

            self._live = Live(self._render({}), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def attach(self, run_dir: str | os.PathLike[str]) -> None:
        """Follow the run's events (goodput so far, last failure) on a daemon thread."""
        from elastrain.observe.events import EventTail

        tail = EventTail(run_dir)
        events: list[dict[str, Any]] = []

        def loop() -> None:
            wait = LEDGER_INTERVAL_S
            while not self._stop.wait(wait):
                t = time.monotonic()
                events.extend(tail.poll())
                events.sort(key=lambda e: e.get("t", 0.0))
                try:
                    self.observed = observe(events)
                except Exception:  # noqa: BLE001 - a live view must never stop the job
                    continue
                # keep this thread's share of a core small on long runs
                wait = max(LEDGER_INTERVAL_S, 20 * (time.monotonic() - t))

        self._thread = threading.Thread(target=loop, name="elastrain-progress", daemon=True)
        self._thread.start()

    def line(self, s: dict[str, Any]) -> str:
        step = int(s.get("step", 0))
        total = f"/{self.total}" if self.total else ""
        loss = s.get("loss")
        rate = float(s.get("steps_per_s") or 0.0)
        eta = ""
        if self.total and rate > 0:
            eta = f"  eta {_duration(max(0.0, (self.total - step) / rate))}"
        members = len(s.get("members", []))
        sps = float(s.get("samples_per_s") or 0.0)
        wait = f"  WAITING: {s['waiting']}" if s.get("waiting") else ""
        standby = len(s.get("standby", [])) if s.get("members") else 0
        spare = f" +{standby} standby" if standby else ""
        loss_s = f"{loss:.4f}" if isinstance(loss, float) else "  -   "
        return (
            f"step {step:5d}{total}  loss {loss_s}  members {members}/{s.get('target', '?')}"
            f"{spare}  gen {s.get('gen', 0)}  {rate:5.2f} steps/s  {sps:6.0f} samples/s{eta}{wait}"
        )

    def health(self) -> str:
        """Goodput so far and the last failure (empty until attached and measured)."""
        o = self.observed
        parts = []
        if o.time_goodput is not None:
            parts.append(f"goodput so far {o.time_goodput:.1%}")
        if o.last_failure:
            rec = (
                f"recovered in {o.last_recovery_s:.2f} s"
                if o.last_recovery_s is not None and math.isfinite(o.last_recovery_s)
                else "recovering"
            )
            parts.append(f"failures {o.failures}, last: {o.last_failure}, {rec}")
        if o.stragglers:
            parts.append(
                "straggling: " + ", ".join(f"{m} {score:.1f}x" for m, score in o.stragglers)
            )
        if o.scalars:
            shown = o.scalars[:SHOWN_SCALARS]
            more = len(o.scalars) - len(shown)
            parts.append(
                " ".join(f"{n} {v:.4g}" for n, v in shown) + (f" (+{more} more)" if more else "")
            )
        return "  ".join(parts)

    def _render(self, s: dict[str, Any]) -> Any:
        from rich.panel import Panel

        text = self.line(s) if s else "starting..."
        h = self.health()
        return Panel(text + (f"\n{h}" if h else ""), title="elastrain", expand=False)

    def update(self, s: dict[str, Any]) -> None:
        if self._live is not None:
            self._live.update(self._render(s))
            return
        now = time.monotonic()
        line = self.line(s)
        if now - self._last_plain >= 2.0 or (s.get("waiting") and line != self._last_line):
            h = self.health()
            print(line + (f"  | {h}" if h else ""), flush=True)
            self._last_plain = now
            self._last_line = line

    def note(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, flush=True)


def _duration(s: float) -> str:
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"

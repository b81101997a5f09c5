"""Live progress of a job: a rich panel on a terminal, plain lines elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Fed with coordinator status dicts by the launcher (its own thread)."""

    def __init__(self, total_steps: int | None, *, plain: bool | None = None) -> None:
        self.total = total_steps
        self.plain = not sys.stdout.isatty() if plain is None else plain
        self._live: Any = None
        self._last_plain = 0.0
        self._last_line = ""
        self.start = time.monotonic()

    def __enter__(self) -> Progress:
        if not self.plain:
            from rich.live import Live

            self._live = Live(self._render({}), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(None, None, None)

    def line(self, s: dict[str, Any]) -> str:
        step = int(s.get("step", 0))
        total = f"/{self.total}" if self.total else ""
        loss = s.get("loss")
        rate = float(s.get("steps_per_s") or 0.0)
        eta = ""
        if self.total and rate > 0:
            eta = f"  eta {max(0.0, (self.total - step) / rate):5.0f}s"
        members = len(s.get("members", []))
        sps = float(s.get("samples_per_s") or 0.0)
        wait = f"  WAITING: {s['waiting']}" if s.get("waiting") else ""
        loss_s = f"{loss:.4f}" if isinstance(loss, float) else "  -   "
        return (
            f"step {step:5d}{total}  loss {loss_s}  members {members}/{s.get('target', '?')}"
            f"  gen {s.get('gen', 0)}  {rate:5.2f} steps/s  {sps:6.0f} samples/s{eta}{wait}"
        )

    def _render(self, s: dict[str, Any]) -> Any:
        from rich.panel import Panel

        return Panel(self.line(s) if s else "starting...", title="elastrain", expand=False)

    def update(self, s: dict[str, Any]) -> None:
        if self._live is not None:
            self._live.update(self._render(s))
            return
        now = time.monotonic()
        line = self.line(s)
        if now - self._last_plain >= 2.0 or (s.get("waiting") and line != self._last_line):
            print(line, flush=True)
            self._last_plain = now
            self._last_line = line

    def note(self, text: str) -> None:
        if self._live is not None:
            self._live.console.print(text)
        else:
            print(text, flush=True)

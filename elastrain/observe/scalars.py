"""A training script's own scalars (`trainer.log(name, value)`): the rules for
names and values, and the last value per name in a run's events.

`trainer.log` (`elastrain.runtime.engine.StepEngine.log`) checks each call with
`check_scalar` on every member and, on rank 0 of the current generation only,
emits a ``user_scalar`` event (name, value, step). From there the value reaches
the live view and `elastrain report` (`last_scalars` over the events), the
coordinator's ``/metrics`` (`elastrain.observe.tally` sends it in the next quorum
request; at most `MAX_METRIC_SCALARS` names) and, with ``elastrain run
--tensorboard DIR``, TensorBoard (`elastrain.observe.tensorboard`). Pure.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

from elastrain.observe.events import EventKind

MAX_NAME = 64
"""Longest scalar name, in characters."""

NAME_RE = re.compile(rf"[A-Za-z0-9_./-]{{1,{MAX_NAME}}}")
"""What a scalar name may be: letters, digits, ``_ . / -`` (``lr``, ``eval/ppl``)."""

MAX_METRIC_SCALARS = 32
"""Most distinct names the coordinator's ``/metrics`` carries (each is one time
series of ``elastrain_user_scalar{name=...}``); the names past it are left out
of ``/metrics`` (the events, the report and TensorBoard still have them)."""


def check_scalar(name: Any, value: Any) -> float:
    """``value`` as a float if ``name`` and ``value`` may be logged; ValueError
    (TypeError for a value that is no number) saying what is allowed otherwise."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise ValueError(
            f"scalar name {name!r}: use 1-{MAX_NAME} characters of letters, digits and _ . / -"
        )
    if isinstance(value, bool) or not isinstance(value, int | float):
        item = getattr(value, "item", None)  # a one-element tensor or array
        if item is None:
            raise TypeError(f"scalar {name!r}: expected a number, got {type(value).__name__}")
        value = item()
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"scalar {name!r}: expected a number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"scalar {name!r}: expected a finite number, got {v}")
    return v


def last_scalars(events: Iterable[Mapping[str, Any]]) -> dict[str, tuple[float, int]]:
    """The last ``(value, step)`` logged under each name, in the order the names
    first appeared, from a run's events (sorted by time)."""
    out: dict[str, tuple[float, int]] = {}
    for e in events:
        if e.get("kind") == EventKind.USER_SCALAR:
            out[str(e.get("name"))] = (float(e.get("value", math.nan)), int(e.get("step") or 0))
    return out

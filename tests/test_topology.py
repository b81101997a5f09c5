"""The engine is a loop over parts; the layout is the topology's, never a branch.

Issue 39: `StepEngine` performs the member protocol's actions with parts that
share one `Context`; what differs between replicated and sharded jobs is the
`Topology` chosen once by the trainer. These checks keep it so: the engine
module stays small, names no sharded type or attribute, and asks no backend
what class it is.
"""

from __future__ import annotations

import ast
from pathlib import Path

RUNTIME = Path(__file__).resolve().parent.parent / "elastrain" / "runtime"
ENGINE = RUNTIME / "engine.py"
PARTS = (
    "engine.py",
    "context.py",
    "rendezvous.py",
    "healing.py",
    "step_run.py",
    "between.py",
    "saving.py",
    "start_state.py",
    "feed.py",
    "carried.py",
)
"""The engine and its parts: none of them knows the layout."""


def _names(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.alias):
            found.add(node.asname or node.name)
    return found


def test_the_engine_module_stays_small() -> None:
    assert len(ENGINE.read_text().splitlines()) <= 600


def test_no_part_of_the_engine_branches_on_the_layout() -> None:
    for name in PARTS:
        tree = ast.parse((RUNTIME / name).read_text(), name)
        # (The coordinator's own words passed through, `shard_size` of a ready
        # answer, are not a branch.)
        layout_names = sorted(n for n in _names(tree) if n == "shards" or "sharded" in n.lower())
        assert layout_names == [], f"{name} names the sharded layout: {layout_names}"


def test_no_part_of_the_engine_asks_a_backend_its_class() -> None:
    for name in PARTS:
        tree = ast.parse((RUNTIME / name).read_text(), name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                subject = ast.unparse(node.args[0])
                assert "backend" not in subject, f"{name}:{node.lineno} isinstance({subject}, ...)"
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
                subject = ast.unparse(node.args[0])
                assert "backend" not in subject, f"{name}:{node.lineno} getattr({subject}, ...)"

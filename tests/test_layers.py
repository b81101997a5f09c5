"""Layers you can see: the core never imports the tools.

The core is what a training job runs (data order, state transfer and
checkpoints, the coordinator, the worker runtime and the JAX backend, the
launcher). The tools read or drive jobs from outside (the simulator, the
report and its plots, Kubernetes rendering, the soak, the demo). Chaos reaches
a worker only through the step-hook seam (`elastrain.runtime.hooks`), which
the worker entry point fills: the worker runtime imports no chaos module.
Every import counts, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "elastrain"

CORE = ("data", "transfer", "checkpoint", "control", "runtime", "jax", "launch")
TOOLS = (
    "elastrain.sim",
    "elastrain.observe.report",
    "elastrain.observe.plots",
    "elastrain.k8s",
    "elastrain.chaos.soak",
    "elastrain.chaos.soak_job",
    "elastrain.demo",
)
WORKER = ("runtime", "jax", "transfer", "checkpoint", "data")
"""Packages that run inside a training process: no chaos there either."""


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def modules(packages: tuple[str, ...]) -> list[Path]:
    return sorted(f for pkg in packages for f in (PKG / pkg).rglob("*.py"))


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@pytest.mark.parametrize("path", modules(CORE), ids=lambda p: str(p.relative_to(PKG)))
def test_the_core_never_imports_a_tool(path: Path) -> None:
    bad = sorted(n for n in imports_of(path) if under(n, TOOLS))
    assert not bad, f"{path.relative_to(PKG)} imports tools: {bad}"


@pytest.mark.parametrize("path", modules(WORKER), ids=lambda p: str(p.relative_to(PKG)))
def test_the_worker_runtime_reaches_chaos_only_through_hooks(path: Path) -> None:
    bad = sorted(n for n in imports_of(path) if under(n, ("elastrain.chaos",)))
    assert not bad, f"{path.relative_to(PKG)} imports chaos: {bad}"


def test_the_checker_sees_imports_inside_functions(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from elastrain.sim.engine import run\n    import elastrain.k8s\n")
    assert {"elastrain.sim.engine", "elastrain.k8s"} <= imports_of(f)

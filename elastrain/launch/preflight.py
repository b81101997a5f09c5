"""Checks of the training script that `elastrain run` makes before starting any process.

A static look at the script's source (nothing is imported or run): a call to
`init_process_group`, a `DistributedDataParallel(...)`/`DDP(...)` wrapper, and
`TrainerConfig(global_batch_size=..., micro_batch_size=...)` written as literal
numbers. Calls under an `if` are left alone: the script may choose its launcher.
What only the running script knows is checked by the worker
(`elastrain.runtime.preflight`) and by the launcher's start-up watch
(`elastrain.launch.startup`).
"""

from __future__ import annotations

import ast
from pathlib import Path

from elastrain.runtime.preflight import DDP_WRAPPED, OWN_PROCESS_GROUP, batch_problems

_DDP_NAMES = frozenset({"DistributedDataParallel", "DDP"})


def _name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""


def _unconditional_calls(tree: ast.AST) -> list[ast.Call]:
    """Calls not nested in an `if` (or a conditional expression)."""
    out: list[ast.Call] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If | ast.IfExp):
                continue
            if isinstance(child, ast.Call):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def _literal_int(call: ast.Call, key: str) -> int | None:
    for kw in call.keywords:
        if kw.arg == key and isinstance(kw.value, ast.Constant) and isinstance(kw.value.value, int):
            return int(kw.value.value)
    return None


def script_problems(source: str, workers: int, filename: str = "<script>") -> list[str]:
    """Well-known mistakes visible in the script's source, each with what to change."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as e:
        return [f"{filename}:{e.lineno}: syntax error: {e.msg}"]
    out: list[str] = []
    for call in _unconditional_calls(tree):
        name = _name(call.func)
        where = f"{filename}:{call.lineno}: "
        if name == "init_process_group":
            out.append(where + OWN_PROCESS_GROUP)
        elif name in _DDP_NAMES:
            out.append(where + DDP_WRAPPED)
        elif name == "TrainerConfig":
            g, m = _literal_int(call, "global_batch_size"), _literal_int(call, "micro_batch_size")
            if g is not None and m is not None:
                out += [where + p for p in batch_problems(g, m, workers)]
    return out


def check_script(path: str | Path, workers: int) -> list[str]:
    """`script_problems` of the script file (unreadable: no problems; the worker will say)."""
    try:
        source = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return []
    return script_problems(source, workers, str(path))

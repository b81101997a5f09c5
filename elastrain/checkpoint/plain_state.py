"""Starting a job from a plain torch job's DCP checkpoint, trainer side.

`elastrain.checkpoint.plain` says what the checkpoint holds (`PlainLayout`);
this module checks it against the script's model and optimizer
(`ScriptState`: the same for a replicated and a sharded backend) and describes
it as a sharded checkpoint's *schema* (`elastrain.checkpoint.sharded_parts`), so
that the resume code of elastrain's own DCP checkpoints installs it with
nothing of its own: `replicated_state` then `install_checkpoint` (the heal's
checks) on a replicated member, `shard_source` on a sharded one. Pure
functions; local.

What the schema takes from where: the tensors (model, optimizer state) from
the checkpoint; the optimizer's class and hyperparameters (its param groups)
from the script, since a plain checkpoint's are pickled objects elastrain does
not read and the script is the user's word on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from elastrain.checkpoint.plain import (
    PlainCheckpointError,
    PlainLayout,
    PlainReader,
    TensorInfo,
    read_layout,
    read_step,
)
from elastrain.checkpoint.plain import resume_step as plain_resume_step
from elastrain.transfer import TorchState
from elastrain.transfer.flatten import OBJECTS_KEY, OBJECTS_PREFIX, optimizer_class
from elastrain.transfer.names import named_parameters
from elastrain.transfer.signature import model_signature

_JSON = (type(None), bool, int, float, str)


@dataclass(frozen=True)
class ScriptState:
    """What the script built, as far as a plain checkpoint must fit it."""

    tensors: dict[str, TensorInfo]
    """The model's state_dict names (no ``_orig_mod.``), in order -> dtype and shape."""
    params: list[str]
    """The model's parameters' names, in the model's order."""
    groups: list[dict[str, Any]]
    """The optimizer's param groups: hyperparameters, "params" as parameter names."""
    optimizer_class: str
    """The optimizer's class (module.qualname)."""

    @staticmethod
    def of_torch(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ScriptState:
        names = {id(p): n for n, p in named_parameters(model).items()}
        groups = []
        for g in optimizer.param_groups:
            if any(id(p) not in names for p in g["params"]):
                raise ValueError("the optimizer holds tensors that are not the model's parameters")
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [names[id(p)] for p in g["params"]],
                }  # fmt: skip
            )
        return ScriptState(
            _signature(model_signature(model)),
            list(named_parameters(model)),
            groups,
            optimizer_class(optimizer),
        )

    @staticmethod
    def of_sharded(model_schema: dict[str, Any]) -> ScriptState:
        """From `ShardedBackend.model_schema` (known before the member holds a shard)."""
        groups = [
            {**hyper, "params": list(names)}
            for hyper, names in zip(model_schema["hyper"], model_schema["groups"], strict=True)
        ]
        return ScriptState(
            _signature(model_schema["signature"]),
            [str(p[0]) for p in model_schema["params"]],
            groups,
            model_schema["class"],
        )


def _signature(entries: list[list[Any]]) -> dict[str, TensorInfo]:
    return {str(n): TensorInfo(str(d), tuple(int(x) for x in s)) for n, s, d in entries}


def _show(info: TensorInfo) -> str:
    return f"{list(info.shape)} {info.dtype}"


def plain_problem(layout: PlainLayout, script: ScriptState) -> str | None:
    """Why the script's model and optimizer cannot take the checkpoint, naming the
    first differing tensor (the script's state_dict order, then the checkpoint's
    extra tensors, then the optimizer state), or None when they can."""
    for name, mine in script.tensors.items():
        saved = layout.model.get(name)
        if saved is None:
            return f"it has no tensor {name!r} of this model ({_show(mine)})"
        if saved != mine:
            return (
                f"tensor {name!r} is {_show(saved)} in the checkpoint and "
                f"{_show(mine)} in this model"
            )
    extra = [n for n in layout.model if n not in script.tensors]
    if extra:
        return f"its tensor {extra[0]!r} is not in this model ({len(extra)} such)"
    updated = {n for g in script.groups for n in g["params"]}
    for name, entries in layout.optim.items():
        if name not in updated:
            return f"it has optimizer state for {name!r}, which this optimizer does not update"
        shape = script.tensors[name].shape
        for key, info in entries.items():
            if info.shape != shape and _numel(info.shape) != 1:
                return (
                    f"optimizer state {key!r} of {name!r} is {_show(info)}: only tensors "
                    f"shaped like the parameter ({list(shape)}) or one-element ones are loaded"
                )
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _hyper(group: dict[str, Any], i: int) -> dict[str, Any]:
    """A param group's hyperparameters as JSON (tuples as lists, as every elastrain
    checkpoint stores them); ValueError for a value JSON cannot carry."""
    out: dict[str, Any] = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, list | tuple) and all(isinstance(x, _JSON) for x in v):
            v = list(v)
        elif not isinstance(v, _JSON):
            raise ValueError(
                f"this optimizer's param group {i} has hyperparameter {k!r} of type "
                f"{type(v).__name__}: starting from a plain checkpoint needs JSON values"
            )
        out[k] = v
    return out


def plain_schema(layout: PlainLayout, script: ScriptState) -> dict[str, Any]:
    """The checkpoint as `ShardedBackend.checkpoint_schema` describes one (class,
    groups, params with their state entries, buffers), with the script's
    optimizer class and hyperparameters. Call after `plain_problem` said None."""
    groups = [{**_hyper(g, i), "params": list(g["params"])} for i, g in enumerate(script.groups)]
    params = []
    for n in script.params:
        mine = script.tensors[n]
        entries: list[list[Any]] = []
        for key, info in layout.optim.get(n, {}).items():
            if info.shape == mine.shape and mine.shape:
                entries.append([key, "rows", info.dtype])
            else:
                entries.append([key, "tensor", info.dtype, list(info.shape)])
        params.append([n, list(mine.shape), mine.dtype, entries])
    buffers = [
        [n, list(t.shape), t.dtype] for n, t in script.tensors.items() if n not in script.params
    ]
    return {
        "class": script.optimizer_class,
        "groups": groups,
        "params": params,
        "buffers": buffers,
    }


def with_script_objects(
    state: TorchState, tensors: dict[str, torch.Tensor], section: dict[str, Any]
) -> None:
    """Add the registered objects' (LR schedulers, scalers) current state to a
    flattened state built from a plain checkpoint, which has none of theirs: they
    keep what the script built (`install_checkpoint` installs every registered
    object, and refuses a state that lacks one)."""
    flat = state.flatten()
    section[OBJECTS_KEY] = flat.section[OBJECTS_KEY]
    for name, t in flat.tensors:
        if name.startswith(OBJECTS_PREFIX):
            tensors[name] = t.clone()


def plain_reader(
    directory: str, wanted_step: int | None, script: ScriptState
) -> tuple[int, dict[str, Any], PlainReader]:
    """A plain DCP directory's step, its schema against ``script`` and its reader;
    PlainCheckpointError if it does not fit this script's model and optimizer."""
    layout = read_layout(directory)
    step = plain_resume_step(read_step(directory, layout), wanted_step, directory)
    problem = plain_problem(layout, script)
    if problem is not None:
        raise PlainCheckpointError(
            f"{directory} does not fit this script's model and optimizer: {problem}"
        )
    return step, plain_schema(layout, script), PlainReader(directory, layout)

"""Starting a job from a plain torch job's DCP checkpoint, trainer side.

`elastrain.checkpoint.plain` says what the checkpoint holds (`PlainLayout`);
this module checks it against the script's model and optimizer and describes
it as a sharded checkpoint's *schema* (`elastrain.runtime.sharded_ckpt`), so
that the resume code of elastrain's own DCP checkpoints installs it
(`replicated_state`, then `install_checkpoint`'s heal checks) with nothing
of its own. Pure functions; local.

What the schema takes from where: the tensors (model, optimizer state) from
the checkpoint; the optimizer's class and hyperparameters (its param groups)
from the script, since a plain checkpoint's are pickled objects elastrain does
not read and the script is the user's word on them.
"""

from __future__ import annotations

from typing import Any

import torch

from elastrain.checkpoint.plain import PlainLayout, TensorInfo
from elastrain.transfer import TorchState
from elastrain.transfer.flatten import OBJECTS_KEY, OBJECTS_PREFIX, optimizer_class
from elastrain.transfer.names import model_state, named_parameters

_JSON = (type(None), bool, int, float, str)


def _show(info: TensorInfo) -> str:
    return f"{list(info.shape)} {info.dtype}"


def _mine(t: torch.Tensor) -> TensorInfo:
    return TensorInfo(str(t.dtype), tuple(int(x) for x in t.shape))


def plain_problem(
    layout: PlainLayout, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> str | None:
    """Why this model and optimizer cannot take the checkpoint, naming the first
    differing tensor (the script's state_dict order, then the checkpoint's
    extra tensors, then the optimizer state), or None when they can."""
    mine = model_state(model)
    for name, t in mine.items():
        saved = layout.model.get(name)
        if saved is None:
            return f"it has no tensor {name!r} of this model ({_show(_mine(t))})"
        if saved != _mine(t):
            return (
                f"tensor {name!r} is {_show(saved)} in the checkpoint and "
                f"{_show(_mine(t))} in this model"
            )
    extra = [n for n in layout.model if n not in mine]
    if extra:
        return f"its tensor {extra[0]!r} is not in this model ({len(extra)} such)"
    params = named_parameters(model)
    ids = {id(q) for g in optimizer.param_groups for q in g["params"]}
    updated = {n for n, p in params.items() if id(p) in ids}
    for name, entries in layout.optim.items():
        if name not in updated:
            return f"it has optimizer state for {name!r}, which this optimizer does not update"
        shape = tuple(params[name].shape)
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


def plain_schema(
    layout: PlainLayout, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """The checkpoint as `ShardedBackend.checkpoint_schema` describes one (class,
    groups, params with their state entries, buffers), with the script's
    optimizer class and hyperparameters. Call after `plain_problem` said None."""
    names = {id(p): n for n, p in named_parameters(model).items()}
    mine = model_state(model)
    groups, params = [], []
    for i, g in enumerate(optimizer.param_groups):
        group_names = [names[id(p)] for p in g["params"]]
        groups.append({**_hyper(g, i), "params": group_names})
        for n in group_names:
            t = mine[n]
            entries: list[list[Any]] = []
            for key, info in layout.optim.get(n, {}).items():
                if info.shape == tuple(t.shape) and t.dim() > 0:
                    entries.append([key, "rows", info.dtype])
                else:
                    entries.append([key, "tensor", info.dtype, list(info.shape)])
            params.append([n, list(t.shape), str(t.dtype), entries])
    in_opt = {n for g in groups for n in g["params"]}
    buffers = [[n, list(t.shape), str(t.dtype)] for n, t in mine.items() if n not in in_opt]
    return {
        "class": optimizer_class(optimizer),
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

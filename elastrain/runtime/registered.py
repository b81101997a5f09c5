"""A sharded member's registered objects: carried in the meta, hashed, re-pointed.

The replicated trainer carries its registered objects (an LR scheduler, a
user's counter) inside its `TorchState`, which a heal copies whole. A sharded
member's `TorchState` is its shard, healed only among its twins and, on a
reshard, not copied at all (rows move, the rest travels as JSON). Registered
state is replicated (every member of the job holds the same), so it travels
like the script's ``extra_state``: in the member's meta, which every path
carries (a twins' heal, a reshard's leader, a rolled-forward member's sender,
a checkpoint's writer, a resume). Tensors in a state dict travel inline
(dtype, shape, base64 bytes); dict order survives a checkpoint's sorted JSON
(`ordered_json`), because it decides the order of the state hash's entries.

The schedulers themselves need one more thing: a scheduler the script built
over the optimizer it gave the trainer steps that optimizer's param groups,
while the optimizer that steps is the trainer's own over the shard, rebuilt
whenever the shard is (placement, a reshard, a reset). `repoint` moves the
schedulers onto the new optimizer when it is built: the registered ones (and
the children of a registered `SequentialLR` or `ChainedScheduler`), and those
alive over the script's optimizer at the first placement (a scheduler the
script carries through ``extra_state=`` is not registered, and must step the
shard's optimizer all the same).

All functions are local (no communication).
"""

from __future__ import annotations

import base64
import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from elastrain.checkpoint.restore import from_ordered_json, ordered_json
from elastrain.transfer.flatten import Stateful, decode_refs, encode_object

REGISTERED_META = "registered"
"""The meta key of the registered objects' state (`objects_meta`)."""


def check_registrable(name: str, obj: Stateful, objects: Mapping[str, Stateful]) -> None:
    """Refuse ``obj`` under ``name`` now rather than at the first heal: ValueError for
    a bad or taken name, TypeError for state that cannot travel as tensors and JSON.
    The same rule for the replicated and the sharded trainer."""
    if not name or "/" in name or not name.isprintable():
        raise ValueError(f"cannot register {name!r}: a name is printable, non-empty, no '/'")
    if name in objects:
        raise ValueError(f"{name!r} is registered already")
    for attr in ("state_dict", "load_state_dict"):
        if not callable(getattr(obj, attr, None)):
            raise TypeError(f"cannot register {name!r}: a {type(obj).__name__} has no {attr}()")
    encode_object(name, obj, [])


def _tensor_json(t: torch.Tensor) -> list[Any]:
    c = t.detach().cpu().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
    return [str(c.dtype).removeprefix("torch."), list(c.shape), base64.b64encode(raw).decode()]


def _tensor_of(entry: list[Any]) -> torch.Tensor:
    dtype_name, shape, data = entry
    dtype = getattr(torch, dtype_name)
    raw = bytearray(base64.b64decode(data))
    if not raw:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).reshape(shape).clone()


def objects_meta(objects: Mapping[str, Stateful]) -> dict[str, Any]:
    """The registered objects' state as JSON: ``state`` (each object's state dict,
    tensors as references, `ordered_json`) and ``tensors`` (reference ->
    [dtype, shape, base64 bytes]). The same on every member holding the same state."""
    tensors: list[tuple[str, torch.Tensor]] = []
    section = {name: encode_object(name, obj, tensors) for name, obj in objects.items()}
    return meta_of_section(section, dict(tensors))


def meta_of_section(section: dict[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """`objects_meta`'s JSON from the objects' flattened section (tensor references)
    and their tensors by reference, e.g. as a replicated DCP checkpoint stores them
    (`elastrain.checkpoint.replicated_parts.saved_objects`)."""
    return {
        "state": ordered_json(section),
        "tensors": {ref: _tensor_json(t) for ref, t in tensors.items()},
    }


def load_objects_meta(objects: Mapping[str, Stateful], raw: dict[str, Any]) -> None:
    """Install what `objects_meta` returned on the member that sent or saved it.
    ValueError when its objects are not this member's (a script that registers
    other objects than its peers'), before any object is loaded."""
    section = from_ordered_json(raw["state"])
    if sorted(section) != sorted(objects):
        raise ValueError(
            f"registered objects differ: the state holds {sorted(section)}, this member "
            f"registered {sorted(objects)} (every member must register the same objects under "
            "the same names)"
        )
    tensors = {ref: _tensor_of(e) for ref, e in raw["tensors"].items()}
    for name, obj in objects.items():
        obj.load_state_dict(decode_refs(section[name], tensors))


OPTIMIZER_GROUPS_META = "optimizer_groups"
"""The meta key of the optimizer's hyperparameters per parameter group."""


def _plain(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, bool | int | float | str)
        or (isinstance(v, list | tuple) and all(_plain(x) for x in v))
    )


def optimizer_groups_meta(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyperparameters of each of `opt`'s parameter groups (lr, betas, weight
    decay, ...: what a scheduler stepped by the script's loop writes), JSON-plain
    values only. A sharded member that applies a kept step (a roll forward) never
    ran the script's loop for it: its registered scheduler comes from a peer's
    meta, and so must what that scheduler had written into the optimizer."""
    return [{k: v for k, v in g.items() if k != "params" and _plain(v)} for g in opt.param_groups]


def load_optimizer_groups(opt: torch.optim.Optimizer, raw: list[dict[str, Any]]) -> None:
    """Set what `optimizer_groups_meta` returned (a tuple stays a tuple: JSON made
    it a list, and the state digest sees the difference)."""
    if len(raw) != len(opt.param_groups):
        raise ValueError(
            f"the optimizer has {len(opt.param_groups)} parameter groups, the state {len(raw)}"
        )
    for group, got in zip(opt.param_groups, raw, strict=True):
        for k, v in got.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def schedulers_in(objects: Mapping[str, Stateful]) -> Iterator[Any]:
    """The registered objects that hold an optimizer as ``.optimizer`` (every torch LR
    scheduler, `ReduceLROnPlateau` included), and the children of a registered
    `SequentialLR`/`ChainedScheduler`, each once."""
    seen: set[int] = set()
    todo = list(objects.values())
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
            yield obj
        todo.extend(getattr(obj, "_schedulers", []))


def repoint(schedulers: Iterable[Any], new: torch.optim.Optimizer) -> int:
    """Make every scheduler in ``schedulers`` step ``new`` (the sharded trainer's
    optimizer, just rebuilt over this member's shard). Returns how many were moved.

    A scheduler reads and writes only its optimizer's ``param_groups`` (``lr``,
    ``initial_lr``), which the new optimizer was built with, so its next ``step()``
    sets the rate of the optimizer that steps. torch's schedulers also check, at
    their first step, that ``optimizer.step`` carries their call counter (a
    warning otherwise): the new optimizer's step gets one (`_count_steps`)."""
    moved = 0
    for sched in schedulers:
        if sched.optimizer is not new:
            sched.optimizer = new
            moved += 1
    if moved:
        _count_steps(new)
    return moved


def _count_steps(opt: torch.optim.Optimizer) -> None:
    """Mark ``opt.step`` the way torch's LR schedulers do when they are built over an
    optimizer (`_opt_called` set by each call), so that their check at the first
    ``step()`` sees the optimizer that steps."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    ref = weakref.ref(opt)
    inner = type(opt).step

    def step(*args: Any, **kwargs: Any) -> Any:
        o = ref()
        assert o is not None
        o._opt_called = True  # type: ignore[attr-defined]
        return inner(o, *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    opt.step = step  # type: ignore[method-assign]

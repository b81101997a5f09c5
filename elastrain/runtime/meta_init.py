"""Initialising a model built on the meta device, one module at a time.

A fresh sharded job whose model was built on the meta device
(``with torch.device("meta"): model = GPT(cfg)``) never holds the whole model:
each member walks the modules in a fixed order (``named_modules()``, pre-order,
the same on every member) and, for each module that owns parameters or buffers
itself (``recurse=False``):

1. materialises those tensors on the CPU as zeros (the module's children stay
   on the meta device);
2. seeds the torch RNG from (job seed, the module's qualified name) alone
   (`module_seed`), inside a forked RNG, so that no module's values depend on
   which modules were initialised before it, on which member runs it, or on the
   layout;
3. calls the module's ``reset_parameters()`` (or ``_reset_parameters()``, as
   torch's ``MultiheadAttention`` names it) if it has one, then the user's
   ``init_fn(module, name)`` if one is given;
4. keeps what it needs (a sharded member: its rows of each parameter, copied;
   every buffer, as buffers are replicated) and sends the module's tensors back
   to the meta device, freeing them.

So the largest full tensors a member ever holds at once are one module's own
parameters and buffers, plus its shard and the buffers kept, and the values are
a function of (seed, module name, module class, init_fn) only: 2 x 2 and 1 x 4
start from the same bits, and `materialize_whole` (the same walk over a whole
model, for a replicated job or a reference) gives the model those rows are
rows of.

The contract for ``reset_parameters`` and ``init_fn`` (what makes the three
equal): they initialise the module's *own* parameters and buffers in place,
from the torch RNG and from constants (the module's attributes, its qualified
name, the user's config), without reading other modules' tensors: when a
module's turn comes its children and the rest of the model are on the meta
device. Writes to another module's tensors are lost (that module is zeroed and
initialised in its own turn): where a parent's initialiser sets a child's
tensors (``MultiheadAttention`` zeroes its ``out_proj.bias``), the child's own
initialiser decides instead, so the start is not the eager constructor's
(it is the same on every member and layout); an ``init_fn`` that matches the
module's type and name restores such a choice. A parameter shared by several modules (tied
weights) takes the value its last owner's turn leaves, as in a plain
``for m in model.modules(): m.reset_parameters()``. An ``init_fn`` that wants
the whole model at once (torchtitan's ``model.init_weights()`` on the root)
cannot run here without the whole model in memory: write it per module,
dispatching on the module's type and name (``name.endswith("c_proj")``), or
materialise the model whole and pass it (every member then holds it once at
start).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

InitFn = Callable[[nn.Module, str], None]
"""``init_fn(module, name)``: initialise ``module``'s own parameters and buffers in
place (``name``: its qualified name in the model, "" for the root). Called for
every module that owns tensors, after its ``reset_parameters`` if it has one."""


class MetaModelUnfilled(ValueError):
    """A model built on the meta device, with no checkpoint and no peer to take its
    state from, and no way to initialise it (`ShardedBackend.place`)."""


@dataclass(frozen=True)
class ModuleTurn:
    """One module's turn in the walk: its qualified name, and its own parameters
    and buffers as (attribute, name in the model) pairs; the name is None where a
    later module owns the same tensor too (tied: the last owner's values are kept)."""

    name: str
    params: tuple[tuple[str, str | None], ...]
    buffers: tuple[tuple[str, str | None], ...]


def module_seed(seed: int, name: str) -> int:
    """The torch RNG seed of module ``name``'s initialisation in a job seeded ``seed``:
    a function of the two alone (a 63-bit digest), the same on every member."""
    digest = hashlib.sha256(f"elastrain-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def plan_turns(model: nn.Module) -> list[ModuleTurn]:
    """The walk's turns for ``model`` (pure; read before anything is materialised):
    every module owning parameters or buffers, in ``named_modules()`` order, each
    tensor named as in ``named_parameters()``/``named_buffers()`` at its last owner."""
    param_names = {id(p): n for n, p in model.named_parameters()}
    buffer_names = {id(b): n for n, b in model.named_buffers()}
    raw = []
    last: dict[int, int] = {}
    for i, (mname, mod) in enumerate(model.named_modules()):
        ps = [(a, p) for a, p in mod._parameters.items() if p is not None]
        bs = [(a, b) for a, b in mod._buffers.items() if b is not None]
        if not ps and not bs:
            continue
        for _, t in (*ps, *bs):
            last[id(t)] = i
        raw.append((i, mname, ps, bs))
    return [
        ModuleTurn(
            mname,
            tuple((a, param_names[id(p)] if last[id(p)] == i else None) for a, p in ps),
            tuple((a, buffer_names.get(id(b)) if last[id(b)] == i else None) for a, b in bs),
        )
        for i, mname, ps, bs in raw
    ]


def own_initialiser(module: nn.Module) -> Callable[[], None] | None:
    """The module's own initialiser: ``reset_parameters``, or ``_reset_parameters``
    (the name torch's ``MultiheadAttention`` gives it); None if it has neither."""
    for attr in ("reset_parameters", "_reset_parameters"):
        fn = getattr(module, attr, None)
        if callable(fn):
            return fn
    return None


def uninitialisable(model: nn.Module, init_fn: InitFn | None) -> list[str]:
    """The modules owning tensors that nothing would initialise (no
    ``reset_parameters`` and no ``init_fn``), as "name (Class)"; empty with an
    ``init_fn`` (it is then responsible for every module)."""
    if init_fn is not None:
        return []
    mods = dict(model.named_modules())
    return [
        f"{t.name or '<root>'} ({type(mods[t.name]).__name__})"
        for t in plan_turns(model)
        if own_initialiser(mods[t.name]) is None
    ]


def _initialise(module: nn.Module, name: str, seed: int, init_fn: InitFn | None) -> None:
    """Zero ``module``'s own (materialised) tensors and run its initialisers under the
    module's own seed. The zeros make a tensor no initialiser writes the same on
    every member (instead of whatever memory it was given)."""
    with torch.no_grad():
        for t in (*module._parameters.values(), *module._buffers.values()):
            if t is not None:
                t.zero_()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(module_seed(seed, name))
        reset = own_initialiser(module)
        if reset is not None:
            reset()
        if init_fn is not None:
            init_fn(module, name)


def init_by_module(
    model: nn.Module,
    seed: int,
    init_fn: InitFn | None,
    keep_param: Callable[[str, torch.Tensor], torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Walk a meta-device ``model`` (modified: each module is materialised in its turn
    and sent back to the meta device after it) and return ``keep_param(name, full)``
    for every parameter (a copy: a member's rows) and a copy of every buffer, by
    name. At most one module's own tensors are materialised at a time."""
    mods = dict(model.named_modules())
    params: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    for turn in plan_turns(model):
        mod = mods[turn.name]
        mod.to_empty(device="cpu", recurse=False)
        try:
            _initialise(mod, turn.name, seed, init_fn)
            with torch.no_grad():
                for attr, full in turn.params:
                    if full is not None:
                        params[full] = keep_param(full, mod._parameters[attr].detach())
                for attr, full in turn.buffers:
                    if full is not None:
                        buffers[full] = mod._buffers[attr].detach().clone()
        finally:
            mod.to_empty(device="meta", recurse=False)
    return params, buffers


def materialize_whole(model: nn.Module, seed: int, init_fn: InitFn | None = None) -> None:
    """Materialise a meta-device ``model`` whole on the CPU, in place, with the values
    a sharded job's members give their rows (`init_by_module`): the same walk, the
    same seeds. For a replicated job, or to check a sharded start against the whole
    model. Build the optimizer after this call (the parameters may be new objects).
    ValueError if a module owning tensors has nothing to initialise it."""
    missing = uninitialisable(model, init_fn)
    if missing:
        raise MetaModelUnfilled(missing_message(missing))
    turns = plan_turns(model)
    owners = [
        (table, attr, id(t))
        for mod in model.modules()
        for table in (mod._parameters, mod._buffers)
        for attr, t in table.items()
        if t is not None
    ]
    model.to_empty(device="cpu")
    # to_empty gives every module its own new tensor: tie shared ones again.
    first: dict[int, torch.Tensor] = {}
    for table, attr, key in owners:
        t = table[attr]
        assert t is not None
        table[attr] = first.setdefault(key, t)  # type: ignore[assignment]
    mods = dict(model.named_modules())
    for turn in turns:
        _initialise(mods[turn.name], turn.name, seed, init_fn)


def missing_message(missing: list[str]) -> str:
    """What to do about modules built on the meta device that nothing initialises."""
    shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
    return (
        f"the model was built on the meta device and these modules own parameters or buffers "
        f"but have no reset_parameters(): {shown}. Give them a reset_parameters() that "
        "initialises their own tensors, or pass init_fn(module, name) to the trainer "
        "(elastrain.runtime.meta_init), or resume the job from a checkpoint"
    )

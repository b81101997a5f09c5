"""Flattening model + optimizer state into named tensors plus JSON, and back.

Layout (the same on every rank with the same model and optimizer class):

- ``model/<key>`` for each ``model.state_dict()`` tensor, in state_dict order
  (the key without torch.compile's ``_orig_mod.`` segments, so a compiled
  model's state has its uncompiled model's names: `elastrain.transfer.names`);
- ``optim/<param_idx>/<key>`` for each optimizer state tensor, params in
  ascending index order, keys in the optimizer's order (a tensor nested in a
  list or dict gets ``/<i>`` or ``/<subkey>`` appended);
- ``optim/groups/<group_idx>/<key>`` for a tensor-valued param-group
  hyperparameter (e.g. a tensor ``lr``);
- ``obj/<name>/<key>`` for each tensor in the ``state_dict()`` of an object the
  trainer registered under ``name`` (an LR scheduler, a GradScaler, a user's
  counter), objects in registration order.

Everything else of the optimizer state dict stays JSON, with each tensor
replaced by ``{"$tensor": <entry name>}``; so do the registered objects' state
dicts, under the section's ``objects`` key. Nothing is pickled. All functions
here are local (no communication); `elastrain.transfer.torch_state.TorchState`
is the `NamedState` built on them.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
import xxhash

from elastrain.transfer.dtypes import byte_view, cpu_bytes
from elastrain.transfer.manifest import TENSOR_REF
from elastrain.transfer.names import model_state, named_parameters
from elastrain.transfer.signature import model_signature
from elastrain.transfer.state import FlatState, NamedState

MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
GROUPS_PREFIX = OPTIM_PREFIX + "groups/"
OBJECTS_PREFIX = "obj/"
OBJECTS_KEY = "objects"
"""The section's key for the registered objects' JSON state dicts."""


class Stateful(Protocol):
    """What a registered object must have: torch's `state_dict` convention (LR
    schedulers, `torch.amp.GradScaler`, a user's own object). Its state dict may
    hold tensors and JSON values only (str keys); nothing is pickled."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any], /) -> Any: ...


def optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    """The optimizer's fully qualified class name, as written in the manifest."""
    cls = type(optimizer)
    return f"{cls.__module__}.{cls.__qualname__}"


def _encode(value: Any, name: str, out: list[tuple[str, torch.Tensor]]) -> Any:
    if isinstance(value, torch.Tensor):
        out.append((name, value.detach()))
        return {TENSOR_REF: name}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_encode(v, f"{name}/{i}", out) for i, v in enumerate(value)]
    if isinstance(value, dict):
        enc: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, str) or k == TENSOR_REF:
                raise TypeError(f"state {name!r} has a dict key {k!r} that JSON cannot carry")
            enc[k] = _encode(v, f"{name}/{k}", out)
        return enc
    raise TypeError(
        f"state {name!r} holds a {type(value).__name__}; only tensors and JSON "
        "values (None, bool, int, float, str, list, dict) can be sent without pickle"
    )


def encode_object(name: str, obj: Stateful, out: list[tuple[str, torch.Tensor]]) -> Any:
    """The JSON of a registered object's state dict; its tensors appended to ``out``
    as ``obj/<name>/...``. TypeError for state that cannot travel as tensors + JSON."""
    return _encode(obj.state_dict(), f"{OBJECTS_PREFIX}{name}", out)


def flatten_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Stateful] | None = None,
    walked: dict[str, Any] | None = None,
) -> FlatState:
    """Name every tensor of the model's state_dict, the optimizer's state dict and
    the registered objects' state dicts (``walked``: the model's `model_state`, if
    walked already).

    The returned tensors alias the live state (no copies). ``stable`` names the
    parameters the optimizer updates and the optimizer's per-parameter state:
    only its ``step()`` writes them. Raises TypeError for state that cannot
    travel as tensors + JSON.
    """
    walked = model_state(model) if walked is None else walked
    model_signature(model, walked)  # raises TypeError on non-tensor state_dict values
    tensors: list[tuple[str, torch.Tensor]] = [
        (MODEL_PREFIX + k, v.detach()) for k, v in walked.items()
    ]
    osd = optimizer.state_dict()
    state: dict[str, Any] = {}
    for idx in sorted(osd["state"]):
        state[str(idx)] = _encode(osd["state"][idx], f"{OPTIM_PREFIX}{idx}", tensors)
    groups = [_encode(g, f"{GROUPS_PREFIX}{i}", tensors) for i, g in enumerate(osd["param_groups"])]
    encoded = {name: encode_object(name, obj, tensors) for name, obj in (objects or {}).items()}
    section = {
        "class": optimizer_class(optimizer),
        "param_groups": groups,
        "state": state,
        OBJECTS_KEY: encoded,
    }
    updated = {id(p) for g in optimizer.param_groups for p in g["params"]}
    stable = {MODEL_PREFIX + n for n, p in named_parameters(model).items() if id(p) in updated}
    stable.update(
        n for n, _ in tensors if n.startswith(OPTIM_PREFIX) and not n.startswith(GROUPS_PREFIX)
    )
    return FlatState(tensors, section, frozenset(stable))


def copy_bytes_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Overwrite ``dst``'s bytes in place with the uint8 tensor ``src``."""
    with torch.no_grad():
        if dst.is_contiguous():
            dst.reshape(-1).view(torch.uint8).copy_(src)
        else:
            tmp = torch.empty(dst.shape, dtype=dst.dtype)
            byte_view(tmp).copy_(src)
            dst.copy_(tmp)


def decode_refs(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of the flattening's JSON encoding: ``{"$tensor": name}`` becomes ``tensors[name]``."""
    if isinstance(value, dict):
        if TENSOR_REF in value:
            return tensors[value[TENSOR_REF]]
        return {k: decode_refs(v, tensors) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_refs(v, tensors) for v in value]
    return value


def state_hash(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """`state_digest` of a model and its optimizer (see there)."""
    from elastrain.transfer.torch_state import TorchState

    return state_digest(TorchState(model, optimizer))


DIGEST_LABEL = b"elastrain/state-digest/2\0"
"""What `state_digest` hashes first: names the digest's definition (2: XXH3-128;
1 was a Poly1305 tag under a fixed key), so that digests of different definitions
are not taken for one another."""


def state_digest(state: NamedState) -> str:
    """A 128-bit digest (32 hex digits) of a member's full state, in its fixed order.

    Covers every named tensor (name, dtype, shape and raw bytes) plus the JSON
    section (torch: the optimizer's class, param_groups with every
    hyperparameter such as ``lr``, its non-tensor state and the registered
    objects' state): everything that decides the next step but the global RNG,
    which travels in the meta and which a step does not read (each
    micro-batch's RNG is seeded from (seed, step, micro-batch)).
    Two members with bit-identical state get the same digest; JSON turning
    tuples into lists does not change it. Local and read-only; hashes the
    tensors' memory in place (no copy for contiguous CPU tensors).

    What it is for: showing that members hold the same state (the
    `generation_start` events, `elastrain.observe.ledger`), where a state that
    diverged by a bug or a lost update must not pass for the same one. It is
    XXH3-128 (the ``xxhash`` package), a non-cryptographic hash built for
    exactly that: telling apart data that differ by accident, with 128 bits of
    output. It is not a defence against someone who chooses a state to collide,
    and nothing here trusts it for that. A digest-mode heal checks what a
    receiver installs against it (the expected value travels in the manifest,
    sealed under the job token): that catches damage and a sender whose state
    differs, while a party able to write chosen bytes into the group's
    connections could equally write the gradients (docs/design/trust.md); a
    mac-mode heal seals every stripe instead (`elastrain.transfer.seal`). Why XXH3: every
    member hashes its whole state at every generation start, on a thread beside
    the first step. XXH3 runs at about 11 GB/s here and releases the GIL while
    it hashes, so the training thread's Python is not held up by it; SHA-256
    ran at 1.1 GB/s, and Poly1305 (the digest until 2026-12-04) at 4.8 GB/s
    holding the GIL (docs/design/heal.md, "The first step after a join"; benchmarks/digest.py).
    """
    return flat_digest(state.flatten())


def flat_digest(flat: FlatState) -> str:
    """`state_digest` of an already flattened state (a sender's `FlatState`)."""
    h = digest_hasher(((n, t.dtype, t.shape) for n, t in flat.tensors), flat.section)
    for _, t in flat.tensors:
        if t.numel():
            h.update(cpu_bytes(t).numpy().data)
    return h.hexdigest()


def digest_hasher(
    layout: Iterable[tuple[str, torch.dtype, Sequence[int]]], section: dict[str, Any]
) -> xxhash.xxh3_128:
    """The running `state_digest` of a state with this layout (name, dtype, shape per
    tensor, in order) and JSON section, its label and header already hashed: feed it
    the tensors' raw bytes in order (how they are cut does not matter) and read
    ``hexdigest()``. A heal's receiver feeds it the payload as it lands."""
    header = {
        "tensors": [[n, str(d), list(s)] for n, d, s in layout],
        "optimizer": section,
    }
    h = xxhash.xxh3_128(DIGEST_LABEL)
    h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    return h


def digest_input(state: NamedState) -> Iterator[bytes | memoryview]:
    """What `state_digest` hashes, in order: a JSON header (every tensor's name,
    dtype and shape, and the section), then each non-empty tensor's raw bytes
    (in place for a contiguous CPU tensor)."""
    flat = state.flatten()
    header = {
        "tensors": [[n, str(t.dtype), list(t.shape)] for n, t in flat.tensors],
        "optimizer": flat.section,
    }
    yield json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    for _, t in flat.tensors:
        if t.numel():
            yield cpu_bytes(t).numpy().data

"""Sharded checkpoints, trainer side: who writes which rows, and resume on any R x S.

The storage (`elastrain.checkpoint.dcp`) knows chunks and files; this module
knows the sharded layout (docs/design/sharded-checkpoints.md):

- **Who writes.** Per shard index k, the holder of shard k in the lowest
  replica group of the generation (`writer_shard`; a shadow holds its shard up
  to date, so it may be the one). It writes its rows of every parameter and of
  the optimizer state shaped like them. Writer 0 also writes what is not
  sharded (buffers, Adam's ``step``). Nobody gathers anything: S writers, each
  its shard's bytes. Rank 0 of the generation commits (it may write or not).
- **What else.** Every writer's meta: the engine's (committed count, last loss,
  checkpoint schedule, RNG, the script's extra state), ``framework``, and the
  ``schema`` (`ShardedBackend.checkpoint_schema`): the optimizer's class, its
  param groups, the kind of each optimizer state entry; the marker keeps
  writer 0's.
- **Resume, sharded** (`shard_source`): a member of the new layout (any R x S)
  reads the rows ``shard_rows(rows, S, shard)`` of each tensor it needs, from
  whichever saved chunks hold them, when it takes its slot (its first `place`).
- **Resume, replicated** (`replicated_state`, the "R x 1" case): a member of an
  unsharded job reads every tensor whole and installs it as the replicated
  trainer's flattened state, with the heal's own checks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from elastrain.checkpoint import VerifiedCheckpoint
from elastrain.checkpoint.dcp import (
    Chunk,
    ShardedReader,
    ShardParts,
    model_key,
    optim_key,
    row_count,
)
from elastrain.checkpoint.plain import PlainCheckpointError
from elastrain.checkpoint.plain_state import ScriptState, plain_reader
from elastrain.checkpoint.restore import NOT_THIS_MODEL, ResumeError, ordered_json
from elastrain.control.layout import Layout
from elastrain.runtime.sharded import ResumedShard, ShardedBackend, shard_rows
from elastrain.transfer import TorchState
from elastrain.transfer.flatten import (
    MODEL_PREFIX,
    OBJECTS_PREFIX,
    OPTIM_PREFIX,
    Stateful,
    encode_object,
)
from elastrain.transfer.manifest import TENSOR_REF
from elastrain.transfer.names import model_state, named_parameters


class TensorReader(Protocol):
    """What resume reads from: `ShardedReader`, or a plain torch job's checkpoint
    (`elastrain.checkpoint.plain.PlainReader`), by DCP key."""

    bytes_read: int

    def has(self, key: str) -> bool: ...

    def read(self, key: str) -> torch.Tensor: ...

    def read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor: ...

    def close(self) -> None: ...


OBJECTS_META = "objects"
"""The meta key of the registered objects' JSON state (tensors as references), in a
replicated and in a sharded DCP checkpoint; their tensors are `object_key`s."""


def objects_section(
    objects: Mapping[str, Stateful],
) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """The registered objects' JSON state (tensor references) and their tensors."""
    tensors: list[tuple[str, torch.Tensor]] = []
    section = {name: encode_object(name, obj, tensors) for name, obj in objects.items()}
    return section, tensors


class ResumeMismatch(ValueError):
    """The checkpoint's model or optimizer is not this script's."""


def writer_shard(layout: Layout, member: str) -> int | None:
    """The shard index `member` writes in a checkpoint of this generation, or None:
    each shard's holder in the lowest replica group writes it."""
    slot = layout.slots.get(member)
    if slot is None:
        return None
    twins = layout.twins(slot.shard)
    return slot.shard if twins and twins[0] == member else None


def object_key(name: str) -> str:
    """The DCP key of a registered object's tensor in a replicated job's checkpoint,
    from its flattened name (``obj/<object>/<path>`` -> ``objects.<object>/<path>``;
    torch's ``dcp.load`` of ``{"model", "optim"}`` leaves such keys alone)."""
    if not name.startswith(OBJECTS_PREFIX):
        raise ValueError(f"{name!r} is not a registered object's tensor")
    return f"objects.{name[len(OBJECTS_PREFIX) :]}"


def declared_tensors(schema: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of a checkpoint with this schema: DCP key -> (dtype, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape, dtype, entries in schema["params"]:
        out[model_key(name)] = (dtype, tuple(shape))
        for e in entries:
            if e[1] == "rows":
                out[optim_key(name, e[0])] = (e[2], tuple(shape))
            elif e[1] == "tensor":
                out[optim_key(name, e[0])] = (e[2], tuple(e[3]))
    for name, shape, dtype in schema["buffers"]:
        out[model_key(name)] = (dtype, tuple(shape))
    # A replicated job's (`elastrain.checkpoint.replicated_parts`): its registered objects'.
    for name, shape, dtype in schema.get("objects", []):
        out[object_key(name)] = (dtype, tuple(shape))
    return out


def shard_parts(backend: ShardedBackend, meta: dict[str, Any], shard: int) -> ShardParts:
    """What writer `shard` writes: its chunks, the checkpoint's tensor list and
    its meta with the schema (aliases of the live tensors: snapshot them now).

    The registered objects are in the meta already (the backend's ``registered``,
    which a sharded resume reads); they are also written as a replicated DCP
    checkpoint writes them (their JSON under ``objects``, their tensors by writer
    0 under `object_key`s), so that a replicated job resumes them too."""
    schema = backend.checkpoint_schema()
    chunks = backend.checkpoint_chunks(schema, whole=shard == 0)
    more: dict[str, Any] = {}
    if backend.objects:
        section, tensors = objects_section(backend.objects)
        schema["objects"] = [[n, [int(x) for x in t.shape], str(t.dtype)] for n, t in tensors]
        more[OBJECTS_META] = ordered_json(section)
        if shard == 0:
            chunks += [Chunk(object_key(n), 0, row_count(tuple(t.shape)), t) for n, t in tensors]
    return ShardParts(declared_tensors(schema), chunks, {**meta, "schema": schema, **more})


def schema_problem(schema: dict[str, Any], backend: ShardedBackend) -> str | None:
    """Why this sharded backend cannot take a checkpoint with `schema`, or None."""
    mine = backend.model_schema()
    theirs = [[n, list(s), d] for n, s, d, _ in schema["params"]]
    if theirs != mine["params"]:
        return (
            f"its parameters {_describe(theirs)} are not this model's {_describe(mine['params'])}"
        )
    if schema["class"] != mine["class"]:
        return f"its optimizer is {schema['class']}, this script's {mine['class']}"
    if [g["params"] for g in schema["groups"]] != mine["groups"]:
        return "its optimizer's param groups hold other parameters than this script's"
    return None


def _describe(params: list[list[Any]]) -> str:
    head = ", ".join(f"{n} {s} {d}" for n, s, d in params[:3])
    return f"[{head}{', ...' if len(params) > 3 else ''}] ({len(params)})"


def shard_source(
    reader: TensorReader,
    schema: dict[str, Any],
    on_read: Callable[[int, float], None] | None = None,
) -> Callable[[int, int], ResumedShard]:
    """`ShardedBackend.resume_from`'s source: the rows of shard `shard` of `size`
    of every parameter and of its row-shaped optimizer state, the one-element
    state, the JSON values, the param groups and the buffers, read from the
    saved chunks that hold them. ``on_read(bytes, seconds)`` is called once read;
    the reader is closed then."""

    def read(size: int, shard: int) -> ResumedShard:
        t0 = time.monotonic()
        rows: dict[str, torch.Tensor] = {}
        state: dict[str, dict[str, Any]] = {}
        try:
            for name, shape, _, entries in schema["params"]:
                lo, hi = shard_rows(row_count(shape), size, shard)
                rows[name] = reader.read_rows(model_key(name), lo, hi)
                st: dict[str, Any] = {}
                for e in entries:
                    key, kind = e[0], e[1]
                    if kind == "rows":
                        st[key] = reader.read_rows(optim_key(name, key), lo, hi)
                    elif kind == "tensor":
                        st[key] = reader.read(optim_key(name, key))
                    else:
                        st[key] = e[2]
                if st:
                    state[name] = st
            buffers = {name: reader.read(model_key(name)) for name, _, _ in schema["buffers"]}
        finally:
            reader.close()
        if on_read is not None:
            on_read(reader.bytes_read, time.monotonic() - t0)
        return ResumedShard(rows, state, [dict(g) for g in schema["groups"]], buffers)

    return read


def replicated_state(
    reader: TensorReader, schema: dict[str, Any], state: TorchState
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A sharded checkpoint as the replicated trainer's flattened state: the
    tensors (``model/<key>``, ``optim/<index>/<key>``) and the optimizer section,
    for `elastrain.checkpoint.restore.install_checkpoint` (which checks them against
    the model and optimizer). Reads every tensor whole. ResumeMismatch when the
    checkpoint lacks a tensor of the model or a parameter of the optimizer."""
    tensors: dict[str, torch.Tensor] = {}
    for key in model_state(state.model):  # a compiled model's too: no _orig_mod. prefix
        fqn = model_key(key)
        if not reader.has(fqn):
            raise ResumeMismatch(f"it has no tensor {key!r} of this model")
        tensors[MODEL_PREFIX + key] = reader.read(fqn)
    names = {id(p): n for n, p in named_parameters(state.model).items()}
    order = [names.get(id(p)) for g in state.optimizer.param_groups for p in g["params"]]
    if None in order:
        raise ResumeMismatch("this optimizer holds tensors that are not the model's parameters")
    index = {n: i for i, n in enumerate(order)}
    saved = {n: entries for n, _, _, entries in schema["params"]}
    section_state: dict[str, Any] = {}
    for i, n in enumerate(order):
        assert n is not None
        if n not in saved:
            raise ResumeMismatch(f"it has no optimizer state for parameter {n!r}")
        st: dict[str, Any] = {}
        for e in saved[n]:
            key, kind = e[0], e[1]
            if kind == "value":
                st[key] = e[2]
                continue
            name = f"{OPTIM_PREFIX}{i}/{key}"
            tensors[name] = reader.read(optim_key(n, key))
            st[key] = {TENSOR_REF: name}
        if st:
            section_state[str(i)] = st
    groups = []
    for g in schema["groups"]:
        if any(n not in index for n in g["params"]):
            raise ResumeMismatch("its param groups name parameters this optimizer lacks")
        groups.append({**g, "params": [index[n] for n in g["params"]]})
    reader.close()
    return tensors, {"class": schema["class"], "param_groups": groups, "state": section_state}


def restore_rows(
    ckpt: VerifiedCheckpoint,
    meta: dict[str, Any],
    backend: ShardedBackend,
    on_read: Callable[[int, float], None],
) -> None:
    """Check DCP checkpoint ``ckpt`` against this sharded model now and hand
    ``backend`` the source of its slot's rows, which it reads when it takes its
    slot (its first `place`, whatever the layout), then calls ``on_read(bytes,
    seconds)``. ResumeError if it does not fit this model and optimizer."""
    schema = meta["schema"]
    reader = ShardedReader(ckpt)
    problem = schema_problem(schema, backend)
    if problem is not None:
        reader.close()
        raise ResumeError(
            f"checkpoint {ckpt.path} does not fit this model and optimizer: {problem}. "
            + NOT_THIS_MODEL
        )
    backend.resume_from(shard_source(reader, schema, on_read))


def read_plain_rows(
    directory: str, wanted_step: int | None, backend: ShardedBackend
) -> tuple[int, Callable[[Callable[[int, float], None]], None]]:
    """Check a plain torch DCP checkpoint against this sharded model now: its step
    and the function that hands ``backend`` the source of its slot's rows
    (read when it takes its slot). PlainCheckpointError if it does not fit."""
    mine = backend.model_schema()
    if backend.on_meta and mine["nonpersistent_buffers"]:
        raise PlainCheckpointError(
            "this model is built on the meta device and its buffers "
            f"{mine['nonpersistent_buffers'][:3]} are not in its state_dict "
            "(persistent=False), so no plain checkpoint holds them: build the "
            "model on a real device to start from one"
        )
    step, schema, reader = plain_reader(directory, wanted_step, ScriptState.of_sharded(mine))
    problem = schema_problem(schema, backend)
    if problem is not None:
        raise PlainCheckpointError(f"{directory}: {problem}")

    def install(on_read: Callable[[int, float], None]) -> None:
        backend.resume_from(shard_source(reader, schema, on_read))

    return step, install

"""A replicated job's checkpoints in DCP format (``--ckpt-format dcp``).

The storage, the commit and the read side are the sharded checkpoints'
(`elastrain.checkpoint.dcp`, `elastrain.checkpoint.sharded_parts`); this module says
what a replicated member writes (docs/design/checkpoints.md, "Replicated checkpoints in DCP
format"):

- **Schema** (`replicated_schema`): the sharded checkpoint's (`ShardedBackend.
  checkpoint_schema`, the same entry logic: `state_entries`, `group_entries`)
  of the whole `TorchState`: the optimizer's class, its param groups with
  parameter names, per parameter its shape, dtype and optimizer state entries,
  the model's other ``state_dict`` tensors (buffers), and the registered
  objects' tensors (``objects``).
- **Who writes what** (`replicated_parts`): every member holds every tensor, so
  the rows are split over the members as a shard size of ``n`` would split them:
  member ``rank`` of ``n`` writes rows ``shard_rows(rows, n, rank)`` of every
  parameter and of its row-shaped optimizer state (``defer``: copied in the
  background until the next optimizer step, as the flat format's stripes are),
  and member 0 also the one-element optimizer state, the buffers and the
  registered objects' tensors (small; copied at once). No gather: each member
  writes 1/n of the bytes. Rank 0 commits (`SaveRole.replicated`).
- **Registered objects** (LR schedulers, grad scalers) travel as in the flat
  format: their JSON state in the meta (``objects``, `ordered_json`), their
  tensors, if any, as DCP keys ``objects.<name>/<path>`` (`object_key`), which
  torch's `dcp.load` of ``{"model", "optim"}`` ignores. `saved_objects` reads
  them back on resume.

Local; no communication (the all-reduce that agreed on the checkpoint is the
step's).
"""

from __future__ import annotations

from typing import Any

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
from elastrain.checkpoint.plain_state import ScriptState, plain_reader, with_script_objects
from elastrain.checkpoint.restore import (
    NOT_THIS_MODEL,
    ResumeError,
    from_ordered_json,
    install_checkpoint,
    ordered_json,
)
from elastrain.checkpoint.sharded_parts import (
    OBJECTS_META,
    ResumeMismatch,
    TensorReader,
    declared_tensors,
    object_key,
    objects_section,
    replicated_state,
)
from elastrain.runtime.sharded import group_entries, shard_rows, state_entries
from elastrain.transfer import NamedState, TorchState
from elastrain.transfer.flatten import OBJECTS_KEY, optimizer_class
from elastrain.transfer.manifest import tensor_refs
from elastrain.transfer.names import model_state, named_parameters


def _objects(state: TorchState) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """The registered objects' JSON state (tensor references) and their tensors."""
    return objects_section(state.objects)


def replicated_schema(state: TorchState) -> dict[str, Any]:
    """What a replicated DCP checkpoint says of ``state`` besides the tensors
    (JSON, the keys of `ShardedBackend.checkpoint_schema` plus ``objects``:
    ``[flattened name, shape, dtype]`` of each registered object's tensor).

    ``params`` in the model's parameter order (`named_parameters`: a compiled
    model's names without ``_orig_mod.``), ``buffers`` every other
    ``state_dict`` tensor. ValueError for what DCP cannot carry here: an
    optimizer over tensors that are not the model's parameters, optimizer state
    that is neither row-shaped, one-element nor JSON, hyperparameters that are
    not JSON, or a ``state_dict`` entry that is not a tensor (the checkpoint
    then fails with a `checkpoint_failed` event; training goes on)."""
    params = named_parameters(state.model)
    names = {p: n for n, p in params.items()}
    opt = state.optimizer
    if any(p not in names for g in opt.param_groups for p in g["params"]):
        raise ValueError(
            "the optimizer holds tensors that are not the model's parameters: a DCP "
            "checkpoint names optimizer state by parameter (use --ckpt-format flat)"
        )
    entries = [
        [n, [int(x) for x in p.shape], str(p.dtype), state_entries(n, p, opt.state)]
        for n, p in params.items()
    ]
    buffers = []
    for k, t in model_state(state.model).items():
        if k in params:
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"state_dict entry {k!r} is a {type(t).__name__}, not a tensor: a DCP "
                "checkpoint carries tensors only (use --ckpt-format flat)"
            )
        buffers.append([k, [int(x) for x in t.shape], str(t.dtype)])
    _, objects = _objects(state)
    return {
        "class": optimizer_class(opt),
        "groups": group_entries(opt, names),
        "params": entries,
        "buffers": buffers,
        "nonpersistent_buffers": [],  # only state_dict entries are written
        "objects": [[n, [int(x) for x in t.shape], str(t.dtype)] for n, t in objects],
    }


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``t`` as a view (a 0-dim tensor is one row)."""
    return t.reshape(1)[lo:hi] if t.dim() == 0 else t[lo:hi]


def replicated_parts(
    state: TorchState, meta: dict[str, Any], rank: int, members: int
) -> ShardParts:
    """What member ``rank`` of ``members`` writes of a replicated DCP checkpoint:
    its rows of every parameter and row-shaped optimizer state; member 0 also the
    one-element optimizer state, the buffers and the registered objects' tensors.
    The chunks alias the live tensors (snapshot them now); the meta gets the
    schema and the registered objects' JSON. ValueError as `replicated_schema`."""
    if members < 1 or not 0 <= rank < members:
        raise ValueError(f"need 0 <= rank < members, got rank {rank} of {members}")
    schema = replicated_schema(state)
    params = named_parameters(state.model)
    opt = state.optimizer
    # Only the optimizer step writes what it updates (and its state): copied in the
    # background until `settle`. A parameter it does not update may be written by
    # anything (a frozen embedding a script edits): copied at once.
    updated = {id(p) for g in opt.param_groups for p in g["params"]}
    first = rank == 0
    chunks: list[Chunk] = []
    for name, shape, _, entries in schema["params"]:
        p = params[name].detach()
        st = opt.state.get(params[name], {})
        lo, hi = shard_rows(row_count(shape), members, rank)
        if hi > lo:
            chunks.append(
                Chunk(model_key(name), lo, hi, _rows(p, lo, hi), defer=id(params[name]) in updated)
            )
            chunks.extend(
                Chunk(optim_key(name, e[0]), lo, hi, _rows(st[e[0]], lo, hi), defer=True)
                for e in entries
                if e[1] == "rows"
            )
        if first:
            chunks.extend(
                Chunk(optim_key(name, e[0]), 0, 1, st[e[0]]) for e in entries if e[1] == "tensor"
            )
    section, objects = _objects(state)
    if first:
        sd = model_state(state.model)
        for name, shape, _ in schema["buffers"]:
            chunks.append(Chunk(model_key(name), 0, row_count(shape), sd[name]))
        for name, t in objects:
            chunks.append(Chunk(object_key(name), 0, row_count(tuple(t.shape)), t))
    return ShardParts(
        declared_tensors(schema),
        [c for c in chunks if c.hi > c.lo],
        {**meta, "schema": schema, OBJECTS_META: ordered_json(section)},
    )


def saved_objects(
    reader: TensorReader, meta: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]] | None:
    """The registered objects of a replicated DCP checkpoint, for the flattened
    state `install_checkpoint` takes: their section (tensor references by
    flattened name) and tensors; None if the checkpoint has none recorded (a
    sharded job's: a script that registers objects is then refused by the
    install's own check). ValueError if a referenced tensor is missing."""
    raw = meta.get(OBJECTS_META)
    if raw is None:
        return None
    section = from_ordered_json(raw)
    tensors: dict[str, torch.Tensor] = {}
    for ref in tensor_refs(section):
        key = object_key(ref)
        if not reader.has(key):
            raise ValueError(f"registered object tensor {ref!r} is not in the checkpoint")
        tensors[ref] = reader.read(key)
    return section, tensors


def restore_whole(
    ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], state: NamedState
) -> int:
    """Install checkpoint ``ckpt`` whole into ``state`` (the caller adopts it): a
    flat one as `load_resume` read it (``tensors``), a DCP one (a replicated
    job's rows or a sharded job's shards) read whole now. Returns the bytes
    read; ResumeError if it does not fit this model and optimizer."""
    if ckpt.kind != "dcp":
        install_checkpoint(state, tensors, from_ordered_json(meta["optimizer"]), str(ckpt.path))
        return ckpt.total_bytes
    reader = ShardedReader(ckpt)
    if not isinstance(state, TorchState):
        raise ResumeError(
            f"checkpoint {ckpt.path} is sharded (DCP): a PyTorch job's, or a JAX job's of "
            "multi-process replicas (--replica-procs K > 1, any K resumes it); this "
            f"{state.kind} job of one process a member reads flat ones only"
        )
    try:
        tensors, section = replicated_state(reader, meta["schema"], state)
        objects = saved_objects(reader, meta)
    except (ResumeMismatch, ValueError) as e:
        raise ResumeError(
            f"checkpoint {ckpt.path} does not fit this model and optimizer: {e}. " + NOT_THIS_MODEL
        ) from None
    if objects is not None:  # a replicated job's: its registered objects too
        section[OBJECTS_KEY], more = objects
        tensors.update(more)
    install_checkpoint(state, tensors, section, str(ckpt.path))
    return reader.bytes_read


def read_plain_whole(directory: str, wanted_step: int | None, state: NamedState) -> tuple[int, int]:
    """Read a plain torch DCP checkpoint whole into ``state`` now (the caller
    adopts it): its step and the bytes read. PlainCheckpointError (or a
    ResumeMismatch) if it does not fit this script's model and optimizer."""
    if not isinstance(state, TorchState):
        raise PlainCheckpointError("a JAX job cannot start from a torch.distributed.checkpoint")
    script = ScriptState.of_torch(state.model, state.optimizer)
    step, schema, reader = plain_reader(directory, wanted_step, script)
    reader.read_all()
    tensors, section = replicated_state(reader, schema, state)
    with_script_objects(state, tensors, section)
    install_checkpoint(state, tensors, section, directory)
    return step, reader.bytes_read

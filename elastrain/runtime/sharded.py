"""The sharded PyTorch backend: one shard of the model per member, FSDP2 inside a replica group.

A job of N members runs as R replica groups x S shards (`TrainerConfig.shard_size`
= S; the coordinator assigns each member a slot (replica, shard), see
`elastrain.control.layout`). What this member holds is its shard: the rows
``torch.chunk(param, S, dim=0)[shard]`` of every parameter (FSDP2's own
``Shard(0)`` layout) and the optimizer state of those rows. Those tensors are
the member's state: heal, the state hash and the optimizer all work on them,
whatever the process groups of the moment.

Who does what in a step:

- A member of a *complete* replica group runs forward and backward through an
  FSDP2 wrapper of the model built on its replica group's process group: the
  wrapper all-gathers the parameters from the group and reduce-scatters the
  gradient back to the shards, with a divide factor of 1; a hook adds each
  reduce-scatter's output into this member's shard buffer (FSDP2's own
  ``.grad`` is ignored). `TrainerConfig.reduce_dtype` picks how:

  - "float64" (the default, exact): every micro-batch's gradient is
    reduce-scattered in float64, so the buffer (float64) holds the exact sum
    of the group's float32 micro-batch gradients;
  - "native": FSDP2's own gradient accumulation. Autograd sums this member's
    micro-batch gradients into the unsharded gradient (no communication), and
    only the step's last round reduce-scatters it, once, in the parameters'
    dtype, into a buffer of that dtype. With float32 parameters that is a
    quarter of the reduce-scatter bytes at 2 rounds per step (one reduction
    instead of two, half as wide) and half the twins' all-reduce bytes, at the
    price of a sum whose last bits depend on who computed which micro-batch,
    and of the unsharded gradient held across rounds (as with HSDP's no-sync
    accumulation).
- A *shadow* (its replica group lost a member) computes nothing: its buffer
  stays zero. It keeps its process and its shard and applies every update, so
  that a replacement needs only the dead member's shard, from its twins.
- The engine all-reduces the shard buffer over the shard's twins (every member
  with the same shard index, complete or shadow), then `norm_vector` divides
  the sum by the global batch (with float64, one rounding of the exact sum to
  the parameters' dtype) and the generation all-reduces its rows' sums of
  squares (the global norm and found-inf, `elastrain.runtime.shard_step`),
  then the step's extras over the whole generation (in float64 in both
  modes). `apply` clips, runs the script's hook and the GradScaler, and steps
  the optimizer over the shard tensors: the same bits as the replicated
  trainer's update of the same rows, whichever members computed which
  micro-batches.

What FSDP2 cannot do, and this module does instead: keep a member's shard
alive across process groups. FSDP2 binds a wrapper to its mesh for good, so a
new replica group means a new wrapper (built from a meta-device template,
0.1 s for a 1M-parameter model) whose shard storage is then made the storage
of this member's shard parameters, so the optimizer and its state carry over
untouched.

The replica group's process group is torch's default process group (FSDP2 and
DTensor read the global rank from it); it lives as long as the group's
membership does and is rebuilt when it changes (`form_group`).
"""

from __future__ import annotations

import copy
import datetime
import json
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastrain.checkpoint.dcp import Chunk, model_key, optim_key, row_count
from elastrain.runtime.backend import Update
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.device import resolve_reduce_dtype
from elastrain.runtime.meta_init import (
    InitFn,
    MetaModelUnfilled,
    init_by_module,
    missing_message,
    uninitialisable,
)
from elastrain.runtime.preflight import model_problems
from elastrain.runtime.registered import (
    OPTIMIZER_GROUPS_META,
    REGISTERED_META,
    check_registrable,
    load_objects_meta,
    load_optimizer_groups,
    objects_meta,
    optimizer_groups_meta,
    repoint,
    schedulers_in,
)
from elastrain.runtime.shard_memory import drop_fsdp_grads, mean_in_place
from elastrain.runtime.shard_model import compiled_as, meta_flops, uncompiled
from elastrain.runtime.shard_step import NormRows, Reduced, StepFinish
from elastrain.runtime.torch_backend import load_torch_meta, seed_micro_batch, torch_meta
from elastrain.runtime.update import BeforeStep, scheduler_problems, schedulers_of
from elastrain.transfer import NamedState, TorchState, model_signature, state_digest
from elastrain.transfer.flatten import MODEL_PREFIX, Stateful
from elastrain.transfer.torch_state import entry_bytes, fresh_state_entries

log = logging.getLogger("elastrain.sharded")

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class ResumedShard:
    """One slot's state read from a sharded checkpoint (`ShardedBackend.resume_from`):
    its rows and optimizer state per parameter name, the param groups
    (hyperparameters, "params" as names) and the model's buffers."""

    rows: dict[str, torch.Tensor]
    state: dict[str, dict[str, Any]]
    groups: list[dict[str, Any]]
    buffers: dict[str, torch.Tensor]


RowStateLike = tuple[list[list[torch.Tensor]], list[int]]
"""A member's row-shaped tensors per parameter and the global row each starts at."""
ShardPolicy = Callable[[nn.Module], list[nn.Module]]


def shard_rows(rows: int, shard_size: int, shard: int) -> tuple[int, int]:
    """Rows [lo, hi) of a dim-0 size `rows` that shard `shard` of `shard_size`
    holds: ``torch.chunk``'s split (chunks of ceil(rows / S) rows; the last
    ones may be short or empty), which is FSDP2's ``Shard(0)`` layout."""
    chunk = -(-rows // shard_size) if rows else 0
    lo = min(rows, shard * chunk)
    return lo, min(rows, lo + chunk)


def default_shard_policy(model: nn.Module) -> list[nn.Module]:
    """The submodules wrapped as their own FSDP2 units (the root is always one):
    every element of an `nn.ModuleList` (a transformer's blocks), so that one
    block's parameters are gathered at a time."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def grad_dtype(named: list[tuple[str, nn.Parameter]], *, native: bool) -> torch.dtype:
    """The dtype of a sharded member's gradient buffer: float64, or with native
    reductions the trainable parameters' one dtype (one buffer, one all-reduce).
    ValueError if they have several: say what to do instead."""
    if not native:
        return torch.float64
    dtypes: dict[torch.dtype, str] = {}
    for n, q in named:
        if q.requires_grad:
            dtypes.setdefault(q.dtype, n)
    if len(dtypes) > 1:
        seen = ", ".join(f"{str(d).removeprefix('torch.')} ({n}, ...)" for d, n in dtypes.items())
        raise ValueError(
            f"reduce_dtype 'native' with a sharded model needs every trainable parameter in "
            f"one dtype (its gradient is summed in that dtype), got {seen}: cast the model to "
            "one dtype, or use reduce_dtype 'float64' (any mix)"
        )
    return next(iter(dtypes), torch.float32)


def _local_name(name: str) -> str:
    # nn.Module attribute names may not contain ".".
    return name.replace(".", "/")


def state_entries(name: str, p: torch.Tensor, state: Mapping[Any, Any]) -> list[list[Any]]:
    """A checkpoint schema's entries for parameter ``p``'s optimizer state
    (``state``: the optimizer's ``state``), in the optimizer's key order:
    ``[key, "rows", dtype]`` for a tensor shaped like ``p`` (split with it),
    ``[key, "tensor", dtype, shape]`` for a one-element tensor (Adam's ``step``),
    ``[key, "value", v]`` for a JSON value. ValueError for anything else (the
    checkpoint then fails; training goes on). ``p`` is the tensor the state
    belongs to: a sharded member's local rows, a replicated member's whole
    parameter. Shared by the sharded and the replicated DCP checkpoints."""
    entries: list[list[Any]] = []
    for k, v in state.get(p, {}).items():
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape:
            entries.append([k, "rows", str(v.dtype)])
        elif isinstance(v, torch.Tensor) and v.numel() == 1:
            entries.append([k, "tensor", str(v.dtype), list(v.shape)])
        elif isinstance(v, int | float | bool | str) or v is None:
            entries.append([k, "value", v])
        else:
            raise ValueError(
                f"cannot checkpoint optimizer state {k!r} of {name} ({type(v).__name__}, "
                f"shape {getattr(v, 'shape', None)}): only tensors shaped like the "
                "parameter, one-element tensors and JSON values"
            )
    return entries


def group_entries(
    optimizer: torch.optim.Optimizer, names: Mapping[Any, str], purpose: str = "checkpoint"
) -> list[dict[str, Any]]:
    """A checkpoint schema's (or a reshard's) ``groups``: each param group's
    hyperparameters, its "params" as parameter names (``names``: parameter tensor
    -> name). ValueError naming ``purpose`` for hyperparameters JSON cannot carry
    (a tensor ``lr``)."""
    groups = []
    for g in optimizer.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        try:
            json.dumps(hyper)
        except TypeError as e:
            raise ValueError(f"cannot {purpose} a param group's hyperparameters: {e}") from e
        groups.append({**hyper, "params": [names[q] for q in g["params"]]})
    return groups


class ShardedBackend:
    """`Backend` for one shard of a model, sharded with FSDP2 inside a replica group.

    Contract: every member builds it with the same model architecture, optimizer
    type and hyperparameters, loss and config. In a fresh job every member
    builds the model alike: all materialised from the same seed, or all on the
    meta device (each then initialises only its rows, `place`, with the same
    ``init_fn``); a member resuming or healed from its twins may be on the meta
    device whatever the others did. The engine calls `place` once the
    member's slot is known, then `form_group` at every generation start
    (with the replica group's members in shard order, or None for a shadow),
    then the step methods of `Backend`. The `model` attribute is the current
    FSDP2 wrapper (None for a shadow); `optimizer` steps the shard tensors.
    """

    framework = "torch"
    device = torch.device("cpu")
    """The shards live and compute on the CPU (FSDP2 over gloo): no device to check,
    and the gradient's transport is gloo."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        shard_policy: ShardPolicy = default_shard_policy,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        load_extra_state: Callable[[dict[str, Any]], None] | None = None,
        init_fn: InitFn | None = None,
        grad_scaler: torch.amp.GradScaler | None = None,
        before_step: BeforeStep | None = None,
        step_index: Callable[[], int] | None = None,
    ) -> None:
        if config.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {config.shard_size}")
        model, self._compile_ctx = uncompiled(model)
        on_meta = [p.device.type == "meta" for p in (*model.parameters(), *model.buffers())]
        if any(on_meta) and not all(on_meta):
            raise ValueError(
                "the model is partly on the meta device: build it either materialised (every "
                "member from the same seed) or wholly on the meta device (its state then comes "
                "from a checkpoint or from peers)"
            )
        if optimizer.state:
            raise ValueError(
                "the optimizer already holds state: the sharded trainer builds its own optimizer "
                "of the same class and hyperparameters over this member's shard"
            )
        self.shard_size = config.shard_size
        self.loss_fn = loss_fn
        self.seed = config.seed
        self.global_batch_size = config.global_batch_size
        self.extra_state = extra_state
        self.load_extra_state = load_extra_state
        self.objects: dict[str, Stateful] = {}
        """Registered objects (`register`), in registration order: carried in the meta."""
        self._given_optimizer = optimizer
        """The script's optimizer: its schedulers are checked (`problems`), its param
        groups as they are at the first `place` (a scheduler built since has set
        their ``lr`` and ``initial_lr``) are the shard optimizer's."""
        self._moved: list[Any] | None = None
        """The schedulers found over the script's optimizer at the first `_install`,
        moved onto every shard optimizer since (`elastrain.runtime.registered`)."""
        self.finish = StepFinish(config.max_grad_norm, grad_scaler, before_step, step_index)
        """Clipping, the scaler and the script's hook around the optimizer step
        (`elastrain.runtime.shard_step`)."""
        if self.finish.scaler is not None:
            # Registered like any carried object, under the replicated trainer's name:
            # heal, reshard, checkpoints and the state hash carry its scale.
            self.objects["grad_scaler"] = self.finish.scaler
        self._problems = model_problems(model)
        self._signature = model_signature(model)
        self._full: nn.Module | None = model
        self.on_meta = bool(on_meta) and all(on_meta)
        """The model was built on the meta device (`with torch.device("meta")`): no
        member ever holds the full model; its rows come from a sharded checkpoint
        (`resume_from`), for a member behind its twins from their heal (`reset`,
        then heal), and in a fresh job from initialising them module by module
        (`place`, `elastrain.runtime.meta_init`)."""
        if init_fn is not None and not self.on_meta:
            raise ValueError(
                "init_fn initialises a model built on the meta device, and this one is "
                "materialised: initialise it before building the trainer, or build it with "
                '`with torch.device("meta"):`'
            )
        self._init_fn = init_fn
        self._init_missing = uninitialisable(model, init_fn) if self.on_meta else []
        """Modules a fresh start could not initialise (`place` refuses it, naming them)."""
        self._policy = shard_policy
        named = list(model.named_parameters())
        self._names = [n for n, _ in named]
        self._shapes = {n: tuple(p.shape) if p.dim() else (1,) for n, p in named}
        self._requires_grad = {n: p.requires_grad for n, p in named}
        # FSDP2 runs here over gloo on CPU tensors (docs/design/devices.md).
        self.native = resolve_reduce_dtype(config.reduce_dtype, "cpu") == "native"
        """FSDP2's own accumulation, one reduction per step in the parameters' dtype
        (`TrainerConfig.reduce_dtype` "native"); else float64 per micro-batch."""
        self._grad_dtype = grad_dtype(named, native=self.native)
        by_id = {id(p): n for n, p in named}
        self._opt_class = type(optimizer)
        self._opt_defaults = dict(optimizer.defaults)
        self._opt_groups: list[dict[str, Any]] = []
        """The optimizer's param groups: hyperparameters, and "params" as parameter names."""
        for g in optimizer.param_groups:
            if any(id(q) not in by_id for q in g["params"]):
                raise ValueError("the optimizer holds parameters that are not the model's")
            self._opt_groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [by_id[id(q)] for q in g["params"]],
                }  # fmt: skip
            )
        self._template = copy.deepcopy(model).to("meta")
        self.shard: int | None = None
        self.model: nn.Module | None = None
        """The FSDP2 wrapper of the current replica group (None: a shadow, or not placed)."""
        self._call: nn.Module | None = None
        """What the loss function is given: `model`, or compiled as the script compiled
        the model it passed (`shard_model.uncompiled`)."""
        self.group: tuple[str, ...] | None = None
        """The members of the replica group `model` is built on, in shard order."""
        self.group_clean = True
        """False from a forward or backward through `model` (a step's round, an
        evaluation) until it returns: one that raised may have stopped a collective of
        the group midway, so the group cannot be kept (`shard_regroup`)."""
        self.local = nn.Module()
        """This member's shard: one parameter per model parameter (its rows), and the
        model's buffers (replicated, not sharded)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self._buffers: dict[str, torch.Tensor] = {
            # On the meta device: zeros of the right shape, until a checkpoint or a
            # heal (both carry every buffer) fills them.
            n: torch.zeros(b.shape, dtype=b.dtype) if self.on_meta else b.detach().clone()
            for n, b in model.named_buffers()
        }
        persistent = set(model.state_dict())
        self._nonpersistent = [n for n in self._buffers if n not in persistent]
        """Buffers the model's own state_dict leaves out (the checkpoint keeps them
        all; the schema names these so that an export can leave them out too)."""
        self._offsets: dict[str, tuple[int, int]] = {}
        self._grad = torch.zeros(0, dtype=self._grad_dtype)
        """The shard's gradient sum of the step (float64, or native: the parameters'
        dtype), laid out as `_offsets` say; what the twins all-reduce."""
        self._rounds_left: int | None = None
        """Native: the rounds of this step not computed yet (`plan_rounds`)."""
        self._extras = torch.zeros(0, dtype=torch.float64)
        self._pending: Reduced | None = None
        """The step's mean gradient and norm vector (`norm_vector`), until applied."""
        self._scratch: torch.Tensor | None = None
        """Float64 work space of the rows' sums of squares, reused every step."""
        self._resume_source: Callable[[int, int], ResumedShard] | None = None

    # ---- placement and replica groups ---------------------------------------------

    @property
    def placed(self) -> bool:
        """True once this member holds a shard (its full model is gone)."""
        return self.shard is not None

    @property
    def needs_fill(self) -> bool:
        """True while this member holds no shard, its model is on the meta device and
        no checkpoint is queued to fill it: a member behind its twins takes zeroed
        rows (`reset`) for their heal; any other is a fresh start, which `place`
        initialises."""
        return not self.placed and self.on_meta and self._resume_source is None

    def rows(self) -> list[int]:
        """Dim-0 size of each parameter (0-dim ones count as 1 row), in model order."""
        return [self._shapes[n][0] for n in self._names]

    def row_bytes(self) -> list[int]:
        """Bytes of one row of each parameter and of its row-shaped optimizer state."""
        out = []
        for n in self._names:
            per_row = 1
            for d in self._shapes[n][1:]:
                per_row *= d
            lp = self.local._parameters.get(_local_name(n)) if self.placed else None
            state = self.optimizer.state.get(lp, {}) if self.optimizer and lp is not None else {}
            size = 4 if lp is None else lp.element_size()
            size += sum(
                t.element_size() for t in state.values()
                if isinstance(t, torch.Tensor) and lp is not None and t.shape == lp.shape
            )  # fmt: skip
            out.append(per_row * size)
        return out

    def place(self, shard: int, size: int | None = None) -> None:
        """Keep only the rows of `shard` of `size` (first call), or check the slot did
        not move (a move with the same size is a bug; a new size is `reshard`'s).

        The first call turns the full model into this member's shard parameters
        and an optimizer over them (the user's class, hyperparameters and param
        groups); the full parameters are freed. A model on the meta device (a
        fresh start: no checkpoint queued, no heal) is initialised module by
        module instead (`meta_init.init_by_module`): only this slot's rows are
        kept, and no more than one module's own tensors exist whole at a time.
        MetaModelUnfilled if a module owning tensors has nothing to initialise it.
        """
        size = self.shard_size if size is None else size
        if not 0 <= shard < size:
            raise ValueError(f"shard {shard} out of range for shard size {size}")
        if self.placed:
            if (size, shard) != (self.shard_size, self.shard):
                raise RuntimeError(
                    f"the coordinator moved this member from shard {self.shard} of "
                    f"{self.shard_size} to {shard} of {size} without a reshard"
                )
            return
        if self._resume_source is not None:
            # Resuming from a sharded checkpoint: this slot's rows come from it.
            got = self._resume_source(size, shard)
            self._resume_source = None
            with torch.no_grad():
                for n, b in got.buffers.items():
                    self._buffers[n].copy_(b)
            self._install(size, shard, got.rows, got.state, got.groups)
            return
        full = self._full
        assert full is not None
        if self.on_meta:
            self._init_rows(full, size, shard)
            return
        params = dict(full.named_parameters())
        with torch.no_grad():
            rows = {}
            for n in self._names:
                lo, hi = shard_rows(self._shapes[n][0], size, shard)
                rows[n] = params[n].detach().reshape(self._shapes[n])[lo:hi].clone()
        names = {id(q): n for n, q in full.named_parameters()}
        # The script's param groups as they are now, not when the trainer was built: a
        # scheduler built since set their lr (its first value) and initial_lr.
        groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [names[id(q)] for q in g["params"]]}
            for g in self._given_optimizer.param_groups
        ]  # fmt: skip
        self._install(size, shard, rows, {}, groups)

    def _init_rows(self, full: nn.Module, size: int, shard: int) -> None:
        """A fresh start on the meta device: this slot's rows and every buffer from the
        module-by-module initialisation (the same bits whatever `size` and `shard`)."""
        if self._init_missing:
            raise MetaModelUnfilled(missing_message(self._init_missing))

        def mine(name: str, whole: torch.Tensor) -> torch.Tensor:
            lo, hi = shard_rows(self._shapes[name][0], size, shard)
            return whole.reshape(self._shapes[name])[lo:hi].clone()

        # A meta copy (no storage): the walk materialises each module in turn.
        rows, buffers = init_by_module(copy.deepcopy(full), self.seed, self._init_fn, mine)
        with torch.no_grad():
            for n, b in buffers.items():
                self._buffers[n].copy_(b)
        self._install(size, shard, rows, {}, self._opt_groups)

    def landing_estimate(self) -> list[tuple[str, int]]:
        """What a heal of this member's shard is expected to bring, before it holds
        one (`NamedState.landing_estimate`): shard 0 of the configured shard size
        (it holds the most rows), each parameter's rows with its optimizer state's
        first step (`fresh_state_entries`, as `TorchState.landing_estimate`), and
        every buffer."""
        group_of = {n: g for g in self._opt_groups for n in g["params"]}
        out: list[tuple[str, int]] = []
        for i, n in enumerate(self._names):
            lo, hi = shard_rows(self._shapes[n][0], self.shard_size, 0)
            dtype = getattr(torch, self._signature_dtype(n).removeprefix("torch."))
            rows = (hi - lo, *self._shapes[n][1:])
            out.append((MODEL_PREFIX + _local_name(n), math.prod(rows) * dtype.itemsize))
            if n in group_of:
                fresh = fresh_state_entries(i, dtype, rows, self._opt_class, group_of[n])
                out += entry_bytes(fresh)
        out += [(MODEL_PREFIX + _local_name(n), b.nbytes) for n, b in self._buffers.items()]
        return out

    def reset(self, shard: int, size: int) -> None:
        """Hold zeroed rows of `shard` of `size` and no optimizer state: a member
        whose rows are stale and shaped for an older layout, about to be healed."""
        rows = {}
        for n in self._names:
            lo, hi = shard_rows(self._shapes[n][0], size, shard)
            dtype = getattr(torch, self._signature_dtype(n).removeprefix("torch."))
            rows[n] = torch.zeros((hi - lo, *self._shapes[n][1:]), dtype=dtype)
        groups = self._opt_groups
        if self.optimizer is not None:
            by_param = {q: n for n, q in self._local_params().items()}
            groups = [
                {**{k: v for k, v in g.items() if k != "params"},
                 "params": [by_param[q] for q in g["params"]]}
                for g in self.optimizer.param_groups
            ]  # fmt: skip
        self._install(size, shard, rows, {}, groups)

    def _install(
        self,
        size: int,
        shard: int,
        rows: dict[str, torch.Tensor],
        state: dict[str, dict[str, torch.Tensor]],
        groups: list[dict[str, Any]],
    ) -> None:
        """Make `rows` (name -> this member's rows, owned from now on) the shard
        parameters, with an optimizer of the user's class over them holding `state`
        (name -> its optimizer state) and `groups` (hyperparameters, params by name)."""
        self.leave_group()
        local = nn.Module()
        off = 0
        offsets = {}
        for n in self._names:
            t = rows[n]
            local.register_parameter(
                _local_name(n), nn.Parameter(t, requires_grad=self._requires_grad[n])
            )
            offsets[n] = (off, off + t.numel())
            off += t.numel()
        for n, b in self._buffers.items():
            # Buffers travel with the shard state (heal, hash) but are not sharded.
            local.register_buffer(_local_name(n), b)
        opt_groups = [
            {**{k: v for k, v in g.items() if k != "params"},
             "params": [local.get_parameter(_local_name(n)) for n in g["params"]]}
            for g in groups
        ]  # fmt: skip
        try:
            opt = self._opt_class(opt_groups, **self._opt_defaults)
        except TypeError:
            opt = self._opt_class(opt_groups)  # type: ignore[call-arg]
        if state:
            index = {n: i for i, n in enumerate(n for g in groups for n in g["params"])}
            opt.load_state_dict(
                {
                    "state": {index[n]: st for n, st in state.items() if st},
                    "param_groups": [
                        {
                            **{k: v for k, v in g.items() if k != "params"},
                            "params": [index[n] for n in g["params"]],
                        }
                        for g in groups
                    ],  # fmt: skip
                }
            )
        self.local, self.optimizer = local, opt
        # The script's schedulers step the optimizer that steps (a new one each time).
        if self._moved is None:
            # Those over the script's optimizer now (registered or carried by its
            # extra_state), found once: afterwards they hold the shard's optimizer.
            self._moved = schedulers_of(self._given_optimizer)
        repoint([*schedulers_in(self.objects), *self._moved], opt)
        self.shard_size, self.shard = size, shard
        self._offsets = offsets
        self._grad = torch.zeros(off, dtype=self._grad_dtype)
        if self._full is not None and not self.on_meta:
            # The script (and its optimizer) may still hold the full model: free its
            # tensors, or every member would keep the whole model beside its shard.
            # (On the meta device it holds no memory: nothing to free.)
            with torch.no_grad():
                for t in (*self._full.parameters(), *self._full.buffers()):
                    t.data = torch.empty(0, dtype=t.dtype)
        self._full = None

    # ---- sharded checkpoints (elastrain.checkpoint.sharded_parts) ---------------------------

    def checkpoint_schema(self) -> dict[str, Any]:
        """What a sharded checkpoint says of this state besides the tensors (JSON):

        - ``class``: the optimizer's class (module.qualname);
        - ``groups``: the param groups' hyperparameters, "params" as parameter names;
        - ``params``: per parameter ``[name, shape, dtype, state]``, its whole shape
          and its optimizer state in the optimizer's key order, each entry
          ``[key, "rows", dtype]`` (shaped like the parameter: sharded with it),
          ``[key, "tensor", dtype, shape]`` (one element, the same on every
          member: Adam's ``step``) or ``[key, "value", v]`` (a JSON value);
        - ``buffers``: ``[name, shape, dtype]`` (not sharded);
        - ``nonpersistent_buffers``: the names of the buffers that are not in the
          model's ``state_dict`` (``persistent=False``; `elastrain export` leaves
          them out).

        ValueError for optimizer state of another kind, or hyperparameters JSON
        cannot carry (the checkpoint then fails; training goes on)."""
        assert self.optimizer is not None, "checkpoint_schema() before place()"
        shapes = {e[0]: [int(x) for x in e[1]] for e in self._signature}
        params = [
            [n, shapes[n], self._signature_dtype(n), state_entries(n, p, self.optimizer.state)]
            for n, p in self._local_params().items()
        ]
        groups = group_entries(self.optimizer, {q: n for n, q in self._local_params().items()})
        buffers = [[n, list(b.shape), str(b.dtype)] for n, b in self._buffers.items()]
        cls = self._opt_class
        return {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "groups": groups,
            "params": params,
            "buffers": buffers,
            "nonpersistent_buffers": list(self._nonpersistent),
        }

    def model_schema(self) -> dict[str, Any]:
        """The part of `checkpoint_schema` a checkpoint must match to be resumed
        here (known before `place`): ``params`` ``[name, shape, dtype]``, the
        optimizer ``class`` and its ``groups`` (parameter names); and, for a
        checkpoint that has none of its own (a plain torch job's), the model's
        ``signature`` (`model_signature`: every state_dict entry), the groups'
        ``hyper``parameters and the ``nonpersistent_buffers``."""
        shapes = {e[0]: [int(x) for x in e[1]] for e in self._signature}
        cls = self._opt_class
        return {
            "params": [[n, shapes[n], self._signature_dtype(n)] for n in self._names],
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "groups": [list(g["params"]) for g in self._opt_groups],
            "signature": [list(e) for e in self._signature],
            "hyper": [{k: v for k, v in g.items() if k != "params"} for g in self._opt_groups],
            "nonpersistent_buffers": list(self._nonpersistent),
        }

    def checkpoint_chunks(self, schema: dict[str, Any], *, whole: bool) -> list[Chunk]:
        """This member's rows of every parameter and of its row-shaped optimizer state
        (aliases of the live tensors, ``defer``: only `apply` writes them), as
        checkpoint chunks; with `whole`, also the tensors that are not sharded
        (buffers, one-element optimizer state), copied at once."""
        assert self.optimizer is not None and self.shard is not None
        out: list[Chunk] = []
        local = self._local_params()
        for n, _, _, entries in schema["params"]:
            p = local[n]
            lo, hi = shard_rows(self._shapes[n][0], self.shard_size, self.shard)
            st = self.optimizer.state.get(p, {})
            if hi > lo:
                # Only the optimizer step writes these (in place): copied in the background.
                out.append(Chunk(model_key(n), lo, hi, p.detach(), defer=True))
                out.extend(
                    Chunk(optim_key(n, e[0]), lo, hi, st[e[0]], defer=True)
                    for e in entries
                    if e[1] == "rows"
                )
            if whole:
                out.extend(
                    Chunk(optim_key(n, e[0]), 0, 1, st[e[0]]) for e in entries if e[1] == "tensor"
                )
        if whole:
            for n, b in self._buffers.items():
                out.append(Chunk(model_key(n), 0, row_count(tuple(b.shape)), b))
        return [c for c in out if c.hi > c.lo]

    def resume_from(self, source: Callable[[int, int], ResumedShard]) -> None:
        """Take this member's first shard from a checkpoint: the first `place`
        calls ``source(size, shard)`` for that slot's rows, optimizer state and
        hyperparameters instead of cutting them from the full model."""
        if self.placed:
            raise RuntimeError("resume_from() after place(): the shard is taken already")
        self._resume_source = source

    # ---- resharding ------------------------------------------------------------------

    def reshard_schema(self) -> dict[str, Any]:
        """What a reshard's leader tells every member besides the rows (JSON): the
        param groups' hyperparameters, and per parameter the names and dtypes of its
        row-shaped optimizer state and the values of the rest (Adam's `step`)."""
        assert self.optimizer is not None
        state: dict[str, Any] = {}
        by_param: dict[Any, str] = {p: n for n, p in self._local_params().items()}
        for p, st in self.optimizer.state.items():
            n = by_param[p]
            rows: dict[str, str] = {}
            scalars: dict[str, list[Any]] = {}
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.shape == p.shape and v.dim() > 0:
                    rows[k] = str(v.dtype)
                elif isinstance(v, torch.Tensor) and v.numel() == 1:
                    scalars[k] = [str(v.dtype), list(v.shape), v.item()]
                elif isinstance(v, int | float | bool) or v is None:
                    scalars[k] = ["py", [], v]
                else:
                    raise ValueError(
                        f"cannot reshard optimizer state {k!r} of {n} ({type(v).__name__}, "
                        f"shape {getattr(v, 'shape', None)}): only row-shaped tensors and scalars"
                    )
            state[n] = {"rows": sorted(rows.items()), "scalars": scalars}
        return {"groups": group_entries(self.optimizer, by_param, "reshard"), "state": state}

    def _local_params(self) -> dict[str, nn.Parameter]:
        return {n: self.local.get_parameter(_local_name(n)) for n in self._names}

    def row_state(self, schema: dict[str, Any]) -> RowStateLike:
        """This member's rows (param, then its row-shaped optimizer state in the
        schema's order), each starting at its global row; for sending."""
        assert self.optimizer is not None and self.shard is not None
        tensors, start = [], []
        for n, p in self._local_params().items():
            keys = [k for k, _ in schema["state"].get(n, {}).get("rows", [])]
            st = self.optimizer.state.get(p, {})
            tensors.append([p.detach(), *(st[k] for k in keys)])
            start.append(shard_rows(self._shapes[n][0], self.shard_size, self.shard)[0])
        return tensors, start

    def reshard(
        self,
        size: int,
        shard: int,
        schema: dict[str, Any],
        exchange: Callable[[RowStateLike | None, RowStateLike], None],
        *,
        holds: bool,
    ) -> None:
        """Become shard `shard` of `size`: allocate its rows, let `exchange` fill them
        (from this member's old rows, `holds`, and its peers'), then install them
        with the schema's optimizer state and hyperparameters. Collective: every
        member of the generation calls it with the same plan."""
        old = self.row_state(schema) if holds else None
        tensors, start = [], []
        for n in self._names:
            lo, hi = shard_rows(self._shapes[n][0], size, shard)
            shape = (hi - lo, *self._shapes[n][1:])
            dtype = getattr(torch, self._signature_dtype(n).removeprefix("torch."))
            rows = [torch.empty(shape, dtype=dtype)]
            for _, d in schema["state"].get(n, {}).get("rows", []):
                rows.append(torch.empty(shape, dtype=getattr(torch, d.removeprefix("torch."))))
            tensors.append(rows)
            start.append(lo)
        exchange(old, (tensors, start))
        state: dict[str, dict[str, torch.Tensor]] = {}
        for n, rows in zip(self._names, tensors, strict=True):
            entry = schema["state"].get(n)
            if entry is None:
                continue
            st: dict[str, Any] = {k: t for (k, _), t in zip(entry["rows"], rows[1:], strict=True)}
            for k, (dtype, shape, value) in entry["scalars"].items():
                st[k] = (
                    value
                    if dtype == "py"
                    else torch.tensor(
                        value, dtype=getattr(torch, dtype.removeprefix("torch."))
                    ).reshape(shape)
                )
            state[n] = st
        self._install(size, shard, dict(zip(self._names, (r[0] for r in tensors), strict=True)),
                      state, schema["groups"])  # fmt: skip

    def _signature_dtype(self, name: str) -> str:
        for entry in self._signature:
            if entry[0] == name:
                return str(entry[2])
        raise KeyError(name)

    def form_group(
        self, members: tuple[str, ...] | None, open_group: Callable[[], None], keep: bool = False
    ) -> bool:
        """Be ready to compute in the replica group `members` (shard order), or be a
        shadow (None). `keep`: the group's members agreed to keep the wrapper they
        hold (`elastrain.runtime.shard_regroup`); otherwise it is built again and
        `open_group` makes the group's process group the default one (all of
        `members` call this together). Returns True if it rebuilt."""
        if keep:
            if members is None or members != self.group or self.model is None:
                raise RuntimeError(f"told to keep the wrapper of {members}, holds {self.group}")
            return False
        self.leave_group()
        if members is None:
            return False
        assert self.shard is not None and self._template is not None
        if len(members) != self.shard_size:
            raise ValueError(f"a replica group has {self.shard_size} members, got {len(members)}")
        open_group()
        self.model = self._wrap(dist.distributed_c10d._get_default_group())
        self._call = self.model
        if self._compile_ctx is not None:
            # It compiles at the group's first step, on every member of the group at once.
            self._call = compiled_as(self.model, self._compile_ctx)
        self.group = members
        return True

    def set_collective_timeout(self, seconds: float) -> None:
        """Bound every collective of the replica group (FSDP2's all-gathers and
        reduce-scatters, which the training thread waits on inside forward and
        backward): a group-mate that hangs then fails this member's compute after
        `seconds` (the step watchdog's deadline) instead of the group's creation
        timeout, and the generation is abandoned as for a death."""
        if self.model is None or not dist.is_initialized():
            return
        pg = dist.distributed_c10d._get_default_group()
        pg._get_backend(torch.device("cpu")).set_timeout(datetime.timedelta(seconds=seconds))

    def leave_group(self) -> None:
        """Drop the wrapper and the replica group's process group (a shadow, a
        membership change, or the end). The shard parameters keep their values."""
        if self.model is not None:
            with torch.no_grad():
                for name in self._names:
                    lp = self.local.get_parameter(_local_name(name))
                    # Own storage again: the wrapper's goes away with it.
                    lp.data = lp.data.clone()
        self.model = None
        self._call = None
        self.group = None
        self.group_clean = True
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _wrap(self, pg: Any) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        assert self._template is not None
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("shard",))
        model = copy.deepcopy(self._template)
        # Native: reduce in the gradients' own dtype (None), the way FSDP2 does by default.
        policy = MixedPrecisionPolicy(reduce_dtype=None if self.native else torch.float64)
        units = [*self._policy(model), model]
        for u in units:
            fully_shard(u, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cpu")
        names = {id(p): n for n, p in model.named_parameters()}
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(self._buffers[n])
            for n, p in model.named_parameters():
                lp = self.local.get_parameter(_local_name(n))
                mine = p.to_local()  # type: ignore[attr-defined]
                if mine.shape != lp.shape:
                    raise RuntimeError(
                        f"FSDP2 sharded {n} as {list(mine.shape)}, expected {list(lp.shape)}"
                    )
                mine.copy_(lp)
        model._get_fsdp_state()._lazy_init()  # type: ignore[operator]
        self._bind(model)
        drop_fsdp_grads(model.parameters())
        for u in units:
            state = u._get_fsdp_state()  # type: ignore[operator]
            group = state._fsdp_param_group
            if group is None:
                continue
            u.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            # A plain SUM: for float32 FSDP2 would turn the factor into PREMUL_SUM,
            # which gloo lacks (float64 gets a SUM either way).
            u.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
            # A trainable parameter without a gradient in a backward (unused in that
            # forward) is reduce-scattered as zeros: every member's reduce-scatter has
            # the same layout, and the hook's spans below hold every time.
            u.set_reduce_scatter_unused_params(True, recurse=False)  # type: ignore[operator]
            trainable = [fp for fp in group.fsdp_params if fp.sharded_param.requires_grad]
            u.set_all_reduce_hook(  # type: ignore[operator]
                self._accumulator([names[id(fp.sharded_param)] for fp in trainable], trainable)
            )
        return model

    def _bind(self, model: nn.Module) -> None:
        """Make each shard parameter's storage the wrapper's: the optimizer's updates
        are then what the next all-gather sends. FSDP2 may re-allocate a shard's
        padded storage (at its lazy initialisation), so this is checked every step."""
        with torch.no_grad():
            for n, p in model.named_parameters():
                lp = self.local.get_parameter(_local_name(n))
                mine = p.to_local()  # type: ignore[attr-defined]
                if lp.data_ptr() != mine.data_ptr():
                    mine.copy_(lp)
                    lp.data = mine

    def _accumulator(self, names: list[str], params: list[Any]) -> Callable[[torch.Tensor], None]:
        """The reduce-scatter hook of one FSDP2 unit: add its output (the padded
        shards of the unit's trainable parameters, `params`, concatenated, in the
        buffer's dtype; frozen ones have no gradient and are not in it) into the
        shard buffer."""
        spans = []
        off = 0
        for n, fp in zip(names, params, strict=True):
            numel = fp.sharded_size.numel()
            spans.append((off, numel, self._offsets[n]))
            off += fp.padded_sharded_param_size.numel()

        def add(out: torch.Tensor) -> None:
            for at, numel, (lo, hi) in spans:
                self._grad[lo:hi].add_(out[at : at + numel])

        return add

    # ---- state -------------------------------------------------------------------

    def signature(self) -> list[list[Any]]:
        return self._signature

    def state(self) -> TorchState:
        assert self.optimizer is not None, "state() before place()"
        # The shard only: registered objects (the GradScaler too) are replicated and
        # travel in the meta (`meta`), which every heal, reshard and checkpoint carries.
        return TorchState(self.local, self.optimizer)

    def adopt(self, state: NamedState) -> None:
        """A heal wrote the shard parameters in place (the wrapper's storage); the
        wrapper's buffers are copies, refreshed here."""
        if self.model is not None:
            with torch.no_grad():
                for n, b in self.model.named_buffers():
                    b.copy_(self._buffers[n])

    def register(self, name: str, obj: Stateful) -> None:
        """Carry ``obj``'s ``state_dict()`` with the shard (`elastrain.runtime.registered`):
        in the meta (heal, reshard, checkpoints) and in the state hash; an LR
        scheduler is moved onto the optimizer that steps. Every member registers the
        same objects under the same names, before the first step. Errors as
        `TorchBackend.register`."""
        check_registrable(name, obj, self.objects)
        self.objects[name] = obj
        if self.optimizer is not None:
            repoint(schedulers_in(self.objects), self.optimizer)

    def state_hash(self) -> str:
        """The shard's state and the registered objects (the same on every member)."""
        assert self.optimizer is not None, "state_hash() before place()"
        return state_digest(TorchState(self.local, self.optimizer, self.objects))

    def meta(self) -> dict[str, Any]:
        out = torch_meta(self.extra_state)
        if self.objects:
            out[REGISTERED_META] = objects_meta(self.objects)
        if self.optimizer is not None:
            out[OPTIMIZER_GROUPS_META] = optimizer_groups_meta(self.optimizer)
        return out

    def load_meta(self, meta: dict[str, Any]) -> None:
        load_torch_meta(meta, self.load_extra_state)
        raw = meta.get(REGISTERED_META)
        if raw is not None or self.objects:
            load_objects_meta(self.objects, raw or {"state": {}, "tensors": {}})
        groups = meta.get(OPTIMIZER_GROUPS_META)
        if groups is not None and self.optimizer is not None:
            load_optimizer_groups(self.optimizer, groups)

    def problems(self) -> list[str]:
        carries = self.extra_state is not None and self.load_extra_state is not None
        return self._problems + scheduler_problems(
            self._given_optimizer, self.objects, script_carries=carries
        )

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Nothing to compile in eager mode."""

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> dict[str, Any] | None:
        """The job's FLOPs per step, counted on a meta-device copy (`meta_flops`)."""
        return meta_flops(self._template, self.loss_fn, batch, micro_batch, global_batch)

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, extra_slots: int) -> None:
        self._grad.zero_()
        self._pending = None
        self._rounds_left = None
        if self._extras.numel() != extra_slots:
            self._extras = torch.zeros(extra_slots, dtype=torch.float64)
        self.finish.ready_scale()
        if self.model is not None:
            _reshard(self.model)
            self._bind(self.model)
            self.model.train()
            for p in self.model.parameters():
                p.grad = None

    def plan_rounds(self, rounds: int) -> None:
        """This step's number of rounds in the replica group, padding included: the
        same on every member of the group. Native reductions reduce-scatter in the
        last one only, so every member must know which one that is before the first
        (float64: nothing to plan, every round reduces)."""
        if rounds < 0:
            raise ValueError(f"rounds must be >= 0, got {rounds}")
        self._rounds_left = rounds
        # Clean again once every round ran: a member leaving the rounds early (its
        # group-mates in the next round's collectives) leaves the group unusable.
        self.group_clean = rounds == 0

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        """One round of the replica group: every member of it calls this together
        (FSDP2's collectives), `samples` 0 for a padding round (its gradient is zero).
        Native: `plan_rounds` first; the gradient stays unsharded (accumulated by
        autograd) until the last planned round, which reduce-scatters it. With a
        GradScaler the loss sum is scaled before backward, as the replicated
        member scales it."""
        if self.model is None or self._call is None:
            raise RuntimeError("a shadow does not compute")
        if self.native and not self._rounds_left:
            raise RuntimeError(
                "reduce_dtype 'native': compute() without a planned round left "
                "(plan_rounds() first, with the group's rounds of this step)"
            )
        if self._rounds_left is not None:
            self._rounds_left -= 1
        if self.native:
            # Every group member runs the same rounds, so all toggle alike, and the
            # last round's reduce-scatter meets all of them.
            self.model.set_requires_gradient_sync(self._rounds_left == 0)  # type: ignore[operator]
        # Until the backward returns, the group's collectives may stop midway here.
        self.group_clean = False
        with torch.random.fork_rng(devices=[]):
            seed_micro_batch(self.seed, step, microbatch)
            loss = self.loss_fn(self._call, batch)
            self.finish.scale(loss * samples).backward()
        self.group_clean = not self._rounds_left
        return float(loss.detach()) * samples

    def reduce_buffers(self) -> list[torch.Tensor]:
        """The shard's gradient sum (float64, or native: the parameters' dtype):
        all-reduced over the shard's twins."""
        return [self._grad]

    def extras(self) -> torch.Tensor:
        """The step's extras: all-reduced over the whole generation."""
        return self._extras

    def norm_vector(self, writes: bool) -> torch.Tensor:
        """Once the twins' all-reduce completed: the mean gradient of each trainable
        shard parameter (the sum divided by the global batch, rounded once to the
        parameter's dtype: float64 reductions round the exact mean, the replicated
        member's bits), unscaled by the GradScaler; and the vector the generation
        all-reduces for the norm (`elastrain.runtime.shard_step.NormRows`), holding
        this shard's rows' sums of squares if this member `writes` them (one
        holder per shard) and zeros elsewhere. Returns the vector (to all-reduce
        in place)."""
        b = self.global_batch_size
        mine = {n: self.local.get_parameter(_local_name(n)) for n in self._names}
        mine = {n: lp for n, lp in mine.items() if lp.requires_grad}
        # Twins divide the same all-reduced bytes: the same bits on every twin. Float64:
        # one rounding, from the exact mean, written over the sum (`mean_in_place`).
        if self.native:
            grads = {n: self._grad[slice(*self._offsets[n])].div_(b).view(lp.shape)
                     for n, lp in mine.items()}  # fmt: skip
        else:
            grads = mean_in_place(self._grad, {n: self._offsets[n] for n in mine},
                                  {n: lp.shape for n, lp in mine.items()},
                                  {n: lp.dtype for n, lp in mine.items()}, b)  # fmt: skip
        self.finish.unscale(list(grads.values()))
        rows = NormRows(grads, {n: self._shapes[n][0] for n in grads})
        vector = torch.zeros(rows.size, dtype=torch.float64)
        if writes:
            assert self.shard is not None
            first = {n: shard_rows(self._shapes[n][0], self.shard_size, self.shard)[0]
                     for n in grads}  # fmt: skip
            self._scratch = rows.fill(vector, grads, first, self._scratch)
        self._pending = Reduced(grads, vector)
        return vector

    def apply(self) -> Update:
        """The step's update from its reduced gradient and norm vector
        (`norm_vector`, all-reduced): clipping, the non-finite skip, the hook, the
        optimizer step, the scaler (`StepFinish.finish`). Called without
        `norm_vector` (a caller driving one backend by hand, no generation), the
        vector is this member's rows' alone."""
        if self._pending is None:
            self.norm_vector(writes=True)
        assert self._pending is not None
        reduced, self._pending = self._pending, None
        return self._apply(reduced)

    def _apply(self, reduced: Reduced, step: int | None = None) -> Update:
        assert self.optimizer is not None
        params = []
        for name, g in reduced.grads.items():
            lp = self.local.get_parameter(_local_name(name))
            lp.grad = g
            params.append(lp)
        update = self.finish.finish(params, self.optimizer, reduced.vector, step)
        for p in (*params, *(self.model.parameters() if self.model is not None else ())):
            p.grad = None  # the mean gradient is no longer needed: no second copy next step
        return update

    def take_reduced(self) -> Reduced:
        """Hand over the step's reduced gradient and norm vector (`apply_kept`
        applies them later) and hold a fresh gradient buffer: the twins' and the
        norm's all-reduces completed."""
        if self._pending is None:
            raise RuntimeError("take_reduced() before norm_vector(): nothing reduced to keep")
        kept, self._pending = self._pending, None
        self._grad = torch.zeros_like(self._grad)
        return kept

    def apply_kept(self, kept: Reduced, step: int) -> Update:
        """Apply step `step` from what `take_reduced` kept: the same update `apply`
        made on the members that committed it (the same gradient rows, the same
        reduced norm vector, so the same clipping and decisions; the hook is told
        `step`, as it was there: the committed count has moved on by now)."""
        for name, g in kept.grads.items():
            lp = self.local.get_parameter(_local_name(name))
            if g.shape != lp.shape or g.dtype != lp.dtype:
                raise ValueError(
                    f"kept gradient of {name} {tuple(g.shape)} {g.dtype} does not fit this "
                    f"shard's {tuple(lp.shape)} {lp.dtype}"
                )
        return self._apply(kept, step)

    def discard(self) -> None:
        # An abandoned all-reduce may still write into the buffers: new ones.
        self._grad = torch.zeros_like(self._grad)
        self._extras = torch.zeros_like(self._extras)
        self._pending = None


def _reshard(model: nn.Module) -> None:
    """Leave every FSDP2 unit of `model` holding its shard (a no-op on a sharded one).

    A forward without a backward (the script's evaluation in `trainer.pause()`,
    under ``no_grad``) leaves the root unit unsharded: FSDP2 keeps the root's
    gathered parameters after its forward for the backward that would follow, and
    reshards them only at that backward's end. Until then the module holds the
    gathered plain tensors instead of the shards this backend binds and steps.
    Every member of the replica group reshards alike (no communication: the
    gathered copies are dropped), so a step starts from the state a backward
    leaves, with or without a forward before it."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def open_replica_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    connect_timeout_s: float,
    op_timeout_s: float,
) -> None:
    """Make the replica group's gloo process group torch's default one (FSDP2 and
    DTensor read the global rank from it). All `size` members call it with the
    same `prefix`; blocks until they have (at most `connect_timeout_s`)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore(prefix, store),
        rank=rank,
        world_size=size,
        timeout=datetime.timedelta(seconds=max(connect_timeout_s, op_timeout_s)),
    )

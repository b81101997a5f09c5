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
  wrapper all-gathers the parameters from the group and reduce-scatters each
  micro-batch's gradient back to the shards. With ``reduce_dtype=float64`` and
  a divide factor of 1 the reduce-scatter output is the exact float64 sum of
  the group's float32 micro-batch gradients; a hook adds it into this member's
  float64 shard buffer (FSDP2's own float32 ``.grad`` is ignored).
- A *shadow* (its replica group lost a member) computes nothing: its buffer
  stays zero. It keeps its process and its shard and applies every update, so
  that a replacement needs only the dead member's shard, from its twins.
- The engine all-reduces the shard buffer over the shard's twins (every member
  with the same shard index, complete or shadow) and the step's extras over
  the whole generation. `apply` divides the exact sum by the global batch,
  rounds it once to the parameters' dtype and steps the optimizer over the
  shard tensors: the same bits as the replicated trainer's update of the same
  rows, whichever members computed which micro-batches.

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

import base64
import copy
import datetime
import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.preflight import model_problems
from elastrain.transfer import NamedState, TorchState, model_signature, state_digest

log = logging.getLogger("elastrain.sharded")

LossFn = Callable[[nn.Module, Any], torch.Tensor]
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


def _local_name(name: str) -> str:
    # nn.Module attribute names may not contain ".".
    return name.replace(".", "/")


class ShardedBackend:
    """`Backend` for one shard of a model, sharded with FSDP2 inside a replica group.

    Contract: every member builds it with the same model (materialised, as
    every member's initial state must be the same), optimizer type and
    hyperparameters, loss and config. The engine calls `place` once the
    member's slot is known, then `form_group` at every generation start
    (with the replica group's members in shard order, or None for a shadow),
    then the step methods of `Backend`. The `model` attribute is the current
    FSDP2 wrapper (None for a shadow); `optimizer` steps the shard tensors.
    """

    framework = "torch"

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
    ) -> None:
        if config.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {config.shard_size}")
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(
                "the sharded trainer needs a materialised model (every member starts from the "
                "same initial state; build it on the CPU with a fixed seed)"
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
        self._problems = model_problems(model)
        if config.checkpoints_periodic:
            self._problems.append(
                "periodic checkpoints are not built for a sharded model yet (shard_size > 1): "
                "drop checkpoint_every/checkpoint_mtbf_s (--ckpt-every/--ckpt-mtbf); a sharded "
                "job survives the loss of any member whose shard a twin holds"
            )
        self._signature = model_signature(model)
        self._full: nn.Module | None = model
        self._user_optimizer = optimizer
        self._policy = shard_policy
        self.shard: int | None = None
        self.model: nn.Module | None = None
        """The FSDP2 wrapper of the current replica group (None: a shadow, or not placed)."""
        self.group: tuple[str, ...] | None = None
        """The members of the replica group `model` is built on, in shard order."""
        self.local = nn.Module()
        """This member's shard: one parameter per model parameter (its rows), and the
        model's buffers (replicated, not sharded)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self._names: list[str] = []
        self._buffers: dict[str, torch.Tensor] = {}
        self._template: nn.Module | None = None
        self._offsets: dict[str, tuple[int, int]] = {}
        self._grad64 = torch.zeros(0, dtype=torch.float64)
        self._extras = torch.zeros(0, dtype=torch.float64)

    # ---- placement and replica groups ---------------------------------------------

    def place(self, shard: int) -> None:
        """Keep only the rows of `shard` (first call), or check the slot did not move.

        The first call turns the full model into this member's shard parameters,
        an optimizer over them (the user's class, hyperparameters and param
        groups) and a meta-device template for building FSDP2 wrappers; the
        full parameters are freed.
        """
        if not 0 <= shard < self.shard_size:
            raise ValueError(f"shard {shard} out of range for shard size {self.shard_size}")
        if self.shard is not None:
            if shard != self.shard:
                raise RuntimeError(
                    f"the coordinator moved this member from shard {self.shard} to {shard}; "
                    "a member keeps its slot for life"
                )
            return
        full = self._full
        assert full is not None
        self.shard = shard
        names: list[str] = []
        off = 0
        with torch.no_grad():
            for name, p in full.named_parameters():
                lo, hi = shard_rows(p.shape[0] if p.dim() else 1, self.shard_size, shard)
                rows = p.detach().reshape(p.shape if p.dim() else (1,))[lo:hi].clone()
                self.local.register_parameter(
                    _local_name(name), nn.Parameter(rows, requires_grad=p.requires_grad)
                )
                names.append(name)
                self._offsets[name] = (off, off + rows.numel())
                off += rows.numel()
            self._buffers = {n: b.detach().clone() for n, b in full.named_buffers()}
        for n, b in self._buffers.items():
            # Buffers travel with the shard state (heal, hash) but are not sharded.
            self.local.register_buffer(_local_name(n), b)
        self._names = names
        self.optimizer = self._shard_optimizer(full)
        self._template = copy.deepcopy(full).to("meta")
        self._full = None
        self._grad64 = torch.zeros(off, dtype=torch.float64)

    def _shard_optimizer(self, full: nn.Module) -> torch.optim.Optimizer:
        opt = self._user_optimizer
        by_id = {id(p): n for n, p in full.named_parameters()}
        groups = []
        for g in opt.param_groups:
            missing = [p for p in g["params"] if id(p) not in by_id]
            if missing:
                raise ValueError("the optimizer holds parameters that are not the model's")
            groups.append(
                {
                    **{k: v for k, v in g.items() if k != "params"},
                    "params": [
                        self.local.get_parameter(_local_name(by_id[id(p)])) for p in g["params"]
                    ],
                }
            )
        try:
            return type(opt)(groups, **opt.defaults)
        except TypeError:
            return type(opt)(groups)  # type: ignore[call-arg]

    def form_group(self, members: tuple[str, ...] | None, open_group: Callable[[], None]) -> bool:
        """Be ready to compute in the replica group `members` (shard order), or be a
        shadow (None). Rebuilds the wrapper only when the group's membership
        changed; `open_group` makes the group's process group the default one
        (all of `members` call this together). Returns True if it rebuilt."""
        if members is not None and members == self.group and self.model is not None:
            return False
        self.leave_group()
        if members is None:
            return False
        assert self.shard is not None and self._template is not None
        if len(members) != self.shard_size:
            raise ValueError(f"a replica group has {self.shard_size} members, got {len(members)}")
        open_group()
        self.model = self._wrap(dist.distributed_c10d._get_default_group())
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
        self.group = None
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()

    def _wrap(self, pg: Any) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        assert self._template is not None
        mesh = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("shard",))
        model = copy.deepcopy(self._template)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float64)
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
        for u in units:
            state = u._get_fsdp_state()  # type: ignore[operator]
            group = state._fsdp_param_group
            if group is None:
                continue
            u.set_gradient_divide_factor(1.0)  # type: ignore[operator]
            u.set_all_reduce_hook(  # type: ignore[operator]
                self._accumulator(
                    [names[id(fp.sharded_param)] for fp in group.fsdp_params],
                    [fp for fp in group.fsdp_params],
                )
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
        """The reduce-scatter hook of one FSDP2 unit: add its float64 output (the
        unit's parameters' padded shards, concatenated) into the shard buffer."""
        spans = []
        off = 0
        for n, fp in zip(names, params, strict=True):
            numel = fp.sharded_size.numel()
            spans.append((off, numel, self._offsets[n]))
            off += fp.padded_sharded_param_size.numel()

        def add(out: torch.Tensor) -> None:
            for at, numel, (lo, hi) in spans:
                self._grad64[lo:hi].add_(out[at : at + numel])

        return add

    # ---- state -------------------------------------------------------------------

    def signature(self) -> list[list[Any]]:
        return self._signature

    def state(self) -> TorchState:
        assert self.optimizer is not None, "state() before place()"
        return TorchState(self.local, self.optimizer)

    def adopt(self, state: NamedState) -> None:
        """A heal wrote the shard parameters in place (the wrapper's storage); the
        wrapper's buffers are copies, refreshed here."""
        if self.model is not None:
            with torch.no_grad():
                for n, b in self.model.named_buffers():
                    b.copy_(self._buffers[n])

    def state_hash(self) -> str:
        return state_digest(self.state())

    def meta(self) -> dict[str, Any]:
        return {
            "rng": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
            "extra": self.extra_state() if self.extra_state else None,
        }

    def load_meta(self, meta: dict[str, Any]) -> None:
        if meta.get("rng"):
            rng = torch.frombuffer(bytearray(base64.b64decode(meta["rng"])), dtype=torch.uint8)
            torch.set_rng_state(rng)
        if self.load_extra_state is not None and meta.get("extra") is not None:
            self.load_extra_state(meta["extra"])

    def problems(self) -> list[str]:
        return self._problems

    def warm_up(self, batch: Any) -> None:
        """Nothing to compile in eager mode."""

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> None:
        """Not counted for a sharded model yet (its full parameters are gone)."""
        return None

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, extra_slots: int) -> None:
        self._grad64.zero_()
        if self._extras.numel() != extra_slots:
            self._extras = torch.zeros(extra_slots, dtype=torch.float64)
        if self.model is not None:
            self._bind(self.model)
            self.model.train()
            for p in self.model.parameters():
                p.grad = None

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        """One round of the replica group: every member of it calls this together
        (FSDP2's collectives), `samples` 0 for a padding round (its gradient is zero)."""
        if self.model is None:
            raise RuntimeError("a shadow does not compute")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(
                (self.seed * 0x9E3779B1 + step * 1_000_003 + microbatch) & 0x7FFF_FFFF_FFFF
            )
            loss = self.loss_fn(self.model, batch)
            (loss * samples).backward()
        return float(loss.detach()) * samples

    def reduce_buffers(self) -> list[torch.Tensor]:
        """The shard's gradient sum: all-reduced over the shard's twins."""
        return [self._grad64]

    def extras(self) -> torch.Tensor:
        """The step's extras: all-reduced over the whole generation."""
        return self._extras

    def apply(self) -> None:
        assert self.optimizer is not None
        b = self.global_batch_size
        g64 = self._grad64
        for name in self._names:
            lp = self.local.get_parameter(_local_name(name))
            if not lp.requires_grad:
                continue
            lo, hi = self._offsets[name]
            # One rounding, from the exact float64 mean: same bits on every twin.
            lp.grad = g64[lo:hi].div_(b).to(lp.dtype).view(lp.shape)
        self.optimizer.step()
        if self.model is not None:
            for p in self.model.parameters():
                p.grad = None

    def discard(self) -> None:
        # An abandoned all-reduce may still write into the buffers: new ones.
        self._grad64 = torch.zeros_like(self._grad64)
        self._extras = torch.zeros_like(self._extras)


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

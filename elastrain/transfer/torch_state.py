"""`TorchState`: a PyTorch model + optimizer as a `NamedState`.

Entries are ``model/<state_dict key>`` in state_dict order, then ``optim/...``,
then ``obj/<name>/...`` for the registered objects (see
`elastrain.transfer.flatten`); the section is the optimizer's class,
param_groups and non-tensor state, and the registered objects' JSON state. A
receiver accepts exactly its own model signature, for the optimizer what is
plausible for its own params (the bounds below), and for the registered objects
exactly its own objects' names and tensor layout, so that a sender cannot make
it allocate more than a small, stated multiple of its own model. Local; no
communication.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections import Counter
from collections.abc import Iterator, Mapping
from enum import Enum
from typing import Any

import torch

from elastrain.transfer.dtypes import byte_view, dtype_name
from elastrain.transfer.errors import HealError
from elastrain.transfer.flatten import (
    GROUPS_PREFIX,
    MODEL_PREFIX,
    OBJECTS_KEY,
    OBJECTS_PREFIX,
    OPTIM_PREFIX,
    Stateful,
    copy_bytes_into,
    decode_refs,
    encode_object,
    flatten_state,
    optimizer_class,
)
from elastrain.transfer.manifest import Entry, Manifest, lay_out, tensor_refs
from elastrain.transfer.names import model_state
from elastrain.transfer.signature import model_signature, signature_mismatch
from elastrain.transfer.state import FlatState, manifest_limit

KIND = "torch"
MAX_TENSORS_PER_PARAM = 8
"""Most optimizer state tensors one param may have (Adam: step, exp_avg,
exp_avg_sq, max_exp_avg_sq)."""
MAX_GROUP_TENSORS = 16
"""Most tensor-valued hyperparameters (e.g. a tensor ``lr``) one param group may have."""
MAX_GROUP_TENSOR_NUMEL = 1024
"""Most elements of one tensor-valued hyperparameter."""
OPTIM_STATE_FACTOR = 8
"""The optimizer state may hold at most this many times the params' bytes (plus
16 bytes per permitted tensor, for 0-dim ``step`` counters): Adam in float32 over
bfloat16 params with float32 master weights needs 6."""


STEP_KEY = "step"
"""The key of the 0-dim step counter in Adam's per-param state."""


def fresh_param_keys(
    cls: type[torch.optim.Optimizer], group: Mapping[str, Any]
) -> list[str] | None:
    """The keys of one param's state after an optimizer's first step, in the order
    torch's ``state_dict`` lists them, for the classes known here: Adam and AdamW
    the step counter (`STEP_KEY`, 0-dim) then two moments (three with ``amsgrad``),
    param-shaped; SGD a momentum buffer when ``momentum`` is set. None for any
    other class: its state is not predicted. (tests/test_transfer.py checks this
    against the optimizers themselves, so a torch that changes it is caught.)"""
    if issubclass(cls, torch.optim.Adam | torch.optim.AdamW):
        moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else [])
        return [STEP_KEY, *moments]
    if issubclass(cls, torch.optim.SGD):
        return ["momentum_buffer"] if group.get("momentum") else []
    return None


class Owner(Enum):
    """What an optimizer tensor belongs to: a param's state or a param group's
    hyperparameters (each has its own bound)."""

    PARAM = "param"
    GROUP = "group"


def fresh_state_entries(
    index: int,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    cls: type[torch.optim.Optimizer],
    group: Mapping[str, Any],
) -> list[tuple[str, torch.dtype, tuple[int, ...]]] | None:
    """``(name, dtype, shape)`` of the state that param ``index`` (of ``dtype`` and
    ``shape``: the param's, or those of the rows of it a shard holds) gets at an
    optimizer's first step, named as ``flatten`` names it: the keys of
    `fresh_param_keys`, the step counter 0-dim of its own dtype (`_step_dtype`),
    the moments like the param. None for a class whose first step is not known.
    The one prediction behind the expected layout (`TorchState.expected_layout`)
    and the landing estimates (`TorchState.landing_estimate`, the sharded
    backend's)."""
    keys = fresh_param_keys(cls, group)
    if keys is None:
        return None
    step: tuple[torch.dtype, tuple[int, ...]] = (_step_dtype(group), ())
    return [
        (f"{OPTIM_PREFIX}{index}/{k}", *(step if k == STEP_KEY else (dtype, shape))) for k in keys
    ]


def entry_bytes(
    entries: list[tuple[str, torch.dtype, tuple[int, ...]]] | None,
) -> list[tuple[str, int]]:
    """`fresh_state_entries` as ``(name, nbytes)``, for a landing estimate: nothing
    for a class whose first step is not known (that state is not estimated, and
    lands in fresh memory)."""
    return [(n, dt.itemsize * math.prod(sh)) for n, dt, sh in entries or []]


def _step_dtype(group: Mapping[str, Any]) -> torch.dtype:
    """The dtype of a fresh Adam step counter: torch makes it float32, or float64
    where that is the default dtype (a fused optimizer's is float32 always)."""
    if not group.get("fused") and torch.get_default_dtype() == torch.float64:
        return torch.float64
    return torch.float32


def _owner(name: str) -> tuple[Owner, int] | None:
    """``(PARAM, i)`` for ``optim/<i>/...``, ``(GROUP, g)`` for
    ``optim/groups/<g>/...``; None for a name of neither form."""
    group = name.startswith(GROUPS_PREFIX)
    head = name[len(GROUPS_PREFIX if group else OPTIM_PREFIX) :].split("/", 1)[0]
    if not head.isdigit():
        return None
    return (Owner.GROUP if group else Owner.PARAM, int(head))


class TorchState:
    """A model, its optimizer and the registered objects, healed together (see the
    module docstring).

    ``install`` loads the registered objects and the optimizer first (a
    ``load_state_dict`` that refuses puts back what was loaded before it,
    leaving the model untouched), then overwrites the model's tensors in place,
    so params and buffers keep their identity (the optimizer and any hooks keep
    pointing at them).
    """

    kind = KIND

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        objects: Mapping[str, Stateful] | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.objects: Mapping[str, Stateful] = objects or {}
        self._steady = False
        self._walked: dict[str, Any] | None = None

    @contextlib.contextmanager
    def steady(self) -> Iterator[None]:
        """`NamedState.steady`: the model's state_dict is walked at most once in it
        (a heal's receiver needed it for its limit, `bound`, `check`, `live_targets`
        and `install`: five walks of every module on its critical path; for the
        benchmarks' model, keeping one shortened its heal by about 1 ms of 27)."""
        if self._steady:  # nested: the outer span owns the walk
            yield
            return
        self._steady = True
        try:
            yield
        finally:
            self._steady, self._walked = False, None

    def _model_state(self) -> dict[str, Any]:
        """`model_state` of the model: walked once per `steady` span, else every call."""
        if not self._steady:
            return model_state(self.model)
        if self._walked is None:
            self._walked = model_state(self.model)
        return self._walked

    def flatten(self) -> FlatState:
        return flatten_state(self.model, self.optimizer, self.objects, self._model_state())

    def _own_object_entries(self) -> dict[str, torch.Tensor]:
        """This state's own ``obj/...`` tensors by name: the layout a sender's must equal."""
        out: list[tuple[str, torch.Tensor]] = []
        for name, obj in self.objects.items():
            encode_object(name, obj, out)
        return dict(out)

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _max_optim_entries(self) -> int:
        return MAX_TENSORS_PER_PARAM * len(self._params()) + MAX_GROUP_TENSORS * len(
            self.optimizer.param_groups
        )

    def manifest_limit(self) -> int:
        return manifest_limit(
            len(self._model_state())
            + self._max_optim_entries()
            + len(self._own_object_entries())
            + MAX_GROUP_TENSORS
        )

    def landing_estimate(self) -> list[tuple[str, int]]:
        """What the state holds now, plus for every param the optimizer has no
        state for what its first step will give it (`fresh_state_entries`; named as
        that step would name it, in the optimizer's section)."""
        out = [(name, t.numel() * t.element_size()) for name, t in self.flatten().tensors]
        held, i = self.optimizer.state, 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p not in held:
                    cls = type(self.optimizer)
                    out += entry_bytes(fresh_state_entries(i, p.dtype, tuple(p.shape), cls, group))
                i += 1
        return out

    def expected_layout(self) -> tuple[Entry, ...] | None:
        """`NamedState.expected_layout`: this state's own layout, where every param the
        optimizer holds no state for gets what its first step will give it
        (`fresh_state_entries`), in `flatten`'s order. None when the optimizer's class
        is not one whose first step is known and some param has no state yet."""
        flat = self.flatten()
        held: dict[int, list[tuple[str, torch.Tensor]]] = {}
        model, rest = [], []
        for name, t in flat.tensors:
            owner = _owner(name) if name.startswith(OPTIM_PREFIX) else None
            if owner is not None and owner[0] is Owner.PARAM:
                held.setdefault(owner[1], []).append((name, t))
            elif name.startswith(MODEL_PREFIX):
                model.append((name, t))
            else:
                rest.append((name, t))  # the groups' tensors and the objects', in order
        laid: list[tuple[str, str, tuple[int, ...]]] = [
            (n, dtype_name(t.dtype), tuple(t.shape)) for n, t in model
        ]
        i = 0
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if i in held:
                    laid += [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in held[i]]
                else:
                    cls = type(self.optimizer)
                    fresh = fresh_state_entries(i, p.dtype, tuple(p.shape), cls, group)
                    if fresh is None:
                        return None
                    laid += [(n, dtype_name(dt), sh) for n, dt, sh in fresh]
                i += 1
        laid += [(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in rest]
        return lay_out(laid)

    def payload_limit(self) -> int:
        """The most payload bytes this state accepts: its model's bytes plus
        `OPTIM_STATE_FACTOR` times its params' bytes (plus the 0-dim slack), plus
        its registered objects' tensor bytes (plus room for a few small ones it does
        not have, which `check` refuses with a clear message)."""
        model_bytes = sum(t.numel() * t.element_size() for t in self._model_state().values())
        param_bytes = sum(p.numel() * p.element_size() for p in self._params())
        object_bytes = sum(
            t.numel() * t.element_size() for t in self._own_object_entries().values()
        )
        return (
            model_bytes
            + OPTIM_STATE_FACTOR * param_bytes
            + 16 * self._max_optim_entries()
            + object_bytes
            + MAX_GROUP_TENSORS * MAX_GROUP_TENSOR_NUMEL * 16
        )

    def bound(self, m: Manifest) -> str | None:
        order = (MODEL_PREFIX, OPTIM_PREFIX, OBJECTS_PREFIX)
        rank_of = {prefix[:-1]: i for i, prefix in enumerate(order)}
        at = 0
        for e in m.entries:
            head, slash, _ = e.name.partition("/")
            kind = rank_of.get(head) if slash else None  # one lookup per entry, not three
            if kind is None:
                return f"entry {e.name!r} is neither model/, optim/ nor obj/"
            if kind < at:
                return f"entry {e.name!r} comes after {order[at]} entries"
            at = kind
        why = (
            self.bound_section(m)
            or self._bound_optim_entries([e for e in m.entries if e.name.startswith(OPTIM_PREFIX)])
            or self._bound_object_entries(
                [e for e in m.entries if e.name.startswith(OBJECTS_PREFIX)]
            )
        )
        limit = self.payload_limit()
        if why is None and m.total_bytes > limit:
            why = (
                f"manifest claims {m.total_bytes} payload bytes; this model and optimizer "
                f"accept at most {limit}"
            )
        return why

    def bound_section(self, m: Manifest) -> str | None:
        """`NamedState.bound_section`: the optimizer's and the objects' JSON are
        well-formed, and their tensor references name exactly the manifest's
        ``optim/`` and ``obj/`` entries."""
        section = m.section
        if not isinstance(section.get("class"), str):
            return "optimizer class is not a string"
        if not isinstance(section.get("param_groups"), list):
            return "optimizer param_groups is not a list"
        if not isinstance(section.get("state"), dict):
            return "optimizer state is not an object"
        # A checkpoint written before objects could be registered has no such key.
        objects = section.get(OBJECTS_KEY, {})
        if not isinstance(objects, dict):
            return "registered objects' state is not an object"
        n_params = len(self._params())
        for key in section["state"]:
            if not key.isdigit() or int(key) >= n_params:
                return f"optimizer state for param {key!r}, but this optimizer has {n_params}"
        optimizer_part = {k: v for k, v in section.items() if k != OBJECTS_KEY}
        for what, part, prefix in (
            ("optimizer", optimizer_part, OPTIM_PREFIX),
            ("registered objects'", objects, OBJECTS_PREFIX),
        ):
            try:
                refs = tensor_refs(part)
            except HealError as e:
                return str(e)
            names = [e.name for e in m.entries if e.name.startswith(prefix)]
            if sorted(refs) != sorted(names):
                missing = sorted(set(refs) - set(names))
                unused = sorted(set(names) - set(refs))
                return (
                    f"{what} tensor references do not match the {prefix} entries (referenced "
                    f"but absent: {missing[:3]}, present but unreferenced: {unused[:3]}, or "
                    "referenced twice)"
                )
        return None

    def _bound_object_entries(self, entries: list[Entry]) -> str | None:
        """A registered object's tensor may be no larger than this state's own of that
        name; one this state does not have, no larger than a hyperparameter (`check`
        then refuses it as a divergence, not as damage)."""
        own = self._own_object_entries()
        if len(entries) > len(own) + MAX_GROUP_TENSORS:
            return f"{len(entries)} registered object tensors; this member has {len(own)}"
        for e in entries:
            mine = own.get(e.name)
            most = MAX_GROUP_TENSOR_NUMEL if mine is None else mine.numel()
            if e.numel > most:
                return f"entry {e.name!r} claims {e.numel} elements; at most {most} fit here"
        return None

    def _bound_optim_entries(self, entries: list[Entry]) -> str | None:
        params = self._params()
        n_groups = len(self.optimizer.param_groups)
        count: Counter[tuple[Owner, int]] = Counter()
        for e in entries:
            owner = _owner(e.name)
            if owner is None:
                return f"optimizer entry {e.name!r} names no param or param group"
            kind, i = owner
            count[owner] += 1
            if kind == Owner.PARAM:
                if i >= len(params):
                    return f"optimizer entry {e.name!r}: this optimizer has {len(params)} params"
                most, per = max(params[i].numel(), 1), MAX_TENSORS_PER_PARAM
                what = f"param {i} has {params[i].numel()}"
            else:
                if i >= n_groups:
                    return f"optimizer entry {e.name!r}: this optimizer has {n_groups} groups"
                most, per = MAX_GROUP_TENSOR_NUMEL, MAX_GROUP_TENSORS
                what = f"a hyperparameter may have {most}"
            if e.numel > most:
                return f"optimizer entry {e.name!r} claims {e.numel} elements; {what}"
            if count[owner] > per:
                return f"more than {per} optimizer tensors for {kind.value} {i}"
        return None

    def check(self, m: Manifest) -> str | None:
        theirs = [
            [e.name[len(MODEL_PREFIX) :], list(e.shape), e.dtype]
            for e in m.entries
            if e.name.startswith(MODEL_PREFIX)
        ]
        problem = signature_mismatch(model_signature(self.model, self._model_state()), theirs)
        if problem is not None:
            return f"cannot heal into this model: {problem}"
        return self.check_section(m)

    def check_section(self, m: Manifest) -> str | None:
        """`NamedState.check_section`: the optimizer's class and groups, and the
        registered objects' names and tensors, are this member's."""
        return self._check_optimizer(m.section) or self._check_objects(m)

    def _check_objects(self, m: Manifest) -> str | None:
        """The same registered names, and each tensor of theirs with this member's
        dtype and shape (what registers an object is the script, the same on every
        member)."""
        theirs = sorted(m.section.get(OBJECTS_KEY, {}))
        mine = sorted(self.objects)
        if theirs != mine:
            return (
                f"registered objects differ: the state holds {theirs}, this member registered "
                f"{mine} (every member must register the same objects under the same names)"
            )
        own = self._own_object_entries()
        layout = {e.name: (e.dtype, list(e.shape)) for e in m.entries if e.name in own}
        for name, t in own.items():
            want = (dtype_name(t.dtype), list(t.shape))
            if layout.get(name) != want:
                return (
                    f"registered object tensor {name!r}: the state has "
                    f"{layout.get(name, 'none')}, this member {want}"
                )
        return None

    def _check_optimizer(self, section: dict[str, Any]) -> str | None:
        """Same class, same number of param groups and params per group."""
        mine = optimizer_class(self.optimizer)
        if section["class"] != mine:
            return (
                f"cannot heal into this optimizer: senders use {section['class']}, this rank {mine}"
            )
        groups = section["param_groups"]
        local = self.optimizer.param_groups
        if len(groups) != len(local):
            return (
                f"cannot heal into this optimizer: senders have {len(groups)} param groups, "
                f"this rank {len(local)}"
            )
        for i, (theirs, g) in enumerate(zip(groups, local, strict=True)):
            params = theirs.get("params") if isinstance(theirs, dict) else None
            if not isinstance(params, list):
                return f"malformed manifest: optimizer param group {i} has no params list"
            if len(params) != len(g["params"]):
                return (
                    f"cannot heal into this optimizer: param group {i} has {len(params)} params "
                    f"on the senders but {len(g['params'])} here"
                )
        return None

    def live_targets(self, m: Manifest) -> dict[str, torch.Tensor]:
        """The model's own tensors for its ``model/`` entries (the optimizer's state
        is adopted, not copied, so it lands fresh either way): those that are
        contiguous CPU tensors of the entry's dtype and shape and share no byte
        with another model tensor (tied weights land fresh and are copied)."""
        live = self._model_state()
        spans: list[tuple[int, int, str]] = []
        out: dict[str, torch.Tensor] = {}
        for e in m.entries:
            if not e.name.startswith(MODEL_PREFIX):
                continue
            t = live.get(e.name[len(MODEL_PREFIX) :])
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            if not t.is_contiguous() or dtype_name(t.dtype) != e.dtype:
                continue
            if list(t.shape) != list(e.shape) or not e.nbytes:
                continue
            spans.append((t.data_ptr(), t.data_ptr() + e.nbytes, e.name))
            out[e.name] = t.detach()
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
            if start < end:  # overlapping storage: neither lands in place
                out.pop(a, None)
                out.pop(b, None)
        return out

    def install(self, tensors: dict[str, torch.Tensor], section: dict[str, Any]) -> None:
        model_sd = self._model_state()
        state = {int(k): decode_refs(v, tensors) for k, v in section["state"].items()}
        groups = decode_refs(section["param_groups"], tensors)
        objects = section.get(OBJECTS_KEY, {})
        # What a refusal puts back: the objects loaded so far, then nothing else changed.
        before = {name: copy.deepcopy(obj.state_dict()) for name, obj in self.objects.items()}
        loaded: list[str] = []
        what = "optimizer"
        try:
            for name, obj in self.objects.items():
                what = f"registered object {name!r}"
                obj.load_state_dict(decode_refs(objects[name], tensors))
                loaded.append(name)
            what = "optimizer"
            self.optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as e:
            for done in loaded:
                self.objects[done].load_state_dict(before[done])
            raise HealError(f"{what}.load_state_dict refused the healed state: {e}") from e
        for key, dst in model_sd.items():
            src = tensors[MODEL_PREFIX + key]
            if dst.numel() and src.data_ptr() != dst.data_ptr():  # else it landed in place
                copy_bytes_into(dst, byte_view(src))

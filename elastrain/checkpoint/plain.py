"""A DCP checkpoint written by a plain torch job, read to start an elastrain job from it.

`elastrain run --resume-from DIR [--resume-step N]` (docs/guide/checkpoints.md, "Starting
from a plain DCP checkpoint"). A plain DDP or FSDP2 job saves with::

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=DIR)

DCP flattens that dict; the keys of ``.metadata``'s ``state_dict_metadata``
this module accepts, and what each means (`classify`, pure):

- ``model.<name>`` (a tensor): the model's ``state_dict`` entry ``<name>``, in
  the names ``get_state_dict`` writes. A DDP model's own ``state_dict()`` (every
  name under ``module.``) and torch.compile's ``_orig_mod.`` segments are
  accepted too: they are stripped, as ``get_state_dict`` strips them.
- ``optim.state.<param>.<key>`` (a tensor): the optimizer state ``<key>`` of the
  parameter named ``<param>`` (``get_state_dict``'s names; ``<param>`` is the
  longest ``model.`` name that prefixes it, since both contain dots). State
  keyed by the parameter's index (``optimizer.state_dict()`` saved as is) is
  refused: its meaning depends on the optimizer's parameter order.
- ``optim.param_groups.*``: never read. The hyperparameters (lr, betas, weight
  decay) come from the script, as they do on every elastrain resume.
- ``step`` (an int, or a one-element integer tensor): the number of steps the
  plain job trained, i.e. the committed step count elastrain starts at. Absent:
  the user gives it (``--resume-step``).
- anything else (a scheduler's or a data loader's state): not loaded; the
  launcher names these keys in a warning.

Local file I/O only. DCP's ``.metadata`` is a pickle and non-tensor values are
``torch.save`` blobs, so the user pointing elastrain at a directory trusts it
as they trust ``torch.distributed.checkpoint.load``; elastrain's own
checkpoints are never read this way (`elastrain.checkpoint.dcp`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoint.dcp import METADATA, model_key, optim_key

MODEL = "model."
OPTIM_STATE = "optim.state."
OPTIM_GROUPS = "optim.param_groups."
STEP = "step"
DDP_PREFIX = "module."
COMPILE_SEGMENT = "_orig_mod."


class PlainCheckpointError(ValueError):
    """The directory is not a DCP checkpoint elastrain can start from; says why."""


@dataclass(frozen=True)
class TensorInfo:
    """A saved tensor's dtype (torch's name, e.g. ``torch.float32``) and shape."""

    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class PlainLayout:
    """What a plain DCP checkpoint holds, in elastrain's terms (see the module docstring)."""

    model: dict[str, TensorInfo]
    """The model's state_dict names (normalised) -> dtype and shape, in saved order."""
    optim: dict[str, dict[str, TensorInfo]]
    """Parameter name -> its optimizer state key -> dtype and shape."""
    keys: dict[str, str]
    """Normalised DCP key (`model_key`, `optim_key`) -> the key in the checkpoint."""
    step: bool
    """The checkpoint has a ``step`` entry."""
    step_tensor: TensorInfo | None = None
    """The ``step`` entry is a tensor of this dtype and shape (None: an object)."""
    ignored: list[str] = field(default_factory=list)
    """Keys neither loaded nor understood (not ``optim.param_groups.*``)."""


def _normalise(names: list[str]) -> dict[str, str]:
    """Saved model name -> the name ``get_state_dict`` would have written."""
    strip_ddp = bool(names) and all(n.startswith(DDP_PREFIX) for n in names)
    out = {}
    for n in names:
        m = n[len(DDP_PREFIX) :] if strip_ddp else n
        out[n] = m.replace(COMPILE_SEGMENT, "")
    return out


def _info(meta: Any) -> TensorInfo | None:
    size = getattr(meta, "size", None)
    props = getattr(meta, "properties", None)
    if size is None or props is None:
        return None  # BytesStorageMetadata: a pickled object, not a tensor
    return TensorInfo(str(props.dtype), tuple(int(x) for x in size))


def classify(state_dict_metadata: Mapping[str, Any]) -> PlainLayout:
    """Map DCP's ``state_dict_metadata`` (key -> Tensor/BytesStorageMetadata) onto
    a `PlainLayout`. Pure. PlainCheckpointError when there is no model, a model
    entry is not a tensor, or optimizer state names no parameter of the model."""
    saved_model = [k[len(MODEL) :] for k in state_dict_metadata if k.startswith(MODEL)]
    if not saved_model:
        raise PlainCheckpointError(
            "it has no model.* entries: save {'model': model_state_dict, 'optim': "
            "optim_state_dict} (the dict torch.distributed.checkpoint.state_dict."
            "get_state_dict returns), optionally with 'step'"
        )
    names = _normalise(saved_model)
    model: dict[str, TensorInfo] = {}
    keys: dict[str, str] = {}
    for saved, name in names.items():
        info = _info(state_dict_metadata[MODEL + saved])
        if info is None:
            raise PlainCheckpointError(f"its entry {MODEL + saved!r} is not a tensor")
        model[name] = info
        keys[model_key(name)] = MODEL + saved
    # Longest first: "0.weight" must not claim "0.weight_v.step".
    by_length = sorted(names.items(), key=lambda kv: -len(kv[0]))
    optim: dict[str, dict[str, TensorInfo]] = {}
    ignored: list[str] = []
    has_step = False
    step_tensor: TensorInfo | None = None
    for key, meta in state_dict_metadata.items():
        if key.startswith(MODEL) or key.startswith(OPTIM_GROUPS):
            continue
        if key == STEP:
            has_step, step_tensor = True, _info(meta)
            continue
        if not key.startswith(OPTIM_STATE):
            ignored.append(key)
            continue
        rest = key[len(OPTIM_STATE) :]
        hit = next(((s, n) for s, n in by_length if rest.startswith(s + ".")), None)
        if hit is None:
            head = rest.split(".", 1)[0]
            if head.isdigit():
                raise PlainCheckpointError(
                    f"its optimizer state is keyed by parameter index ({key!r}): save "
                    "the optimizer state torch.distributed.checkpoint.state_dict."
                    "get_state_dict(model, optimizer) returns (keyed by parameter name), "
                    "not optimizer.state_dict()"
                )
            raise PlainCheckpointError(
                f"its optimizer state {key!r} names no parameter of its model"
            )
        saved, name = hit
        state_key = rest[len(saved) + 1 :]
        info = _info(meta)
        if info is None:
            raise PlainCheckpointError(
                f"its optimizer state {key!r} is not a tensor (only tensors are loaded)"
            )
        optim.setdefault(name, {})[state_key] = info
        keys[optim_key(name, state_key)] = key
    return PlainLayout(model, optim, keys, has_step, step_tensor, ignored)


def read_layout(directory: str | Path) -> PlainLayout:
    """`classify` the checkpoint in ``directory``; PlainCheckpointError if it is
    not a readable DCP checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    d = Path(directory)
    if not (d / METADATA).is_file():
        raise PlainCheckpointError(
            f"{d} is not a torch.distributed.checkpoint directory (no {METADATA} file)"
        )
    try:
        meta = FileSystemReader(str(d)).read_metadata()
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is the same user error
        raise PlainCheckpointError(f"cannot read {d / METADATA}: {e}") from e
    try:
        return classify(meta.state_dict_metadata)
    except PlainCheckpointError as e:
        raise PlainCheckpointError(f"{d}: {e}") from None


def _dtype(info: TensorInfo) -> torch.dtype:
    dtype = getattr(torch, info.dtype.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PlainCheckpointError(f"unknown dtype {info.dtype!r} in the checkpoint")
    return dtype


def _load(directory: str | Path, state_dict: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it loads in a single process: that is what this is.
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state_dict, checkpoint_id=str(directory), no_dist=True)


def read_step(directory: str | Path, layout: PlainLayout) -> int | None:
    """The checkpoint's ``step`` entry (None: it has none); PlainCheckpointError
    if it is not a non-negative integer."""
    if not layout.step:
        return None
    t = layout.step_tensor
    sd: dict[str, Any] = {STEP: None if t is None else torch.empty(t.shape, dtype=_dtype(t))}
    _load(directory, sd)
    value = sd[STEP]
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise PlainCheckpointError(
            f"{directory}: its 'step' entry is {value!r}, not a non-negative integer "
            "(save the number of steps trained as a plain int)"
        )
    return value


def resume_step(saved: int | None, given: int | None, directory: str | Path) -> int:
    """The step to start at: the checkpoint's ``step`` or the user's ``--resume-step``
    (both: they must agree). PlainCheckpointError if neither or they differ."""
    if saved is None and given is None:
        raise PlainCheckpointError(
            f"{directory} has no 'step' entry: give the number of steps it was trained "
            "for with --resume-step N (or save {'step': N} with it)"
        )
    if saved is not None and given is not None and saved != given:
        raise PlainCheckpointError(
            f"--resume-step {given} contradicts the checkpoint's 'step' entry ({saved})"
        )
    step = saved if saved is not None else given
    assert step is not None
    if step < 0:
        raise PlainCheckpointError(f"--resume-step must be >= 0 (got {step})")
    return step


class PlainReader:
    """Reads a plain checkpoint's tensors by elastrain's DCP keys (`model_key`,
    `optim_key`), one whole tensor per call: the interface of
    `elastrain.checkpoint.dcp.ShardedReader` that the resume code uses."""

    def __init__(self, directory: str | Path, layout: PlainLayout) -> None:
        self.directory = Path(directory)
        self.layout = layout
        self.bytes_read = 0
        self._cache: dict[str, torch.Tensor] = {}
        self._info = {model_key(n): i for n, i in layout.model.items()}
        for p, entries in layout.optim.items():
            for k, i in entries.items():
                self._info[optim_key(p, k)] = i

    def has(self, key: str) -> bool:
        return key in self._info

    def _empty(self, key: str) -> torch.Tensor:
        info = self._info[key]
        return torch.empty(info.shape, dtype=_dtype(info))

    def read_all(self) -> None:
        """Read every tensor in one DCP load (one pass over the files); `read` then
        hands them out. For a reader that needs them all (a replicated member)."""
        sd = {self.layout.keys[k]: self._empty(k) for k in self._info}
        _load(self.directory, sd)
        for k in self._info:
            t = sd[self.layout.keys[k]]
            self.bytes_read += t.numel() * t.element_size()
            self._cache[k] = t

    def read(self, key: str) -> torch.Tensor:
        if key not in self._info:
            raise KeyError(f"{self.directory} has no tensor {key!r}")
        cached = self._cache.pop(key, None)
        if cached is not None:
            return cached
        saved = self.layout.keys[key]
        sd = {saved: self._empty(key)}
        _load(self.directory, sd)
        t = sd[saved]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def read_rows(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) (dim 0; a 0-dim tensor is one row): read whole, then sliced."""
        t = self.read(key)
        return t if t.dim() == 0 else t[lo:hi].clone()

    def close(self) -> None:
        """Drop what `read_all` read and nobody took (no file is held open)."""
        self._cache.clear()

"""Export a run's model weights to formats other tools load (`elastrain export`).

The newest checkpoint of a run that verifies (`latest_verified`, as a resume
chooses: a damaged newer one is skipped with a warning) holds the model and the
optimizer. Only the model is exported: its parameters and persistent buffers,
which are the flattened state's ``model/<name>`` entries of a replicated job's
checkpoint and the ``model.<name>`` tensors of a sharded job's DCP checkpoint
(``<name>`` is the model's ``state_dict`` key, without torch.compile's
``_orig_mod`` segments). Optimizer state (``optim/...``, ``optim.state...``)
and registered objects (``obj/...``) are left out.

Formats (`ExportFormat`):

- ``safetensors``: ``model.safetensors`` with the ``state_dict`` names
  (``safetensors.torch.load_file`` and then ``model.load_state_dict``).
- ``dcp``: a `torch.distributed.checkpoint` directory under the key ``model``:
  ``dcp.load({"model": model.state_dict()}, checkpoint_id=DIR)``.
- ``hf``: ``model.safetensors`` with the names a Transformers model of the given
  ``config.json`` expects, plus that ``config.json``, so that
  ``AutoModelForCausalLM.from_pretrained(DIR)`` (or the config's own class)
  loads it. A training script that wrapped the Transformers model in its own
  module saved its names under a prefix (``lm.model.layers.0...``); the export
  finds the one prefix under which every name the model expects is present,
  and strips it.

Local, offline and read-only on the run directory; the output directory is
written as a temp directory beside it and renamed into place, so a failed
export leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoint.dcp import KIND as DCP_KIND
from elastrain.checkpoint.dcp import ShardedReader
from elastrain.checkpoint.files import CHECKPOINTS, CheckpointError, DurableFile, fsync_dir
from elastrain.checkpoint.layout import Layout, safetensors_dtype, safetensors_header
from elastrain.checkpoint.store import VerifiedCheckpoint, latest_verified, load
from elastrain.transfer.dtypes import byte_view
from elastrain.transfer.flatten import MODEL_PREFIX

WEIGHTS = "model.safetensors"
"""The weights file of the ``safetensors`` and ``hf`` formats (Transformers' name)."""

HF_CONFIG = "config.json"
"""A Transformers model's config file (Transformers' name)."""

DCP_MODEL_KEY = "model"
"""The top-level key of the exported DCP checkpoint: ``{"model": state_dict}``."""

SHARDED_MODEL_PREFIX = "model."
"""A sharded (DCP) checkpoint's model tensors: ``model.<state_dict key>``."""

_WRITE_CHUNK = 16 << 20

Progress = Callable[[int, int], None]
"""``progress(bytes_written, bytes_total)``, called as an export writes."""


class ExportFormat(StrEnum):
    """What `export_model` writes (the ``--format`` of `elastrain export`)."""

    HF = "hf"
    SAFETENSORS = "safetensors"
    DCP = "dcp"


class ExportError(CheckpointError):
    """The export cannot be done; the message says why and what to do. Nothing was written."""


@dataclass(frozen=True)
class ExportResult:
    """What `export_model` wrote: from which checkpoint, how many tensors and bytes."""

    output: Path
    step: int
    source: Path
    tensors: int
    nbytes: int
    stripped_prefix: str = ""
    left_out: int = 0
    """hf: the wrapper's own tensors (outside the stripped prefix), not exported."""


# ---- pure decisions ----------------------------------------------------------------------


def checkpoint_dir(run_dir: Path) -> Path:
    """Where a run directory's checkpoints are: ``RUN_DIR/checkpoints``, or RUN_DIR
    itself when it holds step directories (a checkpoint directory was given)."""
    inner = run_dir / CHECKPOINTS
    if inner.is_dir() or not any(p.name.startswith("step-") for p in _entries(run_dir)):
        return inner
    return run_dir


def _entries(d: Path) -> list[Path]:
    try:
        return list(d.iterdir())
    except OSError:
        return []


def wrapper_prefix(names: list[str], expected: Mapping[str, tuple[int, ...]]) -> str:
    """The prefix ``P`` such that ``P + key`` is among ``names`` for every ``key`` a
    Transformers model expects (``""`` when the names are the model's own), the
    shortest if several fit. ExportError naming what is missing when none does.
    Pure."""
    if not expected:
        raise ExportError("the Transformers model of that config has no tensors")
    have = set(names)
    first = next(iter(expected))
    candidates = sorted(
        {
            n[: len(n) - len(first)]
            for n in names
            if n.endswith(first) and (len(n) == len(first) or n[-len(first) - 1] == ".")
        },
        key=len,
    )
    best: tuple[int, str, list[str]] | None = None
    for prefix in candidates:
        missing = [k for k in expected if prefix + k not in have]
        if not missing:
            return prefix
        if best is None or len(missing) < best[0]:
            best = (len(missing), prefix, missing)
    if best is None:
        raise ExportError(
            f"the checkpoint's model has no tensor named like {first!r}, which the "
            "Transformers model of that config expects: is --hf-config the config of the "
            "model that was trained?"
        )
    _, prefix, missing = best
    raise ExportError(
        f"the checkpoint's model (under prefix {prefix!r}) lacks {len(missing)} of the "
        f"{len(expected)} tensors the Transformers model of that config expects, e.g. "
        f"{missing[:3]}: is --hf-config the config of the model that was trained?"
    )


def hf_names(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, torch.Tensor], str]:
    """``tensors`` renamed to the names a Transformers model expects (``expected``:
    name -> shape), and the wrapper prefix stripped. Tensors outside the prefix (a
    wrapper's own modules) are dropped; one under it that the model does not
    expect, or of another shape, is an ExportError. Pure."""
    prefix = wrapper_prefix(list(tensors), expected)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if key not in expected:
            raise ExportError(
                f"the checkpoint has tensor {name!r}, which the Transformers model of that "
                "config does not have: is --hf-config the config of the model that was trained?"
            )
        if tuple(t.shape) != tuple(expected[key]):
            raise ExportError(
                f"tensor {name!r} has shape {list(t.shape)}, the Transformers model of that "
                f"config expects {list(expected[key])} for {key!r}"
            )
        out[key] = t
    return out, prefix


# ---- reading the checkpoint -----------------------------------------------------------


def newest_checkpoint(
    run_dir: str | os.PathLike[str], on_skip: Callable[[int, Path, str], None] | None = None
) -> VerifiedCheckpoint:
    """The newest checkpoint of ``run_dir`` that verifies; ExportError if none does.
    ``on_skip(step, path, reason)`` for each damaged one skipped (as a resume does)."""
    rd = Path(run_dir)
    if not rd.is_dir():
        raise ExportError(f"{rd} is not a directory (give the run directory of a job)")
    d = checkpoint_dir(rd)
    ckpt = latest_verified(d, on_skip=on_skip)
    if ckpt is None:
        raise ExportError(
            f"{rd} has no committed checkpoint that verifies (looked in {d}): train with "
            "--ckpt-every N or --ckpt-mtbf S to write checkpoints"
        )
    return ckpt


def model_tensors(ckpt: VerifiedCheckpoint) -> dict[str, torch.Tensor]:
    """The model's parameters and persistent buffers in ``ckpt`` by ``state_dict``
    name (no optimizer state): a replicated job's ``model/`` entries, or a sharded
    job's ``model.`` tensors read whole. CheckpointCorrupt if a file changed since
    it was verified; ExportError for a checkpoint of a JAX job."""
    framework = ckpt.meta.get("framework", "torch")
    if framework != "torch":
        raise ExportError(
            f"{ckpt.path} was written by a {framework} job: export writes PyTorch models' "
            "weights only"
        )
    if ckpt.kind == DCP_KIND:
        # A sharded job keeps every buffer; its schema names those the model's
        # state_dict leaves out (a checkpoint written before it did keeps them all).
        skip = {SHARDED_MODEL_PREFIX + n for n in nonpersistent_buffers(ckpt)}
        with ShardedReader(ckpt) as reader:
            return {
                fqn[len(SHARDED_MODEL_PREFIX) :]: reader.read(fqn)
                for fqn in reader.tensors
                if fqn.startswith(SHARDED_MODEL_PREFIX) and fqn not in skip
            }
    tensors, _ = load(ckpt, names=lambda n: n.startswith(MODEL_PREFIX))
    return {name[len(MODEL_PREFIX) :]: t for name, t in tensors.items()}


def nonpersistent_buffers(ckpt: VerifiedCheckpoint) -> list[str]:
    """The buffers a sharded job's checkpoint holds that are not in its model's
    ``state_dict`` (its schema's ``nonpersistent_buffers``; none in a flat one)."""
    schema = ckpt.meta.get("schema")
    names = schema.get("nonpersistent_buffers", []) if isinstance(schema, dict) else []
    return [str(n) for n in names]


# ---- writing -------------------------------------------------------------------------


def write_safetensors(
    path: Path, tensors: Mapping[str, torch.Tensor], progress: Progress | None = None
) -> int:
    """``tensors`` as one safetensors file with metadata ``{"format": "pt"}`` (what
    Transformers requires), written tensor by tensor so that ``progress`` sees the
    bytes go out; returns the bytes written. The header is the checkpoint's own
    (`safetensors_header`), for whole tensors. ExportError for a dtype safetensors
    has no name for."""
    for name, t in tensors.items():
        if safetensors_dtype(t.dtype) is None:
            raise ExportError(f"tensor {name!r} is {t.dtype}, which safetensors cannot store")
    contiguous = {n: t.contiguous() for n, t in tensors.items()}
    layout = Layout.of(contiguous)
    head = safetensors_header(layout.pieces(0, layout.total), 0, {"format": "pt"})
    total, done = len(head) + layout.total, 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        out = DurableFile(fd, writeback=True)
        out.write(head)
        done += len(head)
        for t in contiguous.values():
            raw = byte_view(t).numpy().data
            for i in range(0, len(raw), _WRITE_CHUNK):
                part = raw[i : i + _WRITE_CHUNK]
                out.write(part)
                done += len(part)
                if progress is not None:
                    progress(done, total)
        out.sync()
    finally:
        os.close(fd)
    if progress is not None:
        progress(total, total)
    return total


def write_dcp(out: Path, tensors: Mapping[str, torch.Tensor]) -> int:
    """``tensors`` as a `torch.distributed.checkpoint` directory under key ``model``,
    by DCP's own ``save`` in this one process; returns the bytes of its files."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        # DCP warns that it runs without a process group; one process is the point.
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        dcp.save({DCP_MODEL_KEY: dict(tensors)}, checkpoint_id=str(out))
    return sum(p.stat().st_size for p in out.iterdir() if p.is_file())


def read_hf_config(path: str | os.PathLike[str]) -> tuple[Any, dict[str, Any]]:
    """The Transformers config at ``path`` (a config.json, or a directory with one)
    and its JSON; ExportError if it is neither or Transformers cannot read it."""
    p = Path(path)
    file = p / HF_CONFIG if p.is_dir() else p
    if not file.is_file():
        raise ExportError(f"--hf-config {p}: no {HF_CONFIG} there (give the file or its directory)")
    try:
        raw = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"--hf-config {file} is not a JSON file: {e}") from e
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise ExportError("--format hf needs transformers: pip install 'elastrain[hf]'") from e
    try:
        config = AutoConfig.from_pretrained(str(file.parent if p.is_dir() else file))
    except (OSError, ValueError, KeyError) as e:
        raise ExportError(f"--hf-config {file}: Transformers cannot read it: {e}") from e
    return config, raw


def hf_expected(config: Any) -> dict[str, tuple[int, ...]]:
    """The ``state_dict`` names and shapes of the Transformers model of ``config``:
    the class its ``architectures`` names, else a causal LM (`AutoModelForCausalLM`),
    built on the meta device (no memory, no download)."""
    import transformers

    archs = getattr(config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    with torch.device("meta"):
        if cls is not None:
            model = cls(config)
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError as e:
                raise ExportError(
                    f"the config has no `architectures` and is not a causal LM's ({e}): add "
                    'e.g. "architectures": ["LlamaForCausalLM"] to it'
                ) from e
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def _check_output(out: Path) -> None:
    """ExportError unless ``out`` does not exist or is an empty directory."""
    if out.exists():
        if not out.is_dir():
            raise ExportError(f"-o {out} exists and is not a directory")
        if any(out.iterdir()):
            raise ExportError(f"-o {out} is not empty: give a new or empty directory")


def export_model(
    run_dir: str | os.PathLike[str],
    fmt: ExportFormat | str,
    out: str | os.PathLike[str],
    *,
    hf_config: str | os.PathLike[str] | None = None,
    progress: Progress | None = None,
    on_skip: Callable[[int, Path, str], None] | None = None,
) -> ExportResult:
    """Write the model of ``run_dir``'s newest verified checkpoint to ``out`` in
    ``fmt`` (see the module docstring). Offline and local; reads the checkpoint
    once (its optimizer bytes too, for the CRC-32s) and holds the model's tensors
    in memory. ``out`` must not exist or be empty; it appears complete or not at
    all. ExportError (nothing written) for an unknown format, no verified
    checkpoint, a JAX checkpoint, an output that is not empty, or (``hf``) a
    missing or unreadable config or names that do not fit it."""
    try:
        fmt = ExportFormat(fmt)
    except ValueError:
        known = ", ".join(f.value for f in ExportFormat)
        raise ExportError(f"unknown export format {fmt!r}: use one of {known}") from None
    if fmt is ExportFormat.HF and hf_config is None:
        raise ExportError(
            "--format hf needs --hf-config DIR_OR_FILE: the model's config.json (what "
            "model.config.save_pretrained(DIR) wrote)"
        )
    if fmt is not ExportFormat.HF and hf_config is not None:
        raise ExportError(f"--hf-config is for --format hf, not {fmt.value}")
    dest = Path(out)
    _check_output(dest)
    config = raw_config = None
    if fmt is ExportFormat.HF:
        assert hf_config is not None
        config, raw_config = read_hf_config(hf_config)
    ckpt = newest_checkpoint(run_dir, on_skip)
    tensors = model_tensors(ckpt)
    prefix, found = "", len(tensors)
    if config is not None:
        tensors, prefix = hf_names(tensors, hf_expected(config))
    _check_output(dest)  # again: reading a big checkpoint takes a while
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        if fmt is ExportFormat.DCP:
            nbytes = write_dcp(tmp, tensors)
            if progress is not None:
                progress(nbytes, nbytes)
        else:
            nbytes = write_safetensors(tmp / WEIGHTS, tensors, progress)
        if raw_config is not None:
            (tmp / HF_CONFIG).write_text(json.dumps(raw_config, indent=2, sort_keys=True) + "\n")
        with contextlib.suppress(FileNotFoundError):
            dest.rmdir()  # empty (checked above)
        os.replace(tmp, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(
        dest, ckpt.step, ckpt.path, len(tensors), nbytes, prefix, found - len(tensors)
    )


def format_bytes(n: float) -> str:
    """``n`` bytes for a person: 1.5 GB, 320 MB, 12 kB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")

"""Resume, worker side: find the checkpoint to start from and install it.

Who calls: every worker at start, before its first rendezvous (`load_resume`
then `install_checkpoint`); local and blocking. Meta travels as sorted JSON,
so dicts keep their key order through `ordered_json` (the optimizer's key
order decides the flattening order, hence the state hash).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from elastrain.checkpoint import (
    CheckpointCorrupt,
    VerifiedCheckpoint,
    latest_verified,
    load,
)
from elastrain.transfer import HealError, NamedState
from elastrain.transfer.manifest import build_manifest, validate_manifest

log = logging.getLogger("elastrain.checkpoint")


NOT_THIS_MODEL = "Resume with the same script, or start in a fresh --run-dir."
"""What a resume that does not fit this model and optimizer tells the user."""


class ResumeError(RuntimeError):
    """The checkpoint to resume from cannot be loaded into this model and optimizer."""


def install_checkpoint(
    state: NamedState, tensors: dict[str, torch.Tensor], section: dict[str, Any], where: str
) -> None:
    """Make loaded checkpoint tensors and section the live `state` (local).

    Checks the checkpoint against the state first, with the heal's own checks
    and install (`NamedState.bound`, `check`, `install`: names, shapes, dtypes,
    torch's optimizer class, groups and plausible sizes); raises ResumeError
    naming ``where`` without touching the state if it does not fit.
    """
    m = build_manifest(state.kind, list(tensors.items()), section, [0], {}, 0)
    try:
        validate_manifest(m, [0])
        problem = state.bound(m) or state.check(m)
    except HealError as e:
        problem = str(e)
    if problem is not None:
        raise ResumeError(
            f"checkpoint {where} does not fit this model and optimizer: {problem}. "
            "Resume with the same script, or start in a fresh --run-dir."
        )
    try:
        state.install(dict(tensors), section)
    except HealError as e:
        raise ResumeError(f"checkpoint {where}: {e}") from e


_DICT = "$dict"


def ordered_json(value: Any) -> Any:
    """Encode JSON ``value`` so that dict key order survives canonical (sorted) JSON.

    Checkpoint meta is stored with sorted keys, but the order of an optimizer's
    state keys decides the order of its tensors when the state is flattened
    again (the next checkpoint's layout, the state hash). Dicts become
    ``{"$dict": [[key, value], ...]}``; `from_ordered_json` undoes it.
    """
    if isinstance(value, dict):
        return {_DICT: [[k, ordered_json(v)] for k, v in value.items()]}
    if isinstance(value, list | tuple):
        return [ordered_json(v) for v in value]
    return value


def from_ordered_json(value: Any) -> Any:
    """Inverse of `ordered_json`."""
    if isinstance(value, dict):
        if set(value) == {_DICT}:
            return {str(k): from_ordered_json(v) for k, v in value[_DICT]}
        return {k: from_ordered_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_ordered_json(v) for v in value]
    return value


def parse_resume(value: str | None, default: str) -> str | int:
    """The resume mode from $ELASTRAIN_RESUME: "none", "latest" or a step number."""
    v = (value or default).strip().lower()
    if v in ("none", "latest"):
        return v
    if v.isdigit():
        return int(v)
    raise ValueError(f"ELASTRAIN_RESUME must be 'none', 'latest' or a step number, got {value!r}")


def load_resume(
    directory: str | None, mode: str | int
) -> tuple[VerifiedCheckpoint, dict[str, torch.Tensor], dict[str, Any]] | None:
    """Find and read the checkpoint to resume from: ``(checkpoint, tensors, meta)`` or None.

    Who calls: every worker at start, before its first rendezvous (local,
    blocking, reads the checkpoint once). ``mode`` "none": None. A step
    number: exactly that checkpoint (the launcher chose and verified it and
    discarded newer ones); RuntimeError if it is not the newest committed one
    any more. "latest": the newest checkpoint that verifies; one that fails
    verification is skipped with a warning naming the file.
    """
    if mode == "none" or directory is None:
        return None
    if isinstance(mode, int):
        ckpt = latest_verified(directory, verify_checksums=False)
        if ckpt is None or ckpt.step != mode:
            raise RuntimeError(
                f"the launcher chose checkpoint step {mode} in {directory}, but the newest "
                f"committed one is {ckpt.step if ckpt else 'none'}; was the directory changed?"
            )
        if ckpt.kind != "flat":
            return ckpt, {}, copy.deepcopy(ckpt.meta)  # sharded: read by its own reader
        tensors, meta = load(ckpt)  # checks every CRC-32 while reading
        return ckpt, tensors, meta
    for attempt in range(3):
        ckpt = latest_verified(directory, verify_checksums=attempt > 0)
        if ckpt is None:
            return None
        if ckpt.kind != "flat":
            return ckpt, {}, copy.deepcopy(ckpt.meta)  # sharded: read by its own reader
        try:
            tensors, meta = load(ckpt)
        except (CheckpointCorrupt, OSError) as e:
            log.warning("checkpoint %s could not be loaded (%s); looking again", ckpt.path, e)
            continue
        return ckpt, tensors, meta
    raise RuntimeError(f"no checkpoint in {directory} could be loaded after 3 attempts")


def resolve_directory(
    configured: str | None, env_dir: str | None, run_dir: str | None
) -> str | None:
    """The checkpoint directory: the launcher's, else the configured one, else <run_dir>/checkpoints."""
    if env_dir:
        return env_dir
    if configured:
        return configured
    if run_dir:
        return str(Path(run_dir) / "checkpoints")
    return None

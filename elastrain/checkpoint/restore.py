"""Resume, worker side: find the state to start from and install it.

Who calls: every worker at start, before its first rendezvous, through
`restore_newest` (the checkpoint manager's `Checkpointing.restore`): it finds
the newest verified checkpoint (`load_resume`), checks that this job can go on
from it (framework, layout, data order: the `RestoreTarget`'s answers) and has
the target install it; with none, a plain torch DCP directory given as a
source. Local and blocking. Meta travels as sorted JSON, so dicts keep their
key order through `ordered_json` (the optimizer's key order decides the
flattening order, hence the state hash).
"""

from __future__ import annotations

import copy
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from elastrain.checkpoint import (
    CheckpointCorrupt,
    VerifiedCheckpoint,
    latest_verified,
    load,
)
from elastrain.checkpoint.plain import PlainCheckpointError
from elastrain.data import OrderKind
from elastrain.transfer import HealError, NamedState
from elastrain.transfer.manifest import build_manifest, validate_manifest

log = logging.getLogger("elastrain.checkpoint")


NOT_THIS_MODEL = "Resume with the same script, or start in a fresh --run-dir."
"""What a resume that does not fit this model and optimizer tells the user."""


class ResumeError(RuntimeError):
    """The checkpoint to resume from cannot be loaded into this model and optimizer."""


class RestoreRefused(ValueError):
    """The saved state cannot fit this job at all (another framework's, another
    layout's, another data order's, a plain directory that does not match): the
    worker ends as misconfigured with this message before any step."""


Loaded = Callable[[int, float], None]
"""Told the bytes read and the seconds it took once a restore's reading is done."""


class RestoreTarget(Protocol):
    """What a restore installs into: the worker's side of it (its topology, its
    backend and its data feed). The manager decides what to read and whether the
    job may go on from it; the target answers the questions only it can and puts
    the bytes where its layout wants them."""

    @property
    def framework(self) -> str:
        """The job's framework ("torch", "jax"): a checkpoint of another is refused."""

    def restore_problem(self, ckpt: VerifiedCheckpoint) -> str | None:
        """Why this job cannot resume from ``ckpt`` at all (None: it may try)."""

    def order_problem(self, order: Any) -> str | None:
        """Why this job cannot go on with state trained on the sample order ``order``."""

    def restore(
        self, ckpt: VerifiedCheckpoint, tensors: Any, meta: dict[str, Any], loaded: Loaded
    ) -> int | None:
        """Install ``ckpt`` (meta decoded); the bytes read now, or None where the
        reading happens later and calls ``loaded`` then."""

    def read_plain(
        self, directory: str, wanted_step: int | None
    ) -> tuple[int, Callable[[Loaded], None]]:
        """Check a plain torch DCP directory against this script: its step and the
        function that installs it (raises PlainCheckpointError, ResumeError, ValueError)."""


class RestoreSource(enum.Enum):
    """Where a restored state came from."""

    CHECKPOINT = "checkpoint"
    """An elastrain checkpoint (flat or DCP), verified."""
    PLAIN = "plain"
    """A plain torch job's DCP directory (`elastrain run --resume-from`)."""


@dataclass(frozen=True)
class Restored:
    """What `restore_newest` installed."""

    source: RestoreSource
    step: int
    """The checkpoint's committed count, or the plain directory's step."""
    path: str
    meta: dict[str, Any] | None
    """The checkpoint's meta (extras decoded, data order filled in) for the
    worker's carried state; None for a plain directory (the script's own)."""
    generation: int | None
    seconds: float
    """Finding, checking and reading up to the install's return."""


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


def restore_newest(
    directory: str | None,
    mode: str | int,
    target: RestoreTarget,
    loaded: Callable[[Restored, int, float], None],
    *,
    newer_than: int | None = None,
    plain: tuple[str, int | None] | None = None,
) -> Restored | None:
    """Restore the newest verified state into ``target``: the checkpoint ``mode``
    names (`load_resume`), else the plain torch DCP directory ``plain``
    ((directory, step or None)), else nothing (None).

    ``newer_than``: a standby's refresh: only the newest verified checkpoint, and
    only if it holds more committed steps (no plain fallback). ``loaded(restored,
    bytes, seconds)`` is called once the bytes are read (now, or later for a
    sharded reader). Raises `RestoreRefused` for a state this job cannot go on
    from; the caller ends the worker as misconfigured with its message.
    """
    t0 = time.monotonic()
    got = load_resume(directory, "latest" if newer_than is not None else mode)
    if newer_than is not None and (got is None or got[0].step <= newer_than):
        return None
    if got is None:
        return _restore_plain(plain, target, loaded, t0) if plain is not None else None
    ckpt, tensors, meta = got
    problem = target.restore_problem(ckpt)
    if problem is not None:
        raise RestoreRefused(problem)
    saved = meta.get("framework", "torch")
    if saved != target.framework:
        raise RestoreRefused(
            f"checkpoint {ckpt.path} was written by a {saved} job, this is {target.framework}"
        )
    meta["extra"] = from_ordered_json(meta.get("extra"))
    if meta.get("data") is None:
        # Written before the order was recorded: those jobs used randperm from 0.
        meta["data"] = {"order": OrderKind.RANDPERM.value, "position": None}
    problem = target.order_problem(meta["data"].get("order"))
    if problem is not None:
        raise RestoreRefused(f"checkpoint {ckpt.path} cannot be resumed: {problem}")
    before = time.monotonic() - t0
    restored = Restored(
        RestoreSource.CHECKPOINT, ckpt.step, str(ckpt.path), meta, ckpt.generation, before
    )
    try:
        nbytes = target.restore(ckpt, tensors, meta, lambda n, s: loaded(restored, n, before + s))
    except _not_this_script() as e:
        # Checked before anything is installed: the model or optimizer is not this script's.
        raise RestoreRefused(str(e)) from e
    # The same result, timed up to the install's return (a reader that calls
    # `loaded` later was handed `restored`, timed up to the reading's start).
    done = replace(restored, seconds=time.monotonic() - t0)
    if nbytes is not None:
        loaded(done, nbytes, done.seconds)
    return done


def _not_this_script() -> tuple[type[Exception], ...]:
    """The errors a target raises for a saved state that is not this script's model
    and optimizer (raised before anything is installed)."""
    # sharded_parts imports this module (ResumeError): read its error class late.
    from elastrain.checkpoint.sharded_parts import ResumeMismatch

    return (ResumeError, ResumeMismatch)


def _restore_plain(
    plain: tuple[str, int | None],
    target: RestoreTarget,
    loaded: Callable[[Restored, int, float], None],
    t0: float,
) -> Restored:
    """Start from a plain torch job's DCP directory: its model and optimizer state,
    at its step; hyperparameters, the data order's kind and everything else come
    from the script."""
    directory, wanted = plain
    refused: tuple[type[Exception], ...] = (PlainCheckpointError, ValueError, *_not_this_script())
    try:
        step, install = target.read_plain(directory, wanted)
    except refused as e:
        raise RestoreRefused(f"--resume-from: {e}") from e
    before = time.monotonic() - t0
    restored = Restored(RestoreSource.PLAIN, step, str(directory), None, None, before)
    install(lambda n, s: loaded(restored, n, before + s))
    return restored


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

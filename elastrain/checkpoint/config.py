"""`CheckpointConfig` and the Young/Daly checkpoint interval."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from enum import StrEnum


class CheckpointFormat(StrEnum):
    """How a job's own checkpoints are written (``--ckpt-format``).

    Both have the same atomic commit (a signed marker written last, after every
    writer's part is durable and verified), retention and schedule; they differ
    in the files. Resume reads either, whatever the job writes now: the marker
    says which (its ``kind``)."""

    FLAT = "flat"
    """The flattened state striped over the members (``shard-K-of-N.safetensors``
    + JSON); carries everything a replicated job holds (JAX state, registered
    objects). A replicated job's default."""
    DCP = "dcp"
    """`torch.distributed.checkpoint` format (`elastrain.checkpoint.dcp`): torch's
    `dcp.load` reads it into a plain model and optimizer. What a sharded job
    always writes; a replicated torch job writes it with ``--ckpt-format dcp``."""


def check_format(value: str | None, name: str = "--ckpt-format") -> None:
    """ValueError naming the setting ``name`` unless ``value`` is None (not set) or
    a `CheckpointFormat`'s value: the one check of every place that takes the format."""
    if value is not None and value not in tuple(CheckpointFormat):
        raise ValueError(f"{name} must be one of {', '.join(CheckpointFormat)} (got {value!r})")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where and how checkpoints are written and kept. Validated on construction.

    The same config must be used by every member of a job (they write shards of
    the same checkpoints into the same directory).
    """

    directory: str
    """Root directory of the checkpoints (``<run_dir>/checkpoints`` by convention).

    Holds one ``step-XXXXXXXX/`` directory per checkpoint. Must be shared by all
    members (one host, or a shared filesystem). Created on the first save."""

    keep_last: int = 3
    """Committed checkpoints kept by `apply_retention`, newest first (>= 1).

    The newest *verified* checkpoint is kept in addition if it is older."""

    keep_every: int = 0
    """Also keep forever every checkpoint whose step is a multiple of this (0 = off)."""

    fsync: bool = True
    """fsync files and directories before renames and before the commit marker.

    Turning it off is only safe on throw-away storage (tests, tmpfs): after a
    power loss a marker could then point at data that never reached the disk."""

    def __post_init__(self) -> None:
        if not isinstance(self.directory, str) or not self.directory.strip():
            raise ValueError(
                "CheckpointConfig.directory must be a non-empty path; "
                "use e.g. '<run_dir>/checkpoints'"
            )
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise ValueError(
                f"CheckpointConfig.directory {self.directory!r} exists and is not a directory; "
                "point it at a directory (it is created if missing)"
            )
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ValueError(
                f"CheckpointConfig.keep_last must be >= 1, got {self.keep_last!r}; "
                "to write no checkpoints, disable checkpointing instead"
            )
        if not isinstance(self.keep_every, int) or self.keep_every < 0:
            raise ValueError(
                f"CheckpointConfig.keep_every must be >= 0 (0 turns it off), "
                f"got {self.keep_every!r}"
            )


def young_daly_interval(mtbf_s: float, save_cost_s: float) -> float:
    """The Young/Daly checkpoint interval ``sqrt(2 * mtbf_s * save_cost_s)``, in seconds.

    ``mtbf_s``: mean time between failures of the whole job (not of one worker),
    user-given or observed. ``save_cost_s``: what one checkpoint costs the
    training loop, i.e. the measured *blocking* time (`Snapshot.take` plus the
    training thread's wait for its deferred copy), not the background write. Pure; raises ValueError for non-finite or non-positive
    inputs, and when ``save_cost_s >= mtbf_s`` (the first-order rule does not
    hold there: the job would spend most of its time checkpointing).
    """
    for name, v in (("mtbf_s", mtbf_s), ("save_cost_s", save_cost_s)):
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
    if save_cost_s >= mtbf_s:
        raise ValueError(
            f"save_cost_s ({save_cost_s}) must be much smaller than mtbf_s ({mtbf_s}); "
            "make saves cheaper (fewer bytes, more shards) or checkpoint at a fixed interval"
        )
    return math.sqrt(2.0 * mtbf_s * save_cost_s)


@dataclass(frozen=True)
class CheckpointPolicy:
    """The durable checkpoints' section of `TrainerConfig` (what `Checkpointing` reads)."""

    directory: str | None
    """Configured directory (the launcher's wins; see `TrainerConfig.checkpoint_dir`)."""
    every: int
    """Steps between checkpoints (0: none; with `mtbf_s`, only the first one)."""
    mtbf_s: float | None
    """Job MTBF prior for the Young/Daly interval (None: fixed interval)."""
    keep_last: int
    """Committed checkpoints kept."""
    keep_every: int
    """Also keep every checkpoint whose step is a multiple of this (0: off)."""
    commit_timeout_s: float
    """How long rank 0 waits for every shard of one checkpoint."""
    fsync: bool
    """fsync files and directories."""
    format: CheckpointFormat = CheckpointFormat.FLAT
    """How a replicated job writes its checkpoints (a sharded job: always DCP;
    `written_format`)."""

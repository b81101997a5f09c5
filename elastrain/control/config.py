"""The coordinator's configuration."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elastrain.quantity import parse_quantity


@dataclass(frozen=True, kw_only=True)
class CoordinatorConfig:
    """How the coordinator decides membership. Times are seconds."""

    target: int
    """Members the job wants (the launcher's -n). Startup waits for this many."""

    min_members: int = 0
    """Below this many members no generation runs; the job waits for replacements.
    0 means `shard_size` (one replica group; 1 when unsharded)."""

    max_members: int = field(default=0)
    """Most members in one generation; extra registrants wait as standbys (hot
    spares) and enter when a member is lost. 0 means `target`."""

    start_grace_s: float = 60.0
    """At startup, how long to wait for `target` registrations before starting
    with at least `min_members`."""

    lease_s: float = 5.0
    """A member with no sign of life for this long is expelled."""

    suspect_s: float = 1.0
    """When a failure is reported, members silent for this long are left out of
    the next generation (a hung peer must not stall it). Must exceed the
    workers' heartbeat interval several times over."""

    heartbeat_s: float = 0.25
    """Heartbeat interval the workers are told to use."""

    hang_silence_s: float = 0.5
    """A member whose collective is overdue asks whether a peer is hung
    (`Membership.confirm_hang`); peers silent for longer than this are. Two
    heartbeat intervals by default: a stopped process misses both, a live but
    loaded one rarely does (benchmarks/false_hangs.py measures it). The
    asker's own overdue wait is the second, independent signal, which is why
    this can be shorter than `suspect_s`. Must be at least twice
    `heartbeat_s`."""

    ready_timeout_s: float = 15.0
    """Members of a new generation that have not called rendezvous by then are expelled."""

    shard_size: int = 1
    """Members per replica group (`elastrain.control.layout`): inside a group the
    model is sharded, one shard per member. Every generation's members are
    given slots (replica group, shard) that survivors keep; 1 means unsharded
    (no slots). `target`, `min_members` and `max_members` must be multiples of it.
    The *preferred* shard size: resharding (`reshard_after_s`) may run a
    generation at another one (`Generation.shard_size`) and returns to it."""

    reshard_after_s: float | None = None
    """Sharded jobs: when the current generation has a vacancy (an incomplete
    replica group, no joiner waiting to fill it) for longer than this, regroup
    its members in memory to a shard size that makes whole groups
    (`elastrain.control.layout.choose_shard_size`), at a step boundary; when
    members return so that `shard_size` divides their count again, regroup
    back. None: never reshard (a vacancy waits for a replacement)."""

    memory_per_member: int | None = None
    """Bytes of training state one member can hold, for resharding: a shard size
    S fits when `state_factor` x the model's bytes / S is at most this. A reshard
    to a shard size that does not fit is refused (the job keeps its layout).
    None: no limit. Needs `reshard_after_s`."""

    state_factor: float = 4.0
    """Bytes of training state per byte of the model's parameters: the parameter,
    its gradient and Adam's two moments (4). An estimate: raise it for what your
    optimizer and engine keep beyond that (the sharded engine's float64
    gradient buffer is 2 per float32 parameter byte: 5 for Adam), lower it for
    SGD."""

    def __post_init__(self) -> None:
        if self.target < 1:
            raise ValueError(
                f"target must be >= 1 (got {self.target}); pass -n with a positive count"
            )
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1 (got {self.shard_size}); 1 means unsharded")
        if self.target % self.shard_size:
            raise ValueError(
                f"target ({self.target}) must be a multiple of shard_size ({self.shard_size}): "
                f"members form replica groups of {self.shard_size}"
            )
        if self.min_members == 0:
            object.__setattr__(self, "min_members", self.shard_size)
        if not 1 <= self.min_members <= self.target:
            raise ValueError(
                f"min_members must be between 1 and target={self.target} (got {self.min_members}); "
                "lower --min or raise -n"
            )
        if self.max_members == 0:
            object.__setattr__(self, "max_members", self.target)
        if self.max_members < self.target:
            raise ValueError(f"max_members ({self.max_members}) must be >= target ({self.target})")
        for name, value in (
            ("min_members", self.min_members),
            ("max_members", self.max_members),
        ):
            if value % self.shard_size:
                raise ValueError(
                    f"{name} ({value}) must be a multiple of shard_size ({self.shard_size}): "
                    f"members form replica groups of {self.shard_size}"
                )
        if self.suspect_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"suspect_s ({self.suspect_s}) must be at least twice heartbeat_s ({self.heartbeat_s}), "
                "or live members will be expelled as hung"
            )
        if self.hang_silence_s < 2 * self.heartbeat_s:
            raise ValueError(
                f"hang_silence_s ({self.hang_silence_s}) must be at least twice heartbeat_s "
                f"({self.heartbeat_s}), or live members will be expelled as hung"
            )
        if self.lease_s < self.suspect_s:
            raise ValueError(f"lease_s ({self.lease_s}) must be >= suspect_s ({self.suspect_s})")
        for name in ("start_grace_s", "ready_timeout_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.reshard_after_s is not None:
            if not (math.isfinite(self.reshard_after_s) and self.reshard_after_s >= 0):
                raise ValueError(
                    f"reshard_after_s must be a number of seconds >= 0 (got {self.reshard_after_s})"
                )
            if self.shard_size == 1:
                raise ValueError(
                    "resharding regroups a sharded job's replica groups: it needs shard_size > 1 "
                    "(--shard-size S)"
                )
        if self.memory_per_member is not None:
            if self.memory_per_member < 1:
                raise ValueError(
                    f"memory_per_member must be a positive number of bytes "
                    f"(got {self.memory_per_member})"
                )
            if self.reshard_after_s is None:
                raise ValueError(
                    "memory_per_member only limits what a reshard may choose: "
                    "set reshard_after_s too (--reshard-after S)"
                )
        if not (math.isfinite(self.state_factor) and self.state_factor > 0):
            raise ValueError(f"state_factor must be > 0 (got {self.state_factor})")

    def member_bytes(self, param_bytes: int, shard_size: int) -> int:
        """Bytes of training state one member holds with a model of `param_bytes`
        split `shard_size` ways (`state_factor` x its shard), rounded up."""
        return math.ceil(param_bytes * self.state_factor / shard_size)

    def fits(self, param_bytes: int, shard_size: int) -> bool:
        """Does a shard of a `param_bytes` model split `shard_size` ways fit
        `memory_per_member`? (Always, with no limit.)"""
        limit = self.memory_per_member
        return limit is None or self.member_bytes(param_bytes, shard_size) <= limit


def parse_bytes(text: str) -> int:
    """A byte count with an optional suffix, as Kubernetes writes memory:
    "512M" (10^6 bytes each), "2G", "1.5T", "2Gi" (2^30), "512Mi", or plain
    "1048576". ValueError saying what is accepted otherwise (including
    counts below one byte, and Kubernetes' milli suffix "m")."""
    try:
        if text.strip().endswith("m"):
            raise ValueError  # Kubernetes' milli: a thousandth of a byte is no size
        q = parse_quantity(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is not a size in bytes: use e.g. 512M, 2G, 16Gi, or a plain number"
        ) from None
    if q < 1:
        raise ValueError(f"{text!r} is less than one byte")
    return math.floor(q)  # "1.5k" is 1500; a fraction of a byte left over is dropped

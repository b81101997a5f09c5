"""The coordinator's configuration."""

from __future__ import annotations

from dataclasses import dataclass, field


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

    ready_timeout_s: float = 15.0
    """Members of a new generation that have not called rendezvous by then are expelled."""

    shard_size: int = 1
    """Members per replica group (`elastrain.control.layout`): inside a group the
    model is sharded, one shard per member. Every generation's members are
    given slots (replica group, shard) that survivors keep; 1 means unsharded
    (no slots). `target`, `min_members` and `max_members` must be multiples of it."""

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
        if self.lease_s < self.suspect_s:
            raise ValueError(f"lease_s ({self.lease_s}) must be >= suspect_s ({self.suspect_s})")
        for name in ("start_grace_s", "ready_timeout_s", "heartbeat_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

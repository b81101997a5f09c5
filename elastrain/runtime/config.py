"""The worker runtime's configuration."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """What the user decides about an elastic training job. Times are seconds."""

    global_batch_size: int
    """Samples per step, fixed whatever the membership (the math does not change)."""

    micro_batch_size: int
    """Samples per forward/backward; must divide global_batch_size. A step's
    micro-batches are split over the members alive for it."""

    total_steps: int
    """Steps to train; the launcher's --steps overrides it."""

    seed: int = 0
    """Seeds the global sample order and the per-micro-batch RNG."""

    shuffle: bool = True
    """Shuffle the global order (a fresh seeded permutation per epoch)."""

    hang_timeout_floor_s: float = 3.0
    """The step watchdog never fires sooner than this."""

    hang_timeout_ceiling_s: float = 60.0
    """...nor later than this. It is also the process group's own timeout."""

    hang_timeout_multiplier: float = 8.0
    """Watchdog = multiplier x the slowest all-reduce wait of the recent steps,
    clamped to [floor, ceiling]."""

    initial_hang_timeout_s: float = 30.0
    """Watchdog before any step has been measured (first steps, warm-up)."""

    rendezvous_timeout_s: float = 15.0
    """How long building a process group may wait for its members in the store."""

    heal_timeout_s: float = 120.0
    """Upper bound on receiving the state from peers."""

    coordinator_timeout_s: float = 10.0
    """Timeout of one coordinator call (long polls add their wait)."""

    hash_state: bool = True
    """Hash the full state at every generation start (logged as an event, so
    tests and chaos runs can check that every member holds the same state)."""

    def __post_init__(self) -> None:
        if self.global_batch_size < 1 or self.micro_batch_size < 1:
            raise ValueError("global_batch_size and micro_batch_size must be positive")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"micro_batch_size ({self.micro_batch_size}) must divide global_batch_size "
                f"({self.global_batch_size}); pick e.g. {self._suggest()}"
            )
        if self.total_steps < 0:
            raise ValueError("total_steps must be >= 0")
        if not 0 < self.hang_timeout_floor_s <= self.hang_timeout_ceiling_s:
            raise ValueError(
                "need 0 < hang_timeout_floor_s <= hang_timeout_ceiling_s "
                f"(got {self.hang_timeout_floor_s}, {self.hang_timeout_ceiling_s})"
            )
        if self.hang_timeout_multiplier < 1:
            raise ValueError("hang_timeout_multiplier must be >= 1")

    def _suggest(self) -> int:
        return max(
            d for d in range(1, self.micro_batch_size + 1) if self.global_batch_size % d == 0
        )

    @property
    def num_microbatches(self) -> int:
        return self.global_batch_size // self.micro_batch_size

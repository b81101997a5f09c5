"""When checkpoints are due: fixed, or automatic (Young/Daly) from agreed measurements.

Pure and local: the trainer's training thread calls it; every input that
changes it comes from the step's all-reduce, so every member of a generation
holds the same schedule and decides the same (see `elastrain.checkpoint.manager`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from elastrain.checkpoint import young_daly_interval

CONTRIB_SLOTS = 7
"""Values each member adds to the step's all-reduce for the schedule:
save-cost sum, save-cost count, step-time sum, step-time count, time since
its previous commit (sum, count), and a failure flag (it joined a generation
formed after a failure since its previous commit)."""


@dataclass(frozen=True)
class IntervalChoice:
    """An automatic interval decision, for the log and the `checkpoint_interval` event."""

    interval_steps: int
    interval_s: float | None
    save_cost_s: float | None
    step_s: float | None
    mtbf_s: float
    next_step: int
    reason: str
    failures: int = 0
    elapsed_s: float = 0.0


@dataclass
class Schedule:
    """When checkpoints are due. Fixed (every ``every`` steps) or automatic (Young/Daly).

    Every field but ``every`` and ``mtbf_s`` is agreed state: identical on all
    members of a generation, carried in heal and checkpoint meta (`to_json`).
    Local and pure apart from its own fields; called on the training thread.
    """

    every: int
    mtbf_s: float | None
    last: int | None = None
    """Committed count of the last checkpoint that was due."""
    next: int | None = None
    """Automatic mode: the committed count at which the next one is due (None: not chosen)."""
    cost_s: float | None = None
    """Agreed blocking save cost: the members' mean of their last measured one."""
    step_s: float | None = None
    """Agreed step time: the members' mean of their last step's duration, smoothed
    (exponential moving average, weight 0.2 for the newest step)."""
    interval_steps: int | None = None
    """Automatic mode: the interval last chosen, in steps."""
    elapsed_s: float = 0.0
    """Agreed training time so far: per committed step, the members' mean time
    since their previous commit (recoveries included; carried over resumes)."""
    failures: int = 0
    """Agreed count of failures observed: committed steps that were the first
    after a generation was re-formed because of a failure."""

    _AGREED = ("last", "next", "cost_s", "step_s", "interval_steps", "elapsed_s", "failures")

    @property
    def automatic(self) -> bool:
        return self.mtbf_s is not None

    @property
    def periodic(self) -> bool:
        return self.every > 0 or self.automatic

    def due(self, n: int, *, final: bool = False) -> bool:
        """Is a checkpoint due at committed count ``n``? Same answer on every member.

        ``final``: ``n`` is the job's last step. A periodic schedule always takes
        one there (the trained state, what `elastrain export` and a rerun read);
        with no periodic checkpoints (``every`` 0, no MTBF) none is due."""
        if n <= 0:
            return False
        if final and self.periodic:
            return True
        if not self.automatic:
            return self.every > 0 and n % self.every == 0
        return self.next is not None and n >= self.next

    def absorb(self, values: list[float]) -> None:
        """Take the all-reduced `CONTRIB_SLOTS` values of the step just committed."""
        cost_sum, cost_n, step_sum, step_n, since_sum, since_n, failed = values
        if round(since_n) >= 1:
            self.elapsed_s += since_sum / round(since_n)
        if failed >= 0.5:
            self.failures += 1
        if round(cost_n) >= 1:
            self.cost_s = cost_sum / round(cost_n)
        if round(step_n) >= 1:
            mean = step_sum / round(step_n)
            # Smoothed (one step is noisy); every member computes the same from the same input.
            self.step_s = mean if self.step_s is None else 0.8 * self.step_s + 0.2 * mean

    def mtbf_estimate(self) -> float | None:
        """The MTBF the interval uses: the user's value as a prior worth one
        failure, updated with what this job observed (the mean of an
        exponential's gamma posterior): (given + elapsed) / (1 + failures).
        A job that runs long without failing trusts a longer MTBF; one that
        fails often, a shorter one."""
        if self.mtbf_s is None:
            return None
        return (self.mtbf_s + self.elapsed_s) / (1 + self.failures)

    def _mtbf_why(self, mtbf: float) -> str:
        assert self.mtbf_s is not None
        return (
            f"MTBF {mtbf:.4g} s = (given {self.mtbf_s:g} s + {self.elapsed_s:.4g} s trained) / "
            f"(1 + {self.failures} failure(s) observed)"
        )

    def plan(self, n: int) -> IntervalChoice | None:
        """Automatic mode: choose the next checkpoint if none is chosen; returns the
        choice when the interval changed (or on the first one), else None."""
        mtbf = self.mtbf_estimate()
        if mtbf is None or self.next is not None:
            return None
        if self.cost_s is None or not self.step_s:
            self.next = max(n, self.every or 1)
            if self.interval_steps is not None:
                return None
            self.interval_steps = 0
            return IntervalChoice(
                0,
                None,
                self.cost_s,
                self.step_s,
                mtbf,
                self.next,
                f"no save cost measured yet: the first checkpoint, at step {self.next}, "
                "measures it",
                self.failures,
                self.elapsed_s,
            )
        cost = max(self.cost_s, 1e-6)
        try:
            interval_s = young_daly_interval(mtbf, cost)
            why = (
                f"Young/Daly sqrt(2 x MTBF {mtbf:.4g} s x blocking save cost "
                f"{cost:.4g} s) = {interval_s:.3g} s"
            )
        except ValueError:
            interval_s = mtbf
            why = (
                f"blocking save cost {cost:.4g} s is not much below MTBF {mtbf:.4g} s "
                "(Young/Daly does not apply): one checkpoint per MTBF"
            )
        why += f"; {self._mtbf_why(mtbf)}"
        k = max(1, round(interval_s / self.step_s))
        why += f" = {k} steps of {self.step_s:.4g} s"
        self.next = max(n, (self.last or 0) + k)
        changed = k != self.interval_steps
        self.interval_steps = k
        if not changed:
            return None
        return IntervalChoice(
            k, interval_s, cost, self.step_s, mtbf, self.next, why, self.failures, self.elapsed_s
        )

    def taken(self, n: int) -> None:
        """Record that the checkpoint at ``n`` was due (whatever happened to the writes)."""
        self.last = n
        if self.automatic:
            self.next = None

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._AGREED}

    def load_json(self, d: dict[str, Any] | None) -> None:
        if not d:
            return
        for k in self._AGREED:
            if k in d:
                setattr(self, k, d[k])

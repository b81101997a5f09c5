"""A sharded step between the twins' reduction and the optimizer step.

What the replicated trainer does there (`elastrain.runtime.update`,
`TorchBackend.apply`): the mean gradient rounded to the parameters' dtype,
unscaled by a `torch.amp.GradScaler`, its global L2 norm, clipping to
`TrainerConfig.max_grad_norm`, the non-finite skip, the script's
``before_step`` hook, the optimizer step and the scaler's update. A sharded
member holds only its shard's rows of the gradient, so the two things that
need the whole gradient, the norm and "is some element inf or nan?", are
reduced; everything else is elementwise on the rows and done as the
replicated member does it, with the same kernels.

The reduced vector (`NormRows`), float64, all-reduced (SUM) over the whole
generation before the commit vote:

    slot 0      the count of non-finite elements of the (unscaled) mean gradient
    slots 1...  one per row (dim-0 slice) of every trainable parameter, in the
                model's order: the sum of that row's squares (`update.row_squares`)

Each shard's slots are written by exactly one member, the first of its twins
in the layout (twins hold the same reduced gradient); every other member
writes zeros there. Adding zeros is exact, so every member of the generation,
shadows included, ends with the same vector whatever the all-reduce's order:
the row sums the replicated member computes from the whole gradient. The norm
is then `update.norm_of_rows` of it, bit for bit the replicated norm, the same
whatever the layout (2 x 2, 1 x 3 after a reshard, a shadow), and so is every
decision taken from it.

Why a collective of its own before the vote, and not slots in the vote: a
member that loses the vote's answer applies the step later from what it kept
(`ShardedMember.keep`). Any member that committed a step passed the vote, which
every member entered only after its norm reduction completed; so a member told
to roll a step forward holds that step's vector too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from elastrain.runtime.backend import SkipReason, Update
from elastrain.runtime.update import (
    BeforeStep,
    Decision,
    StepGrads,
    clip,
    norm_of_rows,
    row_count,
    row_squares,
)


@dataclass(frozen=True)
class Reduced:
    """A step's reduced state on one member, everything `StepFinish.finish` needs."""

    grads: dict[str, torch.Tensor]
    """The mean gradient of each trainable shard parameter, in its dtype (unscaled)."""
    vector: torch.Tensor
    """The generation's all-reduced `NormRows` vector."""


class NormRows:
    """Where each trainable parameter's rows sit in the reduced vector (slot 0: the
    non-finite count). The same on every member: it depends on the model's
    shapes and which parameters train, never on the layout."""

    def __init__(self, names: Iterable[str], rows: dict[str, int]) -> None:
        self.offsets: dict[str, int] = {}
        at = 1
        for n in names:
            self.offsets[n] = at
            at += rows[n]
        self.size = at

    def fill(
        self,
        out: torch.Tensor,
        grads: dict[str, torch.Tensor],
        first_row: dict[str, int],
        scratch: torch.Tensor | None,
    ) -> torch.Tensor | None:
        """Write this member's rows' sums of squares (``grads``: name -> its rows of
        the mean gradient, starting at global row ``first_row[name]``) and its
        non-finite count into ``out`` (zeroed, `size` float64 slots). Returns the
        scratch used."""
        views = []
        for n, g in grads.items():
            lo = self.offsets[n] + first_row[n]
            views.append(out[lo : lo + row_count(g)])
        scratch = row_squares(list(grads.values()), views, scratch)
        bad = 0
        # Every row sum finite means every element is (inf and nan propagate); a
        # non-finite sum may also be a float64 overflow: count what is really bad.
        if not bool(torch.isfinite(out[1:]).all()):
            bad = sum(int((~torch.isfinite(g)).sum()) for g in grads.values())
        out[0] = float(bad)
        return scratch


def norm_and_finite(vector: torch.Tensor) -> tuple[float, bool]:
    """The global norm and whether every gradient element is finite, from the
    reduced vector (`NormRows`)."""
    return norm_of_rows(vector[1:]), float(vector[0]) == 0.0


class StepFinish:
    """What a sharded member does with a step's reduced gradient: one per backend,
    chosen once from the config (its clipping, scaler and hook).

    Contract: every member calls `unscale` then (after the generation's reduction
    of the `NormRows` vector) `finish`, with inputs that are bit-identical on
    twins; `finish` decides only from the reduced vector, so every member of the
    generation decides alike, and twins update alike."""

    def __init__(
        self,
        max_grad_norm: float | None,
        grad_scaler: torch.amp.GradScaler | None,
        before_step: BeforeStep | None,
        step_index: Callable[[], int] | None,
    ) -> None:
        self.max_grad_norm = max_grad_norm
        self.scaler = grad_scaler if grad_scaler is not None and grad_scaler.is_enabled() else None
        self.before_step = before_step
        self.step_index = step_index
        if before_step is not None and step_index is None:
            raise ValueError("before_step needs the step index (step_index)")

    def ready_scale(self) -> None:
        """The scaler makes its scale tensor at its first use: a member that computes
        no micro-batch of a step (a shadow, a padding turn) must have it too."""
        if self.scaler is not None:
            self.scaler.scale(torch.zeros(()))

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, grads: list[torch.Tensor]) -> None:
        """Unscale the mean gradient in place, before its norm is taken: the kernel
        and the inverse scale ``GradScaler.unscale_`` uses (the scale's float64
        reciprocal, rounded to float32), so the rows equal the replicated
        member's. Its found-inf is not used: the reduced vector's count is."""
        scaler = self.scaler
        if scaler is None or not grads:
            return
        scale = scaler.get_scale()
        inv = torch.full((), scale, dtype=torch.float64).reciprocal().float()
        found = torch.zeros((), dtype=torch.float32)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for group in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)

    def finish(
        self,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        vector: torch.Tensor,
        step: int | None = None,
    ) -> Update:
        """The replicated member's decisions, from the reduced vector: clip, the
        non-finite skip, the hook, the optimizer step (or not), the scaler's
        update. ``params``: the trainable shard parameters, their ``.grad`` the
        unscaled mean gradient. ``step``: the step's index where it is not the
        committed count (a kept step applied after the count moved on)."""
        norm, finite = norm_and_finite(vector)
        skipped = None if finite else SkipReason.NONFINITE
        clipped = False
        if skipped is None and self.max_grad_norm is not None:
            clipped = clip(params, self.max_grad_norm, norm)
        if self.before_step is not None:
            assert self.step_index is not None
            decision = self.before_step(
                StepGrads(
                    self.step_index() if step is None else step,
                    norm,
                    finite,
                    clipped,
                    params,
                    optimizer,
                )
            )
            if skipped is None and decision == Decision.SKIP:
                skipped = SkipReason.HOOK
        scaler = self.scaler
        if scaler is not None:
            _record_found_inf(scaler, optimizer, not finite)
        if skipped is None:
            if scaler is not None:
                scaler.step(optimizer)
            else:
                optimizer.step()
        if scaler is not None:
            # Backs off after an overflow anywhere in the model, grows after enough good
            # steps: the same on every member, which all read the same count.
            scaler.update()
        return Update(norm, skipped)


def _record_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, found: bool
) -> None:
    """Tell ``scaler`` that ``optimizer``'s gradient was unscaled and whether it held
    an inf or nan anywhere in the model (not only in this member's rows).

    GradScaler has no public way to take a found-inf computed elsewhere; this
    fills the per-optimizer record its ``unscale_`` would (the stage and one
    found-inf tensor), as torch's own sharded scalers do with a reduced one.
    ``step`` then skips on it and ``update`` backs off on it."""
    from torch.amp.grad_scaler import OptState

    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"] is not OptState.READY:
        raise RuntimeError(f"the scaler's record of this step is {state['stage']}, not READY")
    scale = scaler._scale
    assert scale is not None, "ready_scale() first"
    state["stage"] = OptState.UNSCALED
    state["found_inf_per_device"] = {
        scale.device: torch.full(
            (), 1.0 if found else 0.0, dtype=torch.float32, device=scale.device
        )
    }

"""Between the reduced gradient and the optimizer step: what a real loop does there.

Who calls: `TorchBackend.apply` on the training thread of every member, once
per committed step, after the step's all-reduce completed and the summed
gradient was divided by the global batch. The distributed contract: every
input here is bit-identical on every member (the reduced gradient, the
parameters, the optimizer, the registered objects, the step index), and every
function here is a deterministic function of those inputs alone (no rank, no
clock, no thread count), so every member takes the same decisions and makes
the same update without a word to the others:

- `grad_norm`: the global L2 norm of the mean gradient, in float64, by a
  reduction whose order is fixed by the model's layout alone;
- clipping to `TrainerConfig.max_grad_norm` with torch's own
  `clip_grads_with_norm_` (what `clip_grad_norm_` does, given that norm);
- a non-finite gradient is never applied: the step commits as skipped;
- the user's `before_step` hook (`BeforeStep`), under the same contract;
- `scheduler_problems`: an LR scheduler over the trainer's optimizer that the
  script did not register (it would not travel to a replacement, whose learning
  rate would then differ from its peers' without any hash noticing).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import torch

from elastrain.transfer.flatten import Stateful

NORM_CHUNK = 4096
"""Elements summed in order by one row of the norm's reduction (see `grad_norm`)."""


class Decision(StrEnum):
    """What a `before_step` hook decides for the step (None means APPLY)."""

    APPLY = "apply"
    SKIP = "skip"
    """Do not update: the step still commits (its samples are consumed) as skipped."""


@dataclass(frozen=True)
class StepGrads:
    """What a `before_step` hook is given: the same on every member."""

    step: int
    """0-based index of the step about to be applied."""
    grad_norm: float
    """Global L2 norm of the mean gradient (after unscaling, before clipping)."""
    finite: bool
    """False when some gradient element is inf or nan (the step is skipped
    whatever the hook returns)."""
    clipped: bool
    """The gradient was scaled down to `TrainerConfig.max_grad_norm`."""
    params: list[torch.nn.Parameter]
    """The parameters the optimizer updates; their ``.grad`` holds the mean gradient."""
    optimizer: torch.optim.Optimizer


BeforeStep = Callable[[StepGrads], Decision | None]
"""The user's hook after the gradient is reduced and before the optimizer step.

Contract: called on every member, by the training thread, once per committed
step (never for a step that is abandoned), after clipping. It must decide
from its inputs only (`StepGrads`, the model, the optimizer, the registered
objects): no rank, clock, file or unseeded randomness, so that every member
decides the same. It may change ``.grad`` in place, the optimizer's
param_groups and the registered objects; whatever else it keeps across steps
must be registered (`ElasticTrainer.register`) or a replacement will not have
it. Returning `Decision.SKIP` skips the update on every member."""


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of the concatenation of ``grads``, in float64, bit-identical on
    every member whatever its intra-op thread count or vector width.

    torch's own reductions (``vector_norm``, ``sum``) split work by thread count
    and SIMD width, so two members holding the same gradient could get norms
    differing in the last bit, clip by different factors and drift apart.
    Here each element is squared in float64 and the squares are summed strictly
    in order within rows of `NORM_CHUNK` (``cumsum`` is a sequential scan per
    row; rows run in parallel, each whole on one thread), then the row sums
    likewise, until one value is left: the order depends only on the layout.
    """
    sums = [_ordered_sum(g.detach().reshape(-1).to(torch.float64).square()) for g in grads]
    if not sums:
        return 0.0
    return float(_ordered_sum(torch.stack(sums)).sqrt())


def _ordered_sum(v: torch.Tensor) -> torch.Tensor:
    if v.numel() == 0:
        return torch.zeros((), dtype=torch.float64)
    while v.numel() > 1:
        pad = (-v.numel()) % NORM_CHUNK
        if pad:
            v = torch.cat([v, v.new_zeros(pad)])
        v = v.view(-1, NORM_CHUNK).cumsum(dim=1)[:, -1].contiguous()
    return v.reshape(())


def all_finite(grads: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads)


def clip(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> bool:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), torch's rule; True
    if that scaled them down."""
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm, dtype=torch.float64))
    return max_norm / (norm + 1e-6) < 1.0


# ---- schedulers the script did not register ----------------------------------------


def _schedulers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.lr_scheduler.LRScheduler]:
    """The LR schedulers over ``optimizer`` that are alive: the optimizer's referrers
    that are schedulers holding it as ``.optimizer`` (one scan of the heap, ~25 ms
    here, once per worker at start). The flag torch's schedulers leave on
    ``optimizer.step`` (``_wrapped_by_lr_sched``) would be cheaper but says too
    little: `ReduceLROnPlateau` does not set it, and it outlives a scheduler that
    was dropped. tests/test_loop.py checks that the scan sees each kind."""
    lr_scheduler = torch.optim.lr_scheduler.LRScheduler
    return [
        r
        for r in gc.get_referrers(optimizer)
        if isinstance(r, lr_scheduler) and getattr(r, "optimizer", None) is optimizer
    ]


def _carried(objects: Mapping[str, Stateful]) -> set[int]:
    """ids of the schedulers whose state travels: the registered ones and those a
    registered `SequentialLR`/`ChainedScheduler` holds (their state dicts carry
    their children's)."""
    out: set[int] = set()
    todo = list(objects.values())
    while todo:
        obj = todo.pop()
        if id(obj) in out:
            continue
        out.add(id(obj))
        todo.extend(getattr(obj, "_schedulers", []))
    return out


def scheduler_problems(
    optimizer: torch.optim.Optimizer, objects: Mapping[str, Stateful]
) -> list[str]:
    """A problem for each LR scheduler over ``optimizer`` whose state would not travel.

    A scheduler's state (its step count) decides the learning rate of every
    later step, so one that the trainer does not carry leaves a healed
    replacement, or a resumed job, on another learning rate than its peers.
    """
    carried = _carried(objects)
    return [
        _unregistered(type(s).__name__) for s in _schedulers_of(optimizer) if id(s) not in carried
    ]


def _unregistered(what: str) -> str:
    return (
        f"{what} steps the trainer's optimizer but is not registered with the trainer: its "
        "state would not travel to a replacement or into checkpoints, and the replacement "
        "would train with another learning rate than its peers. Register it before the loop, "
        'e.g. `trainer.register("sched", sched)`, and step it after each step the trainer '
        "yields (`for result in trainer.steps(): sched.step()`)"
    )

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
  reduction whose order is fixed by the parameters' shapes alone (row by row,
  so that a sharded member's rows give the same bits, `row_squares`);
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

NORM_CHUNK = 1 << 20
"""Elements squared at a time by `row_squares` (8 MiB of float64 scratch): whole rows
of a gradient, at least one. Not part of the norm's definition (rows are summed
alone, so how many are squared together changes no bit)."""


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


def grad_norm(grads: list[torch.Tensor], scratch: torch.Tensor | None = None) -> float:
    """The L2 norm of ``grads`` (each parameter's gradient, in the model's order),
    in float64, bit-identical on every member whatever its intra-op thread count
    or vector width, and whatever rows of the gradient it holds.

    torch's own reductions (``vector_norm``, ``sum``) split work by thread count
    and SIMD width, so two members holding the same gradient could get norms
    differing in the last bit, clip by different factors and drift apart.
    Here the norm is defined on rows (a gradient's dim-0 slices; a 0-dim or 1-D
    gradient's elements): each row's squares (float64: exact for float32,
    bfloat16 and float16) are summed by a pairwise tree of elementwise additions
    (`row_squares`), and the rows' sums, every parameter's in turn, by another
    (`norm_of_rows`). An elementwise addition rounds the same however torch
    splits or vectorises it, and the trees' shapes depend on the shapes alone.
    Because a row is summed alone, a sharded member that holds some rows of every
    parameter computes those rows' sums bit-identical to the replicated member
    that holds them all: the sharded trainer gathers the rows' sums in this
    order and gets this norm, bit for bit (`elastrain.runtime.shard_step`).

    ``scratch``: a float64 tensor of at least `NORM_CHUNK` elements (or of the
    widest row) to work in, overwritten; without one, a buffer is allocated
    per call (a fresh one is page-faulted in on every call: ~0.6 ms per 10 MB
    here, more than the sum itself).
    """
    rows = torch.empty(
        sum(row_count(g) for g in grads),
        dtype=torch.float64,
        device=grads[0].device if grads else torch.device("cpu"),
    )
    outs, at = [], 0
    for g in grads:
        outs.append(rows[at : at + row_count(g)])
        at += row_count(g)
    row_squares(grads, outs, scratch)
    return norm_of_rows(rows)


def row_count(g: torch.Tensor) -> int:
    """The rows `grad_norm` sums ``g`` in: its dim-0 size (a 0-dim tensor: one)."""
    return g.shape[0] if g.dim() else 1


def row_squares(
    grads: list[torch.Tensor], outs: list[torch.Tensor], scratch: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``outs[k][i]`` = the sum of the squares of row ``i`` of ``grads[k]`` (float64,
    a pairwise tree across the row, `_tree_rows`), for `grad_norm`.

    Rows of the same width, from any of the gradients, are squared and summed
    together, up to `NORM_CHUNK` elements at a time: a model's hundred
    parameters cost a few passes per width, not a dozen small ops each (the
    Python and dispatch overhead was most of the cost). A row's sum is the same
    bits whatever it is batched with. Works in ``scratch`` (float64, grown if
    too small or absent); returns the scratch it used."""
    by_width: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for g, out in zip(grads, outs, strict=True):
        rows = row_count(g)
        if rows == 0:
            continue
        flat = g.detach().reshape(rows, -1)
        if flat.shape[1] == 0:
            out.zero_()
            continue
        by_width.setdefault(flat.shape[1], []).append((flat, out))
    for width, items in by_width.items():
        step = max(1, NORM_CHUNK // width)
        need = min(step, sum(f.shape[0] for f, _ in items)) * width
        if (
            scratch is None
            or scratch.dtype != torch.float64
            or scratch.device != items[0][0].device
            or scratch.numel() < need
        ):
            scratch = torch.empty(need, dtype=torch.float64, device=items[0][0].device)
        batch: list[tuple[torch.Tensor, torch.Tensor]] = []
        filled = 0
        for flat, out in items:
            at = 0
            while at < flat.shape[0]:
                take = min(flat.shape[0] - at, step - filled)
                batch.append((flat[at : at + take], out[at : at + take]))
                filled += take
                at += take
                if filled == step:
                    _square_rows(batch, scratch, width)
                    batch, filled = [], 0
        if batch:
            _square_rows(batch, scratch, width)
    return scratch


def _square_rows(
    batch: list[tuple[torch.Tensor, torch.Tensor]], scratch: torch.Tensor, width: int
) -> None:
    """Each row's sum of squares of the pieces in ``batch`` (rows of ``width``), into
    their outputs: copied into ``scratch`` in float64, squared, summed by one tree."""
    n = sum(src.shape[0] for src, _ in batch)
    x = scratch[: n * width].view(n, width)
    at = 0
    for src, _ in batch:
        x[at : at + src.shape[0]].copy_(src)
        at += src.shape[0]
    x.square_()
    sums = _tree_rows(x)
    at = 0
    for src, out in batch:
        out.copy_(sums[at : at + src.shape[0]])
        at += src.shape[0]


def norm_of_rows(rows: torch.Tensor) -> float:
    """The norm from the rows' sums of squares (`row_squares`, every trainable
    parameter's rows in the model's order): the square root of their pairwise
    tree sum. ``rows`` is left as it was."""
    if rows.numel() == 0:
        return 0.0
    return float(_tree_sum(rows.clone()).sqrt())


def _tree_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's sum of 2-D ``x`` (destroyed): while a row has n > 1 columns, add
    the last n // 2 columns elementwise into the first n // 2. Returns a view of
    column 0."""
    n = x.shape[1]
    while n > 1:
        h = n // 2
        x[:, :h].add_(x[:, n - h : n])
        n -= h
    return x[:, 0]


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """The sum of 1-D ``x`` (destroyed): while n > 1, add the last n // 2 elements
    elementwise into the first n // 2 (an odd middle element waits for the next
    level). Returns a 0-d view of ``x``."""
    n = x.numel()
    if n == 0:
        return torch.zeros((), dtype=x.dtype, device=x.device)
    while n > 1:
        h = n // 2
        x[:h].add_(x[n - h : n])
        n -= h
    return x[0]


def all_finite(grads: list[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(g).all()) for g in grads)


def clip(params: list[torch.nn.Parameter], max_norm: float, norm: float) -> bool:
    """Scale the gradients by min(1, max_norm / (norm + 1e-6)), torch's rule; True
    if that scaled them down."""
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, torch.tensor(norm, dtype=torch.float64))
    return max_norm / (norm + 1e-6) < 1.0


# ---- schedulers the script did not register ----------------------------------------


def schedulers_of(optimizer: torch.optim.Optimizer) -> list[torch.optim.lr_scheduler.LRScheduler]:
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
    optimizer: torch.optim.Optimizer,
    objects: Mapping[str, Stateful],
    *,
    script_carries: bool = False,
) -> list[str]:
    """A problem for each LR scheduler over ``optimizer`` whose state would not travel.

    A scheduler's state (its step count) decides the learning rate of every
    later step, so one that the trainer does not carry leaves a healed
    replacement, or a resumed job, on another learning rate than its peers.
    ``script_carries``: the script passed ``extra_state=`` and
    ``load_extra_state=`` (the older API, whose JSON a heal and a checkpoint
    carry): what they hold cannot be seen from here, so its schedulers count as
    carried by it, and none is a problem.
    """
    if script_carries:
        return []
    carried = _carried(objects)
    return [
        _unregistered(type(s).__name__) for s in schedulers_of(optimizer) if id(s) not in carried
    ]


def _unregistered(what: str) -> str:
    return (
        f"{what} steps the trainer's optimizer but is not registered with the trainer: its "
        "state would not travel to a replacement or into checkpoints, and the replacement "
        "would train with another learning rate than its peers. Register it before the loop, "
        'e.g. `trainer.register("sched", sched)`, and step it after each step the trainer '
        "yields (`for result in trainer.steps(): sched.step()`)"
    )

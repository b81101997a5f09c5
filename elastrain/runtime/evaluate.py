"""Evaluation that fits the step protocol: the pure parts.

An evaluation is a phase of the protocol (`Phase.EVALUATE`), not user code
between steps: every member of a generation runs it after the same committed
step, so no member waits for another in a collective while the other
evaluates, and a membership change during it is a regroup like any other,
after which the new generation evaluates again. What it computes does not
depend on who computed it:

- the eval set is cut into fixed batches, positions [b*B, (b+1)*B) of the
  dataset in its own order (`eval_batches`): the batches do not depend on the
  membership;
- a generation's members take balanced contiguous blocks of batches
  (`assign_microbatches`), each batch computed by exactly one member, with an
  RNG seeded by (seed, committed count, batch);
- each member fills the rows of its batches in a [batches x metrics] float64
  table (`EvalTable`), zeros elsewhere; one SUM all-reduce adds each row to
  zeros (exact), so every member holds every batch's sums bit for bit;
- every member adds the rows up with `math.fsum` (`EvalTable.reduce`): the
  correctly rounded sum of the per-batch values, which depends on those values
  alone, not on their order or on how the batches were spread.

So the result is as exact as the forward pass: the same model on the same
batch gives the same per-batch sums on any member (same build, same thread
count), and nothing else enters. 2 or 3 members, or a redo on survivors, give
the same bits.

The engine's `BetweenSteps.evaluate` (`elastrain.runtime.between`) is the I/O
around these: the table's all-reduce and the waits. `hand_over` is the one
piece of I/O here: the collectives that give a result some member already has
to all, run through the engine's wait.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from elastrain.data import assign_microbatches

SAMPLES = "samples"
"""The table's own column: the samples of each batch (checks that every batch was
computed exactly once), also `EvalResult.samples`. A metric may not take this name."""

EvalFn = Callable[[Any, Any], Mapping[str, Any]]
"""The user's evaluation of one batch: ``eval_fn(model, batch) -> {name: sum}``.

Contract: returns *sums* over the batch's samples (a loss summed, not averaged;
a count of correct answers), as Python numbers or one-element tensors, always
the same names; it is called under ``torch.no_grad()`` with the model in eval
mode, on every member, for the batches that member was given. It must not
change the model or any state that travels (it runs on some members only)."""


class EvalProblem(ValueError):
    """The script's evaluation is wrong in a way no regroup mends (different metric
    names on different members or batches, a value that is not a number)."""


@dataclass(frozen=True)
class Evaluation:
    """What `ElasticTrainer.evaluate_every` sets up: when, on what, and how to compute."""

    every: int
    """Evaluate after every `every` committed steps (and after the last one)."""
    batch_size: int
    """Samples per evaluation batch (the last batch may be shorter)."""
    size: int
    """Samples in the eval set (`len(dataset)`, taken once)."""
    load: Callable[[range], Any]
    """The batch at these dataset positions (the dataset indexed and collated)."""
    compute: Callable[[int, int, Any], Mapping[str, Any]]
    """``compute(committed, batch_index, batch)``: the user's function run the
    framework's way (no grad, eval mode, seeded RNG)."""

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError(f"evaluate every {self.every} steps: need at least 1")
        if self.batch_size < 1:
            raise ValueError(f"evaluation batch_size must be at least 1, got {self.batch_size}")
        if self.size < 1:
            raise ValueError("the evaluation dataset is empty")

    def batches(self) -> list[range]:
        return eval_batches(self.size, self.batch_size)


def eval_due(committed: int, every: int, total_steps: int) -> bool:
    """Whether the model after `committed` steps is evaluated: after every `every`
    steps and after the last one; never before the first (`every` 0: never)."""
    if every <= 0 or committed <= 0:
        return False
    return committed % every == 0 or committed == total_steps


def eval_seed(seed: int, committed: int, batch: int) -> int:
    """The RNG seed of one evaluation batch: (job seed, committed count, batch) only,
    so a model that draws in eval mode draws the same whoever computes the batch."""
    return (seed * 0x9E3779B1 + 0x5EED + committed * 1_000_003 + batch * 7919) & 0x7FFF_FFFF_FFFF


def eval_batches(size: int, batch_size: int) -> list[range]:
    """The eval set's batches as dataset positions, fixed by `size` and `batch_size`
    alone (the same whoever computes them)."""
    return [range(lo, min(lo + batch_size, size)) for lo in range(0, size, batch_size)]


@dataclass(frozen=True)
class EvalShare:
    """One member's part of an evaluation, as its layout decides (`Topology.eval_share`).

    Contract: every batch is run by the members of exactly one runner (a
    replicated member, or a whole replica group whose members run the same
    batches together), and exactly one member reports each batch's sums."""

    batches: list[int]
    """The batches this member runs, in order."""
    reports: bool
    """It fills the table's rows of its batches (the others of its group leave zeros)."""
    names_shared: bool
    """Some member of the generation runs nothing (a shadow): the metric names are
    agreed by a collective after the batches, not learned from batch 0. The same
    on every member of the generation."""
    collectives_inside: bool
    """The forward runs collectives (FSDP2): a failed one aborts the evaluation, and
    no member asks "superseded?" between batches (members of a group that answered
    differently would wait on each other)."""


def my_batches(num_batches: int, members: int, rank: int) -> list[int]:
    """The batch indices `rank` of `members` computes: balanced contiguous blocks;
    every batch goes to exactly one member."""
    return assign_microbatches(num_batches, members, rank)


def eval_wait_timeout(own_s: float, step_timeout_s: float, multiplier: float) -> float:
    """How long a member that finished its share waits for its peers' shares.

    Not the step watchdog's timeout (the slowest recent all-reduce wait times
    its multiplier, a few seconds): an evaluation may run for minutes. A peer's
    share is at most one batch larger than this member's, so a healthy peer
    needs about as long as this member did; `multiplier` times that, on top of
    the step timeout, leaves room for a slower machine. A peer stopped or dead
    is caught sooner, by the coordinator's lease (the generation breaks and the
    wait ends at once); this bound catches a peer hung with its heartbeat alive.
    """
    return step_timeout_s + multiplier * max(own_s, 0.0)


def idle_wait_timeout(num_batches: int, ceiling_s: float) -> float:
    """How long a member that runs none of an evaluation's batches (a sharded
    generation's shadow, while the complete replica groups run all of them) waits
    for the runners. It has no time of its own to scale (`eval_wait_timeout`), and
    the runners' share is all the batches, so: the watchdog's ceiling per batch.
    A runner that dies or stops is caught sooner, by the coordinator's lease, and a
    runner hung with its heartbeat alive by its group-mates' collective timeouts
    (the generation breaks and this wait ends at once); this bound is for a whole
    group hung at once."""
    return ceiling_s * max(1, num_batches)


def pause_timeout(
    own_s: float, step_timeout_s: float, multiplier: float, ceiling_s: float
) -> float:
    """How long a member that ended its `trainer.pause()` waits for its peers to end
    theirs, unless the script says: as an evaluation's wait, but at least the
    watchdog's ceiling, because work one member does for all (the leader saving
    samples) leaves the others no time of their own to scale."""
    return max(ceiling_s, eval_wait_timeout(own_s, step_timeout_s, multiplier))


def as_number(name: str, value: Any) -> float:
    """One metric value as a float64 (exact for float32, float64 and ints below 2**53)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EvalProblem(
                f"evaluation metric {name!r} is a tensor of {value.numel()} elements: "
                "return one number per metric (a sum over the batch)"
            )
        return float(value.detach().reshape(()).to(torch.float64))
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvalProblem(
            f"evaluation metric {name!r} is a {type(value).__name__}: return numbers "
            "or one-element tensors"
        )
    return float(value)


def metric_values(out: Any) -> dict[str, float]:
    """The user's return value for one batch, checked, as name -> float64."""
    if not isinstance(out, Mapping) or not out:
        raise EvalProblem(
            "the evaluation function must return a non-empty dict {metric name: sum over the "
            f"batch}}, got {type(out).__name__}"
        )
    values: dict[str, float] = {}
    for name, v in out.items():
        if not isinstance(name, str) or not name:
            raise EvalProblem(f"evaluation metric names are non-empty strings, got {name!r}")
        if name == SAMPLES:
            raise EvalProblem(
                f"{SAMPLES!r} is the evaluation's own count: name the metric otherwise"
            )
        values[name] = as_number(name, v)
    return values


def names_check(names: tuple[str, ...]) -> float:
    """A fingerprint of the metric names (CRC-32, exact in float64) that rides in each row,
    so that members disagreeing on the names is an error, not a wrong sum."""
    return float(zlib.crc32("\0".join(names).encode()))


@dataclass
class EvalTable:
    """One member's rows of the [batches x (metrics, samples, check)] float64 table.

    Rows of batches another member computes stay zero; after the SUM all-reduce
    every row holds its batch's values exactly (a value plus zeros)."""

    names: tuple[str, ...]
    batches: list[range]
    table: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.table = torch.zeros(len(self.batches), len(self.names) + 2, dtype=torch.float64)

    def fill(self, batch: int, values: Mapping[str, float]) -> None:
        if tuple(sorted(values)) != self.names:
            raise EvalProblem(
                f"evaluation batch {batch} returned metrics {sorted(values)}, earlier batches "
                f"{list(self.names)}: return the same names for every batch"
            )
        row = [values[n] for n in self.names]
        row += [float(len(self.batches[batch])), names_check(self.names)]
        self.table[batch] = torch.tensor(row, dtype=torch.float64)

    def reduce(self) -> tuple[dict[str, float], int] | str:
        """After the all-reduce: (sums, samples), or what is wrong with the table
        (a batch computed by no member or by two: the members disagreed on the
        generation, so the evaluation is redone in the next one)."""
        k = len(self.names)
        rows = self.table.tolist()
        check = names_check(self.names)
        for b, row in enumerate(rows):
            if row[k] != len(self.batches[b]):
                return f"evaluation batch {b} counted {row[k]:g} samples, expected {len(self.batches[b])}"
            if row[k + 1] != check:
                raise EvalProblem(
                    f"evaluation batch {b}: the members returned different metric names "
                    f"(this member: {list(self.names)}): return the same names on every member"
                )
        sums = {n: math.fsum(row[j] for row in rows) for j, n in enumerate(self.names)}
        return sums, sum(len(r) for r in self.batches)


@dataclass(frozen=True)
class EvalResult:
    """The evaluation of the model after `step` committed steps; the same on every member."""

    step: int
    """Committed steps the evaluated model had (a `StepResult.step` + 1)."""
    sums: dict[str, float]
    """Each metric summed over the whole eval set, in float64."""
    samples: int
    """Samples in the eval set."""

    @property
    def means(self) -> dict[str, float]:
        """Each metric per sample (sums / samples)."""
        return {n: v / self.samples for n, v in self.sums.items()}

    def to_json(self) -> dict[str, Any]:
        # json writes a float as its repr, which reads back bit for bit (nan and inf too).
        return {"step": self.step, "sums": dict(self.sums), "samples": self.samples}

    @classmethod
    def from_json(cls, raw: Any) -> EvalResult | None:
        if not isinstance(raw, dict):
            return None
        return cls(
            int(raw["step"]),
            {str(k): float(v) for k, v in raw["sums"].items()},
            int(raw["samples"]),
        )


# ---- the hand-over ------------------------------------------------------------------

Post = Callable[[list[torch.Tensor]], Any]
"""Posts one collective on the tensors over the generation's group; returns its work."""

Run = Callable[[list[torch.Tensor], Post | None], None]
"""Posts one collective (None: a SUM all-reduce) and waits for it (the engine's
wait: its timeout, the generation breaking); raises if it is given up."""


class HandoverFailed(RuntimeError):
    """The holder's result did not arrive intact (the evaluation is redone)."""


def hand_over(
    pg: Any, run: Run, held: EvalResult | None, n: int, rank: int, size: int
) -> EvalResult | None:
    """The result of count `n` on every member if any member holds it, else None.

    Called by every member of the generation at the start of an evaluation
    (same count, same order of collectives). One MIN all-reduce finds the
    lowest rank holding it; that rank broadcasts its length, then its JSON.
    Every holder holds the same bytes (a completed all-reduce, or a heal or
    checkpoint of one), so which one sends does not matter."""
    import torch.distributed as dist

    holder = torch.tensor([float(rank if held is not None else size)], dtype=torch.float64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    run([holder], lambda t: pg.allreduce(t, opts))
    root = int(holder.item())
    if root >= size:
        return None
    raw = json.dumps(held.to_json()).encode() if held is not None and rank == root else b""
    bopts = dist.BroadcastOptions()
    bopts.rootRank, bopts.rootTensor = root, 0

    def cast(t: list[torch.Tensor]) -> Any:
        return pg.broadcast(t, bopts)

    length = torch.tensor([len(raw)], dtype=torch.int64)
    run([length], cast)
    if rank == root:
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    else:
        buf = torch.empty(int(length.item()), dtype=torch.uint8)
    run([buf], cast)
    try:
        got = EvalResult.from_json(json.loads(bytes(buf.numpy())))
    except (ValueError, KeyError, TypeError) as e:
        raise HandoverFailed(f"unreadable result from rank {root}: {e}") from None
    if got is None or got.step != n:
        raise HandoverFailed(f"rank {root} handed over another count's result")
    return got

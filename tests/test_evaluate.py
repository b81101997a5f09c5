"""Evaluation that fits the step protocol (issue 17): the pure parts in-process
(the split, the exact reduction, the protocol's EVALUATE phase, the waits), and
one job with a member killed in the middle of an evaluation.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.control import protocol as p
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_same_state
from elastrain.runtime import member as m
from elastrain.runtime.config import TrainerConfig, WorkerEnv
from elastrain.runtime.engine import StepEngine
from elastrain.runtime.evaluate import (
    SAMPLES,
    EvalProblem,
    EvalResult,
    EvalTable,
    eval_batches,
    eval_due,
    eval_wait_timeout,
    hand_over,
    idle_wait_timeout,
    metric_values,
    my_batches,
    pause_timeout,
)
from elastrain.runtime.group import build_group

from .conftest import Job
from .test_loop import LOOP, LOOP_ARGS, STEPS, _agree, _records, _same_curve
from .test_protocol import FakeBackend, FakeCoordinator, G, joined, ready

# ---------------------------------------------------------------- the split


def test_batches_are_fixed_by_the_set_and_cover_it_once() -> None:
    batches = eval_batches(203, 16)
    assert [len(b) for b in batches] == [16] * 12 + [11]
    assert [i for b in batches for i in b] == list(range(203))
    for members in (1, 2, 3, 5, 13, 20):
        blocks = [my_batches(len(batches), members, r) for r in range(members)]
        assert sorted(b for blk in blocks for b in blk) == list(range(len(batches)))
        assert all(blk == list(range(blk[0], blk[-1] + 1)) for blk in blocks if blk)
        assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_evaluations_are_due_every_k_steps_and_after_the_last() -> None:
    assert [n for n in range(0, 26) if eval_due(n, 10, 25)] == [10, 20, 25]
    assert not any(eval_due(n, 0, 25) for n in range(26))
    assert [n for n in range(0, 21) if eval_due(n, 10, 20)] == [10, 20]


# ---------------------------------------------------------------- the reduction

# Per-batch values chosen so that the order of float additions matters: summed in
# another grouping (each member's partial sum first, then across members) they give
# other bits; the evaluation's result must not.
VALUES = [1e16, 1.0, -1e16, 3.0, 0.1, 2.5e-8, 7.0, -0.3, 1e-300, 5.0, 1e15, -1e15, 0.7]


def _evaluate_with(members: int) -> tuple[dict[str, float], int]:
    """What `members` members get: each fills its block's rows, the all-reduce adds
    the tables (in rank order, like any order), each reduces."""
    batches = eval_batches(len(VALUES) * 4, 4)
    tables = []
    for r in range(members):
        t = EvalTable(("err", "hits"), batches)
        for b in my_batches(len(batches), members, r):
            t.fill(b, {"hits": float(b % 3), "err": VALUES[b]})
        tables.append(t)
    summed = tables[0].table.clone()
    for t in tables[1:]:
        summed += t.table
    results = []
    for t in tables:
        t.table.copy_(summed)
        got = t.reduce()
        assert not isinstance(got, str), got
        results.append(got)
    assert all(json.dumps(r) == json.dumps(results[0]) for r in results)
    return results[0]


def test_the_result_does_not_depend_on_the_membership() -> None:
    one = _evaluate_with(1)
    for members in (2, 3, 5, 13):
        assert json.dumps(_evaluate_with(members)) == json.dumps(one)
    sums, samples = one
    assert samples == len(VALUES) * 4
    assert sums["err"] == math.fsum(VALUES) and sums["hits"] == sum(b % 3 for b in range(13))

    # The same values summed per member first and then across (what a reduction of
    # each member's own totals would do) give another answer for some membership:
    # the test above would catch a reduction that did that.
    def per_member(members: int) -> float:
        parts = [
            sum(VALUES[b] for b in my_batches(len(VALUES), members, r)) for r in range(members)
        ]
        return sum(parts)

    assert len({per_member(k) for k in (1, 2, 3, 5)}) > 1


def test_a_batch_computed_twice_or_never_is_not_a_result() -> None:
    batches = eval_batches(8, 4)
    a, b = EvalTable(("x",), batches), EvalTable(("x",), batches)
    a.fill(0, {"x": 1.0})
    b.fill(0, {"x": 1.0})  # both think they own batch 0; nobody computed batch 1
    a.table += b.table
    problem = a.reduce()
    assert isinstance(problem, str) and "batch 0 counted 8 samples, expected 4" in problem


def test_members_with_other_metric_names_is_an_error_not_a_sum() -> None:
    batches = eval_batches(8, 4)
    a, b = EvalTable(("loss",), batches), EvalTable(("lost",), batches)
    a.fill(0, {"loss": 1.0})
    b.fill(1, {"lost": 2.0})
    a.table += b.table
    with pytest.raises(EvalProblem, match="different metric names"):
        a.reduce()
    with pytest.raises(EvalProblem, match="same names for every batch"):
        a.fill(1, {"loss": 1.0, "extra": 2.0})


def test_metric_values_are_float64_numbers_with_clear_errors() -> None:
    got = metric_values(
        {"a": torch.tensor(0.1, dtype=torch.float32), "b": 3, "c": torch.tensor([2.5])}
    )
    assert got == {"a": float(torch.tensor(0.1, dtype=torch.float32)), "b": 3.0, "c": 2.5}
    with pytest.raises(EvalProblem, match="3 elements"):
        metric_values({"a": torch.ones(3)})
    with pytest.raises(EvalProblem, match="own count"):
        metric_values({SAMPLES: 1.0})
    with pytest.raises(EvalProblem, match="non-empty dict"):
        metric_values(torch.tensor(1.0))
    with pytest.raises(EvalProblem, match="is a str"):
        metric_values({"a": "1.0"})


def test_a_result_travels_as_json_bit_for_bit() -> None:
    r = EvalResult(30, {"a": 0.1 + 0.2, "b": 5e-324, "c": math.inf, "d": -0.0}, 200)
    back = EvalResult.from_json(json.loads(json.dumps(r.to_json())))
    assert back is not None
    assert {k: v.hex() for k, v in back.sums.items()} == {k: v.hex() for k, v in r.sums.items()}
    assert back.step == 30 and back.samples == 200 and back.means["a"] == r.sums["a"] / 200
    assert EvalResult.from_json(None) is None


# ---------------------------------------------------------------- the hand-over


def _on_group(size: int, body: Callable[[Any, int], Any]) -> list[Any]:
    """``body(pg, rank)`` on each rank of a real gloo group of `size` threads."""
    store = dist.HashStore()
    out: list[Any] = [None] * size
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            pg = build_group(
                store, "ev", rank, size, host="127.0.0.1", connect_timeout_s=20, op_timeout_s=20
            )
            out[rank] = body(pg, rank)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test
            errors.append(e)

    ts = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return out


def _run(pg: Any) -> Callable[..., None]:
    def run(tensors: list[torch.Tensor], post: Any) -> None:
        (post(tensors) if post is not None else pg.allreduce(tensors)).wait()

    return run


def test_a_result_some_member_holds_is_handed_to_all() -> None:
    r = EvalResult(10, {"sq": 0.1 + 0.2, "n_big": 3.0, "tiny": 5e-324}, 200)
    # Ranks 1 and 2 completed the table's all-reduce before their peer lost the
    # generation (or were healed with the result); rank 0 did not.
    held = [None, r, r]
    got = _on_group(3, lambda pg, rank: hand_over(pg, _run(pg), held[rank], 10, rank, 3))
    assert all(g is not None for g in got)
    assert {json.dumps(g.to_json()) for g in got} == {json.dumps(r.to_json())}
    # Nobody holds it: every member computes (None everywhere, no broadcast).
    got = _on_group(2, lambda pg, rank: hand_over(pg, _run(pg), None, 10, rank, 2))
    assert got == [None, None]


# ---------------------------------------------------------------- the waits


def test_the_waits_between_steps_are_not_the_step_watchdog() -> None:
    # A 10-minute evaluation share: the wait allows a peer 8x slower than this member,
    # on top of the step timeout; a short one still detects a hang in seconds.
    assert eval_wait_timeout(600.0, 3.0, 8.0) == 3.0 + 4800.0
    assert eval_wait_timeout(0.1, 3.0, 8.0) == pytest.approx(3.8)
    # A pause where only the leader works: the others waited ~0 s themselves.
    assert pause_timeout(0.0, 3.0, 8.0, 60.0) == 60.0
    assert pause_timeout(100.0, 3.0, 8.0, 60.0) == 803.0
    # A sharded shadow runs none of 32 batches while a replica group runs them all
    # (the demo's held kill: an 8.5 s step timeout fired while the group took 13 s):
    # it has no time of its own, so the ceiling per batch bounds it, not the step's.
    assert idle_wait_timeout(32, 60.0) == 1920.0 > 13.0
    assert idle_wait_timeout(0, 60.0) == 60.0


# ---------------------------------------------------------------- pauses


def _paused_engines(tmp: Path) -> list[StepEngine]:
    """Two members' engines in generation 1 at count 5, on a real gloo group, with a
    step watchdog of 0.5 s (what a peer's pause would otherwise run into)."""
    cfg = TrainerConfig(
        global_batch_size=G,
        micro_batch_size=2,
        total_steps=10,
        hang_timeout_floor_s=0.5,
        initial_hang_timeout_s=0.5,
    )
    groups = _on_group(2, lambda pg, rank: pg)
    engines = []
    for rank, who in enumerate(("a", "b")):
        e = StepEngine(
            FakeBackend(),  # type: ignore[arg-type]
            list(range(64)),
            lambda xs: xs,
            cfg,
            WorkerEnv(member=who, run_dir=str(tmp / who), token="t"),
            client=FakeCoordinator(who, []),  # type: ignore[arg-type]
        )
        e.ctx.links.pg = groups[rank]
        e.proto.gen, e.proto.members, e.proto.rank = 1, ("a", "b"), rank
        e.proto.committed, e.proto.in_group = 5, True
        engines.append(e)
    assert engines[0].hang.timeout_s == 0.5
    return engines


def _both(engines: list[StepEngine], work: Callable[[int], None]) -> None:
    def member(rank: int) -> None:
        with_pause = time.monotonic()
        work(rank)
        engines[rank].pause_barrier(with_pause, None)

    ts = [threading.Thread(target=member, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)


def test_a_pause_longer_than_the_step_watchdog_keeps_the_generation(tmp_path: Path) -> None:
    engines = _paused_engines(tmp_path)
    t0 = time.monotonic()
    # Only the leader works (1.5 s, three times the step watchdog's timeout); the other
    # member's pause is empty and it waits at the end of it.
    _both(engines, lambda rank: time.sleep(1.5) if rank == 1 else None)
    assert time.monotonic() - t0 >= 1.5
    assert [e.ctx.links.broken for e in engines] == [None, None]
    for who in ("a", "b"):
        assert not [e for e in read_events(tmp_path / who) if e["kind"] == "watchdog_fired"]
    # Entered after different steps (a pause decided by the rank would pair with a
    # step's all-reduce; here both pause, one step apart): the next step regroups.
    engines[1].proto.committed = 6
    _both(engines, lambda rank: None)
    assert all(e.ctx.links.broken and "after the same step" in e.ctx.links.broken for e in engines)
    # A peer that never ends its pause (hung, heartbeat alive) is found at the bound.
    engines[1].proto.committed = 5
    for e in engines:
        e.ctx.links.broken = None
    engines[0].pause_barrier(time.monotonic(), 0.3)
    assert engines[0].ctx.links.broken and "did not finish in 0.30s" in engines[0].ctx.links.broken
    fired = [e for e in read_events(tmp_path / "a") if e["kind"] == "watchdog_fired"]
    assert [e["during"] for e in fired] == ["pause"]
    engines[1].pause_barrier(time.monotonic(), 5.0)  # ends rank 0's abandoned all-reduce
    for e in engines:
        for t in e.ctx.waiter.blocked():
            t.join(10)
        e.events.close()


# ---------------------------------------------------------------- the protocol


def _commit(proto: m.MemberProtocol) -> m.Action:
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1))
    proto.advance(m.Reduced(G))
    return proto.advance(m.Applied(proto.committed + 1, 0.0))


def test_the_evaluation_follows_the_commit_that_reaches_its_count() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    proto.eval_every = 2
    joined(proto)
    assert _commit(proto).do is m.Do.COMPUTE
    a = _commit(proto)
    assert a.do is m.Do.EVALUATE and a.step == 2 and a.members == ("a", "b") and a.rank == 0
    assert proto.advance(m.Evaluated()).do is m.Do.COMPUTE
    assert _commit(proto).do is m.Do.COMPUTE  # count 3
    assert _commit(proto).do is m.Do.EVALUATE  # count 4
    assert proto.advance(m.Evaluated()).do is m.Do.COMPUTE
    a = _commit(proto)
    assert a.do is m.Do.EVALUATE and a.step == 5  # the last step
    assert proto.advance(m.Evaluated()).do is m.Do.FINISH


def test_a_failed_evaluation_is_redone_by_the_next_generation() -> None:
    proto = m.MemberProtocol("a", total_steps=10, global_batch_size=G)
    proto.eval_every = 1
    joined(proto)
    a = _commit(proto)
    assert a.do is m.Do.EVALUATE
    a = proto.advance(m.EvalAborted(m.AbortPhase.EVAL, "connection closed"))
    assert a.do is m.Do.ABANDON and a.phase is m.AbortPhase.EVAL and a.step == 1
    assert proto.advance(m.Abandoned()).do is m.Do.RENDEZVOUS
    # The new generation: a replacement "c" is healed to count 1, then all evaluate.
    proto.advance(ready(2, ("a", "c"), {"a": 1, "c": 0}))
    a = proto.advance(m.Connected())
    assert a.do is m.Do.HEAL and a.receivers == (1,)
    a = proto.advance(m.Healed(1))
    assert a.do is m.Do.EVALUATE and a.gen == 2 and a.members == ("a", "c") and a.step == 1


def test_a_failed_evaluation_after_the_last_step_is_redone_before_finishing() -> None:
    proto = m.MemberProtocol("a", total_steps=1, global_batch_size=G)
    proto.eval_every = 5
    joined(proto)
    assert _commit(proto).do is m.Do.EVALUATE
    proto.advance(m.EvalAborted(m.AbortPhase.SUPERSEDED, "b died"))
    assert proto.advance(m.Abandoned()).do is m.Do.RENDEZVOUS
    proto.advance(ready(2, ("a",), {"a": 1}))
    assert proto.advance(m.Connected()).do is m.Do.HEAL
    assert proto.advance(m.Healed(1)).do is m.Do.EVALUATE
    assert proto.advance(m.Evaluated()).do is m.Do.FINISH


def test_no_evaluation_when_preempted_or_not_asked() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    assert _commit(proto).do is m.Do.COMPUTE  # eval_every 0
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    proto.eval_every = 1
    joined(proto)
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1, preempt_s=30.0))
    proto.advance(m.Reduced(G))
    assert proto.advance(m.Applied(1, 30.0)).do is m.Do.EMERGENCY_CHECKPOINT
    with pytest.raises(m.ProtocolError):
        proto.advance(m.Evaluated())


# ---------------------------------------------------------------- a job


def test_an_evaluation_with_a_member_killed_in_it_equals_the_failure_free_one(
    run_job: Callable[..., Job], loop_reference: Job
) -> None:
    # 2 workers; w1 dies after its first batch of the evaluation of count 10 (the one
    # after step index 9). No replacement (its start-up, ~10 s on a loaded machine,
    # would dominate): w0 regroups alone at once and evaluates every batch itself.
    # The reference ran 3 workers without a failure.
    job = run_job(
        script=LOOP,
        script_args=LOOP_ARGS,
        steps=STEPS,
        workers=2,
        replace=False,
        name="evalkill",
        points=[{"member": "w1", "step": 9, "phase": "eval", "action": "kill"}],
    )
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    assert job.of("fault_injected", proc="w1", phase="eval")
    recs = _records(job)
    ref = _agree(_records(loop_reference), STEPS)
    got = _agree(recs, STEPS)
    # The step after each evaluated count carries its result, 3 members' or 1's alike.
    evals = {s: r["eval"] for s, r in got.items() if "eval" in r}
    assert sorted(evals) == [10, 20] and all(e["step"] == s for s, e in evals.items())
    assert evals == {s: ref[s]["eval"] for s in evals}
    ref_final = (loop_reference.run_dir / "final" / "w0.eval.json").read_text()
    assert (job.run_dir / "final" / "w0.eval.json").read_text() == ref_final
    assert json.loads(ref_final)["step"] == STEPS
    # Everything else the loop logged (learning rate, state hash, grad norm) too.
    assert json.dumps(got) == json.dumps(ref)
    _same_curve(loop_reference, job)
    # w0 began count 10 with w1 in generation 1, lost it (the table's all-reduce
    # failed or the generation broke), and computed it alone in the next one.
    begun = [e["gen"] for e in job.of("eval_begin", proc="w0", step=10)]
    assert len(set(begun)) == 2
    assert job.of("step_abort", proc="w0", step=10, gen=min(begun))
    ends = job.of("eval_end", step=10)
    assert [(e["proc"], e["gen"], e["computed"], e["batches"]) for e in ends] == [
        ("w0", max(begun), True, 13)
    ]
    assert not job.of("watchdog_fired")


# ---------------------------------------------------------------- the torch face


def test_evaluate_every_runs_the_users_function_the_evaluation_way() -> None:
    from torch import nn

    from elastrain.runtime.trainer import ElasticTrainer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=2, seed=3)
    trainer = ElasticTrainer(
        model,
        opt,
        data,
        lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]),
        cfg,
        coordinator="127.0.0.1:9",
        token="t",
        member_id="m",
    )
    seen: list[tuple[bool, bool]] = []

    def eval_fn(m: nn.Module, batch: Any) -> dict[str, Any]:
        seen.append((m.training, torch.is_grad_enabled()))
        x, y = batch
        return {"sq": (m(x) - y).square().sum(), "draw": torch.rand(()).item()}

    with pytest.raises(ValueError, match="at least 1"):
        trainer.evaluate_every(0, eval_fn, data, batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        trainer.evaluate_every(5, eval_fn, data, batch_size=0)
    with pytest.raises(TypeError, match="callable"):
        trainer.evaluate_every(5, "eval", data, batch_size=4)  # type: ignore[arg-type]
    trainer.evaluate_every(5, eval_fn, data, batch_size=6)
    with pytest.raises(ValueError, match="one per trainer"):
        trainer.evaluate_every(5, eval_fn, data, batch_size=6)
    ev = trainer.engine.between.evaluation
    assert ev is not None and [len(b) for b in ev.batches()] == [6, 6, 4]
    assert trainer.engine.proto.eval_every == 5
    before = torch.random.get_rng_state()
    first = ev.compute(5, 1, ev.load(ev.batches()[1]))
    again = ev.compute(5, 1, ev.load(ev.batches()[1]))
    other = ev.compute(5, 2, ev.load(ev.batches()[2]))
    # Eval mode (dropout off), no autograd, the model back in training mode after;
    # the batch's RNG is seeded by (seed, count, batch) and the global one untouched.
    assert seen == [(False, False)] * 3 and model.training
    assert first["draw"] == again["draw"] != other["draw"]
    assert float(first["sq"]) == float(again["sq"])
    assert torch.equal(torch.random.get_rng_state(), before)
    trainer.engine.events.close()

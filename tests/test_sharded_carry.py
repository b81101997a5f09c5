"""Issue 41: what a sharded job's loop carries and evaluates (`TrainerConfig.shard_size` > 1).

- `trainer.register` on a sharded model: a warm-up + cosine `LambdaLR` travels
  with the state through a kill and heal, a reshard 2 x 2 -> 1 x 3 and a
  checkpoint resume; the learning rate and the loss are the failure-free run's
  bit for bit (which is the replicated run's: the float64 sharded step is exact).
- The unregistered-scheduler guard on both paths, and a scheduler carried by
  the older ``extra_state=``/``load_extra_state=`` counting as carried.
- `evaluate_every` on a sharded model: equal across layouts (2 x 2, 1 x 4,
  1 x 2) and to the replicated job's, and redone after a member dies in it.

The job tests run tests/scripts/train_sharded_carry.py and compare what each
member logged after every committed step with the replicated reference.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from elastrain.checkpoint import CheckpointConfig
from elastrain.checkpoint.dcp import ShardedWriter, ShardSnapshot, commit_sharded
from elastrain.checkpoint.replicated_parts import restore_whole
from elastrain.checkpoint.sharded_parts import shard_parts
from elastrain.checkpoint.store import latest_verified
from elastrain.exitcodes import EXIT_MISCONFIGURED, WorkerExit
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_same_state
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.registered import REGISTERED_META, load_objects_meta, objects_meta
from elastrain.runtime.shard_groups import ShardedGroups
from elastrain.runtime.sharded import ShardedBackend
from elastrain.runtime.trainer import ElasticTrainer
from elastrain.transfer import TorchState

from .conftest import REPLACE_AFTER_RESHARD_S, ROOT, FaultHold, Job, JoinGate, run_in_process

sys.path.insert(0, str(ROOT / "tests" / "scripts"))
from train_sharded import Net, Regression, loss_fn  # noqa: E402
from train_sharded_carry import lr_factor  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "train_sharded_carry.py")
STEPS, EVERY = 20, 5
EVALS = [5, 10, 15]
"""The counts evaluated before the last (each carried by the next step's record)."""

# ---------------------------------------------------------------- units


class Counter:
    """A user's registered state with a tensor in it."""

    def __init__(self) -> None:
        self.n = 0
        self.seen = torch.zeros(3, dtype=torch.int64)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "seen": self.seen.clone()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.n, self.seen = sd["n"], sd["seen"].clone()


def _sharded(
    **kw: Any,
) -> tuple[ShardedBackend, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = TrainerConfig(global_batch_size=24, micro_batch_size=3, total_steps=4, shard_size=2)
    sb = ShardedBackend(model, opt, loss_fn, cfg, **kw)
    # Built after the trainer, as a script does: it sets the groups' lr and initial_lr.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    return sb, opt, sched


def test_registered_state_travels_in_the_meta_tensors_and_order_included() -> None:
    sb, _, sched = _sharded()
    counter = Counter()
    sb.register("sched", sched)
    sb.register("count", counter)
    sb.place(1)
    assert sb.optimizer is not None
    sb.optimizer.step()  # no gradients: nothing moves, the scheduler sees a step
    for _ in range(3):
        sched.step()
    counter.n, counter.seen = 7, torch.tensor([1, 2, 3])
    meta = json.loads(json.dumps(sb.meta(), sort_keys=True))  # a checkpoint's sorted JSON

    other, _, sched2 = _sharded()
    counter2 = Counter()
    other.register("sched", sched2)
    other.register("count", counter2)
    other.place(1)
    other.load_meta(meta)
    assert sched2.state_dict() == sched.state_dict()
    assert list(sched2.state_dict()) == list(sched.state_dict())  # key order: the hash's
    assert counter2.n == 7 and torch.equal(counter2.seen, torch.tensor([1, 2, 3]))
    sched2.step()
    sched.step()
    assert other.optimizer is not None and sb.optimizer is not None
    assert other.optimizer.param_groups[0]["lr"] == sb.optimizer.param_groups[0]["lr"]
    with pytest.raises(ValueError, match="registered objects differ"):
        load_objects_meta({"sched": sched2}, objects_meta({"other": Counter()}))


def test_a_registered_scheduler_steps_the_shard_optimizer_and_is_hashed() -> None:
    sb, opt, sched = _sharded()
    sb.register("sched", sched)
    assert sb.problems() == []
    sb.place(0)
    shard_opt = sb.optimizer
    assert shard_opt is not None and shard_opt is not opt and sched.optimizer is shard_opt
    # The shard optimizer starts at the scheduler's first rate, as the script's did.
    assert shard_opt.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_factor(0), rel=0, abs=0)
    assert shard_opt.param_groups[0]["initial_lr"] == 3e-3
    before = sb.state_hash()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() has been overridden"
        shard_opt.step()
        sched.step()
    assert shard_opt.param_groups[0]["lr"] == 3e-3 * lr_factor(1)
    assert sb.state_hash() != before
    # A new shard optimizer (a reshard, a reset) takes the scheduler with it.
    sb.reset(0, 2)
    assert sched.optimizer is sb.optimizer and sb.optimizer is not shard_opt


def test_a_peers_meta_brings_the_rate_its_loop_stepped_into_the_optimizer() -> None:
    """A member that rolled a step forward never ran the script's loop for it (no
    `sched.step()`): the meta of a peer that did carries the scheduler and the
    rates it wrote into the optimizer, so both start the next generation alike
    (a real kill during step 18's vote of the FSDP port left the two twins of a
    shard with different learning rates, and different state hashes)."""
    ran, rolled = _sharded(), _sharded()
    for sb, _, sched in (ran, rolled):
        sb.register("sched", sched)
        sb.place(0)
    ran[0].optimizer.step()
    ran[2].step()  # the loop's sched.step() after the committed step
    rolled[0].optimizer.step()  # the kept step applied, no loop
    assert ran[0].state_hash() != rolled[0].state_hash()
    rolled[0].load_meta(json.loads(json.dumps(ran[0].meta())))
    assert rolled[0].optimizer.param_groups[0]["lr"] == 3e-3 * lr_factor(1)
    assert rolled[0].state_hash() == ran[0].state_hash()


def test_a_scheduler_the_script_carries_itself_steps_the_shard_optimizer_too() -> None:
    """Not registered (carried through ``extra_state=``): moved all the same, or its
    ``step()`` would set the rate of an optimizer that no longer steps anything."""
    sb, _, sched = _sharded()
    sb.place(0)
    assert sched.optimizer is sb.optimizer
    sb.reset(0, 2)
    assert sched.optimizer is sb.optimizer
    assert sb.optimizer is not None
    sb.optimizer.step()
    sched.step()
    assert sb.optimizer.param_groups[0]["lr"] == 3e-3 * lr_factor(1)


def _trained_pair() -> tuple[list[ShardedBackend], list[Any], list[Counter]]:
    """Two members holding shards 0 and 1 of one state after 3 AdamW steps (made-up
    gradients) with a registered LambdaLR and a counter, stepped alike."""
    members, scheds, counters = [], [], []
    for k in range(2):
        sb, _, sched = _sharded()
        counter = Counter()
        sb.register("sched", sched)
        sb.register("count", counter)
        sb.place(k)
        members.append(sb)
        scheds.append(sched)
        counters.append(counter)
    for step in range(3):
        for sb, sched, counter in zip(members, scheds, counters, strict=True):
            g = torch.Generator().manual_seed(100 + step)
            assert sb.optimizer is not None
            for p in sb.local.parameters():
                p.grad = torch.randn(p.shape, generator=g)
            sb.optimizer.step()
            sched.step()
            counter.n += 1
            counter.seen += step
    return members, scheds, counters


def test_a_sharded_checkpoint_carries_registered_state_to_both_trainers(tmp_path: Path) -> None:
    """The registered objects are in each writer's meta (a sharded resume reads
    them there) and, as a replicated DCP checkpoint holds them, under ``objects``
    with their tensors as `object_key`s: a replicated job resumes them too."""
    members, scheds, counters = _trained_pair()
    writer = ShardedWriter(CheckpointConfig(directory=str(tmp_path), fsync=False))
    names = ["m0", "m1"]
    for k, sb in enumerate(members):
        parts = shard_parts(sb, {"committed": 3, **sb.meta()}, k)
        snap = ShardSnapshot.take(parts, shard=k, num_shards=2)
        assert writer.save_async(3, snap, generation=1, members=names).wait().ok
    writer.close()
    commit_sharded(str(tmp_path), 3, generation=1, members=names, num_shards=2, fsync=False)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.kind == "dcp"

    # Sharded: the meta's registered state.
    sb, _, sched = _sharded()
    counter = Counter()
    sb.register("sched", sched)
    sb.register("count", counter)
    sb.place(0)
    sb.load_meta(json.loads(json.dumps(ckpt.meta)))
    assert sched.state_dict() == scheds[0].state_dict()
    assert counter.n == 3 and torch.equal(counter.seen, counters[0].seen)

    # Replicated: the whole state with its objects, as from a replicated checkpoint.
    torch.manual_seed(1)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rsched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rcounter = Counter()
    state = TorchState(model, opt, {"sched": rsched, "count": rcounter})
    restore_whole(ckpt, None, ckpt.meta, state)
    assert rsched.state_dict() == scheds[0].state_dict()
    assert rcounter.n == 3 and torch.equal(rcounter.seen, counters[0].seen)
    assert opt.param_groups[0]["lr"] == 3e-3 * lr_factor(3)


def test_a_sharded_member_resumes_a_replicated_checkpoints_registered_state(
    tmp_path: Path,
) -> None:
    """A replicated job's DCP checkpoint has its objects under ``objects`` only: the
    sharded topology's restore turns them into the meta the member installs."""
    from .test_replicated_dcp import write_by_members

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    counter = Counter()
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
        counter.n += 1
    counter.seen = torch.tensor([4, 5, 6])
    write_by_members(tmp_path, 2, TorchState(model, opt, {"sched": sched, "count": counter}), 2)
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and REGISTERED_META not in ckpt.meta

    sb, _, sched2 = _sharded()
    counter2 = Counter()
    sb.register("sched", sched2)
    sb.register("count", counter2)
    ctx = SimpleNamespace(member="m", config=None, host="h", events=None, graveyard=None)
    topo = ShardedGroups(ctx, sb)  # type: ignore[arg-type]
    meta = json.loads(json.dumps(ckpt.meta))
    topo.restore(ckpt, None, meta, lambda nbytes, s: None)
    sb.place(1)
    sb.load_meta(meta)
    assert sched2.state_dict() == sched.state_dict()
    assert counter2.n == 2 and torch.equal(counter2.seen, torch.tensor([4, 5, 6]))
    assert sb.optimizer is not None and sched2.optimizer is sb.optimizer
    assert sb.optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def _problems(trainer: ElasticTrainer) -> list[str]:
    return trainer.backend.problems()


@pytest.mark.parametrize("shard_size", [1, 2], ids=["replicated", "sharded"])
def test_the_guard_refuses_an_uncarried_scheduler_and_trusts_extra_state(
    shard_size: int,
) -> None:
    data = Regression(n=48)
    cfg = TrainerConfig(
        global_batch_size=24, micro_batch_size=3, total_steps=2, shard_size=shard_size
    )

    def build(**kw: Any) -> tuple[ElasticTrainer, Any]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        trainer = ElasticTrainer(
            model, opt, data, loss_fn, cfg, coordinator="127.0.0.1:9", token="t",
            member_id="m", **kw,
        )  # fmt: skip
        return trainer, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)

    trainer, sched = build()
    (why,) = _problems(trainer)
    assert "LambdaLR steps the trainer's optimizer but is not registered" in why
    with pytest.raises(WorkerExit) as e:
        next(trainer.steps())
    assert e.value.code == EXIT_MISCONFIGURED
    assert 'trainer.register("sched", sched)' in str(e.value.message)

    trainer, sched = build()
    trainer.register("sched", sched)
    assert _problems(trainer) == []

    # The older API: the script carries the scheduler in its extra state.
    holder: dict[str, Any] = {}
    trainer, sched = build(
        extra_state=lambda: {"sched": holder["sched"].state_dict()},
        load_extra_state=lambda s: holder["sched"].load_state_dict(s["sched"]),
    )
    holder["sched"] = sched
    assert _problems(trainer) == []


# ---------------------------------------------------------------- jobs


def _records(run_dir: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """member -> step -> what it logged after committing that step."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for f in sorted((run_dir / "loop").glob("*.jsonl")):
        out[f.stem] = {r["step"]: r for r in map(json.loads, f.read_text().splitlines())}
    return out


def _agreed(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every member that committed a step logged the same for it; one view per step."""
    by_step: dict[int, dict[str, Any]] = {}
    for member, steps in _records(run_dir).items():
        for s, r in steps.items():
            if s in by_step:
                assert json.dumps(by_step[s]) == json.dumps(r), (member, s, by_step[s], r)
            else:
                by_step[s] = r
    return by_step


def _final_evals(run_dir: Path) -> set[str]:
    return {f.read_text() for f in (run_dir / "final").glob("*.eval.json")}


def _launch(run_job: Callable[..., Job], name: str, **kw: Any) -> Job:
    kw.setdefault("steps", STEPS)
    args = kw.pop("script_args", [])
    return run_job(script=SCRIPT, script_args=["--eval-every", str(EVERY), *args], name=name, **kw)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The failure-free replicated run, its run directory: one member trained in this
    process (`run_in_process`; its records equal a 4-member replicated job's bit for
    bit: float64 reductions and evaluation sums)."""
    run_dir = tmp_path_factory.mktemp("carry-ref") / "ref"
    run_in_process(SCRIPT, run_dir, STEPS, ["--eval-every", str(EVERY)])
    got = _agreed(run_dir)
    assert sorted(got) == list(range(STEPS))
    assert sorted(s for s, r in got.items() if "eval" in r) == EVALS
    return run_dir


def _assert_same(job: Job, ref: Path, since: int = 0) -> dict[int, dict[str, Any]]:
    """The job finished, twins started every generation alike, and from step `since`
    on every record (loss, learning rate, scheduler count, evaluation) and the
    evaluation after the last step are the reference's bit for bit."""
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    want, got = _agreed(ref), _agreed(job.run_dir)
    assert sorted(got) == list(range(since, STEPS)) or sorted(got) == list(range(STEPS))
    for s in range(since, STEPS):
        assert json.dumps(got[s]) == json.dumps(want[s]), (s, want[s], got[s])
    assert _final_evals(job.run_dir) == _final_evals(ref) and len(_final_evals(ref)) == 1
    return got


@pytest.mark.parametrize(
    ("workers", "shard_size", "carry"),
    [(4, 2, "register"), (4, 4, "register"), (2, 2, "extra")],
    ids=["2x2", "1x4", "1x2-extra-state"],
)
def test_sharded_evaluation_and_schedule_equal_the_replicated_jobs(
    run_job: Callable[..., Job], reference: Path, workers: int, shard_size: int, carry: str
) -> None:
    """Every layout evaluates to the replicated job's sums bit for bit (float64, fixed
    batches) and steps on its learning rates. The 1 x 2 job carries its scheduler
    through the older ``extra_state=`` and starts (the guard counts it carried)."""
    job = _launch(
        run_job, f"s{shard_size}", workers=workers, shard_size=shard_size,
        script_args=["--carry", carry],
    )  # fmt: skip
    _assert_same(job, reference)
    ends = job.of("eval_end")
    # Each count computed once per member; in a group, every member ran the batches.
    assert {e["step"] for e in ends} == {*EVALS, STEPS}
    assert all(e["computed"] for e in ends)
    groups = workers // shard_size
    batches = -(-30 // 4)  # EVAL_N over EVAL_B
    assert {e["batches"] for e in ends} == {-(-batches // groups), batches // groups}


def _held_until(
    pace: Path,
    seconds: str,
    released: Callable[[list[dict[str, Any]]], bool],
    from_fault: bool = False,
) -> Any:
    """An on_status callback that holds the job's steps at `seconds` each (the pace
    file) until `released(events)` is true (`FaultHold`): from the job's start, or
    (``from_fault``) from the first status poll that shows its fault."""
    hold = FaultHold(pace, seconds, released)
    if not from_fault:
        hold.begin()

    def watch(la: Any, st: dict[str, Any]) -> None:
        hold.poll(read_events(Path(la.config.run_dir)))

    return watch


def test_a_kill_during_an_evaluation_redoes_it_and_the_heal_carries_the_schedule(
    run_job: Callable[..., Job], reference: Path, tmp_path: Path
) -> None:
    """w1 dies after its first batch of the evaluation of count 5. Its group-mate
    fails in the next all-gather; the generation after evaluates again with that
    group-mate a shadow (it runs nothing and learns the metric names from the
    others); the replacement is healed its shard from its twin, the scheduler's
    state with it. Every record, the replacement's included, is the replicated
    run's."""
    pace, gate = tmp_path / "pace", JoinGate(tmp_path / "w4.gate", "w4")
    hold = FaultHold(
        pace,
        "2.0",
        lambda events: any(e["kind"] == "heal_end" and e.get("role") == "recv" for e in events),
    )

    def watch(la: Any, st: dict[str, Any]) -> None:
        events = read_events(Path(la.config.run_dir))
        hold.poll(events)
        # The replacement (w4) waits before it joins until the redo has ended: one
        # forked from the warm prefork server registered 0.18 s after the redo's end
        # here, and the redo with its shadow is what this test is about.
        gate.open_if(any(e["kind"] == "eval_end" and e["gen"] > 1 and e["batches"] for e in events))

    job = _launch(
        run_job,
        "evalkill",
        shard_size=2,
        points=[{"member": "w1", "step": 4, "phase": "eval", "action": "kill"}],
        script_args=["--pace-file", str(pace), *gate.args],
        on_status=watch,
    )
    got = _assert_same(job, reference)
    assert job.of("fault_injected", proc="w1", phase="eval")
    ends = job.of("eval_end", step=5)
    # One generation ran the evaluation's batches to its end: the redo (the killed
    # generation's never ended).
    (redo,) = {e["gen"] for e in ends if e["batches"] > 0}
    assert len({e["gen"] for e in job.of("eval_begin", step=5)}) >= 2, "evaluated once only"
    # The redo's shadow ran no batch and holds the same result as the others.
    shadow = [e for e in ends if e["gen"] == redo and e["batches"] == 0]
    assert len(shadow) == 1 and shadow[0]["computed"]
    # A replacement admitted after the redo's end and before step 5 forms one more
    # generation at that step (a fast start makes it possible): it ends the same
    # evaluation again without running a batch, the result handed over (computed false).
    assert all(e["batches"] == 0 and not e["computed"] for e in ends if e["gen"] > redo), ends
    assert len({json.dumps(e["sums"]) for e in ends}) == 1
    healed = [e for e in job.events if e["kind"] == "heal_end" and e.get("role") == "recv"]
    (joiner,) = {e["proc"] for e in healed}
    assert joiner not in ("w0", "w1", "w2", "w3")
    # The replacement logged from its first step on: the schedule it was healed into.
    late = _records(job.run_dir)[joiner]
    assert late and all(json.dumps(r) == json.dumps(got[s]) for s, r in late.items())


def test_a_reshard_2x2_to_1x3_carries_the_schedule(
    run_job: Callable[..., Job], reference: Path, tmp_path: Path
) -> None:
    """A rank dies and is not replaced in time: the three survivors reshard to
    1 x 3 in memory (the scheduler's state in the leader's meta for anyone behind,
    kept by the others), and back to 2 x 2 when the replacement arrives."""
    pace = tmp_path / "pace"
    watch = _held_until(
        pace,
        "0.5",
        lambda events: any(e["kind"] == "reshard_end" and e["new_size"] == 3 for e in events),
    )

    job = _launch(
        run_job,
        "reshard",
        shard_size=2,
        reshard_after_s=0.5,
        replace_delay_s=REPLACE_AFTER_RESHARD_S,
        faults=["kill@4:w1"],
        script_args=["--pace-file", str(pace)],
        on_status=watch,
    )
    _assert_same(job, reference)
    sizes = [e.get("shard_size") for e in job.events if e["kind"] == "generation_ready"]
    assert 3 in sizes, sizes


def test_a_checkpoint_resume_carries_the_schedule(
    run_job: Callable[..., Job], reference: Path, tmp_path: Path
) -> None:
    """Every worker of a 2 x 2 job is killed at step 12; the job run again on its run
    directory resumes from its sharded checkpoint, the scheduler's state read from
    the checkpoint's meta, and goes on as the uninterrupted run."""
    pace = tmp_path / "pace"
    pace.write_text("0.3")
    points = [{"member": f"w{i}", "step": 12, "phase": "compute", "action": "kill"}
              for i in range(4)]  # fmt: skip
    first = _launch(
        run_job, "ckpt", shard_size=2, replace=False, checkpoint_every=5,
        script_args=["--pace-file", str(pace), "--ckpt-every", "5"], points=points,
    )  # fmt: skip
    assert first.result.status == "failed"
    newest = latest_verified(first.run_dir / "checkpoints")
    assert newest is not None and newest.kind == "dcp" and 5 <= newest.step <= 12
    run_dir = tmp_path / "again"
    shutil.copytree(first.run_dir, run_dir)
    shutil.rmtree(run_dir / "loop")
    from elastrain.launch.launcher import LaunchConfig, Launcher

    cfg = LaunchConfig(
        script=SCRIPT,
        script_args=["--eval-every", str(EVERY)],
        workers=4,
        steps=STEPS,
        shard_size=2,
        run_dir=str(run_dir),
        progress=False,
        extra_env={"PYTHONPATH": str(ROOT)},
    )
    la = Launcher(cfg)
    job = Job(la, la.run())
    assert job.result.resumed_from == newest.step
    t0 = max(e["t"] for e in job.events if e["kind"] == "job_start")
    job.events = [e for e in job.events if e["t"] >= t0]
    got = _assert_same(job, reference, since=newest.step)
    assert got[newest.step]["sched_step"] == newest.step + 1


def test_register_on_a_sharded_trainer_is_not_refused_any_more() -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=2, shard_size=2)
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ElasticTrainer(
        model, opt, data, lambda m, b: ((m(b[0]) - b[1]) ** 2).mean(), cfg,
        coordinator="127.0.0.1:9", token="t", member_id="m",
    )  # fmt: skip
    trainer.register("count", Counter())
    trainer.evaluate_every(1, lambda m, b: {"n": len(b[0])}, data, batch_size=4)
    with pytest.raises(ValueError, match="already"):
        trainer.register("count", Counter())

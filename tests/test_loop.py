"""The loop real users write (issue 17): clipping, the before-step hook, the
non-finite skip, a GradScaler, an LR scheduler and other registered state.

Unit tests drive `TorchBackend` and `TorchState` in this process; the job tests
run tests/scripts/train_loop.py under the launcher and compare what each member
logged after every committed step (learning rate, state hash, grad norm,
GradScaler scale) across members and with the failure-free run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from elastrain.exitcodes import EXIT_MISCONFIGURED, WorkerExit
from elastrain.observe.ledger import check_same_state, loss_curve
from elastrain.runtime import torch_backend
from elastrain.runtime.backend import SkipReason
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.engine import EXTRA_SLOTS
from elastrain.runtime.torch_backend import TorchBackend
from elastrain.runtime.trainer import ElasticTrainer
from elastrain.runtime.update import (
    NORM_CHUNK,
    Decision,
    StepGrads,
    grad_norm,
    scheduler_problems,
)
from elastrain.transfer import HealError, TorchState, state_digest
from elastrain.transfer.flatten import flatten_state
from elastrain.transfer.manifest import build_manifest, decode_manifest, encode_manifest

from .conftest import ROOT, InProcessRun, Job, run_in_process

LOOP = str(ROOT / "tests" / "scripts" / "train_loop.py")

# ---------------------------------------------------------------- units


def _net(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


class Counter:
    """A user's own stateful object: a tensor and a JSON value."""

    def __init__(self) -> None:
        self.seen = torch.zeros(3)
        self.note = "fresh"

    def state_dict(self) -> dict[str, Any]:
        return {"seen": self.seen, "note": self.note}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.seen.copy_(sd["seen"])
        self.note = sd["note"]


def _heal_into(sender: TorchState, receiver: TorchState) -> None:
    """What a heal does with the receiver's checks, without the wire."""
    flat = sender.flatten()
    m = decode_manifest(
        encode_manifest(build_manifest("torch", flat.tensors, flat.section, [0], {}, 1))
    )
    problem = receiver.bound(m) or receiver.check(m)
    if problem:
        raise HealError(problem)
    receiver.install({n: t.clone() for n, t in flat.tensors}, json.loads(json.dumps(flat.section)))


def test_state_hash_differs_when_only_the_lr_differs() -> None:
    a, b = _net(), _net()
    assert state_digest(TorchState(*a)) == state_digest(TorchState(*b))
    b[1].param_groups[0]["lr"] = 1e-2 * (1 + 2**-40)
    assert state_digest(TorchState(*a)) != state_digest(TorchState(*b))


def test_registered_state_travels_and_is_hashed() -> None:
    model, opt = _net()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    count = Counter()
    for _ in range(3):
        opt.step()
        sched.step()
    count.seen += 5
    count.note = "seen 5"
    sender = TorchState(model, opt, {"sched": sched, "count": count})
    flat = sender.flatten()
    # Tensors travel as tensors, the rest as JSON.
    objects = {n: t for n, t in flat.tensors if n.startswith("obj/")}
    assert (
        list(objects) == ["obj/count/seen"]
        and objects["obj/count/seen"].data_ptr() == count.seen.data_ptr()
    )
    assert flat.section["objects"]["sched"]["last_epoch"] == 3

    model2, opt2 = _net(1)
    sched2 = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    count2 = Counter()
    receiver = TorchState(model2, opt2, {"sched": sched2, "count": count2})
    assert state_digest(receiver) != state_digest(sender)
    _heal_into(sender, receiver)
    assert state_digest(receiver) == state_digest(sender)
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(count2.seen, count.seen) and count2.note == "seen 5"
    # The healed scheduler continues exactly as the sender's.
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    # Only the scheduler's state differs: the hash sees it.
    sched.step()
    assert state_digest(receiver) != state_digest(sender)


def test_registered_objects_must_match_the_receivers() -> None:
    model, opt = _net()
    count = Counter()
    sender = TorchState(model, opt, {"count": count})
    plain = TorchState(*_net(1))
    with pytest.raises(HealError, match="registered objects differ"):
        _heal_into(sender, plain)
    bigger = Counter()
    bigger.seen = torch.zeros(1000)
    with pytest.raises(HealError, match="claims 1000 elements"):
        _heal_into(
            TorchState(model, opt, {"count": bigger}), TorchState(*_net(1), {"count": count})
        )


def test_a_refused_object_leaves_the_state_as_it_was() -> None:
    class Refuses(Counter):
        def load_state_dict(self, sd: dict[str, Any]) -> None:
            raise ValueError("no")

    model, opt = _net()
    sender = TorchState(model, opt, {"count": Counter(), "other": Counter()})
    sender.objects["count"].note = "sent"  # type: ignore[attr-defined]
    mine = Counter()
    model2, opt2 = _net(1)
    before = state_digest(TorchState(model2, opt2))
    with pytest.raises(HealError, match="'other'"):
        _heal_into(sender, TorchState(model2, opt2, {"count": mine, "other": Refuses()}))
    assert mine.note == "fresh"
    assert state_digest(TorchState(model2, opt2)) == before


def test_grad_norm_does_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(0)
    grads = [
        torch.randn(1_000_003, generator=g) * torch.logspace(-6, 6, 1_000_003),
        torch.randn(77, generator=g),
    ]
    threads = torch.get_num_threads()
    try:
        norms = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            norms.append(grad_norm(grads).hex())
    finally:
        torch.set_num_threads(threads)
    assert len(set(norms)) == 1, norms
    want = torch.linalg.vector_norm(torch.cat(grads).double()).item()
    assert math.isclose(float.fromhex(norms[0]), want, rel_tol=1e-12)
    assert grad_norm([]) == 0.0


def _backend(**kw: Any) -> tuple[TorchBackend, nn.Module, torch.optim.Optimizer]:
    model, opt = _net()
    cfg = TrainerConfig(
        global_batch_size=4,
        micro_batch_size=4,
        total_steps=1,
        max_grad_norm=kw.pop("max_grad_norm", None),
    )
    return TorchBackend(model, opt, _loss, cfg, **kw), model, opt


def _one_step(be: TorchBackend, x: torch.Tensor) -> Any:
    """One member's whole step: its sum is the all-reduced sum."""
    be.begin_step(EXTRA_SLOTS)
    be.compute(0, 0, (x, torch.ones(4, 1)), 4)
    return be.apply()


@pytest.mark.parametrize("zero_grad_in_loss", [False, True])
def test_the_float64_reduction_sums_each_micro_batch_exactly(zero_grad_in_loss: bool) -> None:
    # Small parameters are widened together after each backward, a large one by its
    # own hook: both must give the float64 sum of each micro-batch's gradient, over
    # steps, even when the loss function sets the gradients to None itself.
    def build() -> nn.Module:
        torch.manual_seed(5)
        return nn.Sequential(nn.Linear(600, 600), nn.Tanh(), nn.Linear(600, 3), nn.Linear(3, 1))

    def loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if zero_grad_in_loss:
            m.zero_grad(set_to_none=True)
        return _loss(m, batch)

    model, ref = build(), build()
    assert model[0].weight.numel() > torch_backend.SMALL_GRAD_ELEMENTS
    assert all(q.numel() < torch_backend.SMALL_GRAD_ELEMENTS for q in list(model.parameters())[1:])
    cfg = TrainerConfig(
        global_batch_size=3, micro_batch_size=1, total_steps=2, reduce_dtype="float64"
    )
    be = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.0), loss, cfg)
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batches = [
            (torch.randn(1, 600, generator=gen), torch.randn(1, 1, generator=gen)) for _ in range(3)
        ]
        be.begin_step(EXTRA_SLOTS)
        for i, b in enumerate(batches):
            be.compute(0, i, b, 1)
        be.apply()
        want = [torch.zeros(q.shape, dtype=torch.float64) for q in ref.parameters()]
        for b in batches:
            ref.zero_grad(set_to_none=True)
            _loss(ref, b).backward()
            for w, q in zip(want, ref.parameters(), strict=True):
                w.add_(q.grad.double())
        for w, q in zip(want, model.parameters(), strict=True):
            assert q.grad is not None and torch.equal(q.grad, (w / 3).float())
        model.zero_grad(set_to_none=True)  # a script's loop may do this between steps


def _wide_net() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Small parameters and one above SMALL_GRAD_ELEMENTS (widened by its own hook),
    with an optimizer that moves a parameter even when its gradient is zero."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 400), nn.Tanh(), nn.Linear(400, 400), nn.Linear(400, 1))
    assert model[2].weight.numel() >= torch_backend.SMALL_GRAD_ELEMENTS
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("reduce_dtype", ["float64", "native"])
def test_a_parameter_frozen_after_its_view_was_built_is_not_stepped(reduce_dtype: str) -> None:
    # Frozen between warm_up and the first step (a registered object a heal loads may
    # do it), or between two steps: the optimizer must not touch it.
    model, opt = _wide_net()
    cfg = TrainerConfig(
        global_batch_size=4, micro_batch_size=4, total_steps=2, reduce_dtype=reduce_dtype
    )
    be = TorchBackend(model, opt, _loss, cfg)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
    be.warm_up((x, torch.ones(4, 1)), EXTRA_SLOTS)
    for frozen in ([model[0].bias, model[2].weight], [model[3].weight]):
        for q in frozen:
            q.requires_grad_(False)
        kept = [q.detach().clone() for q in frozen]
        moving = model[0].weight.detach().clone()
        _one_step(be, x)
        assert all(q.grad is None and torch.equal(q, k) for q, k in zip(frozen, kept, strict=True))
        assert not torch.equal(model[0].weight, moving)


@pytest.mark.parametrize("reduce_dtype", ["float64", "native"])
def test_warm_up_builds_the_buffers_the_first_step_uses(reduce_dtype: str) -> None:
    # A replacement builds (and faults in) its gradient buffers and work space before
    # it registers, not inside its first step; the step is the same either way.
    def run(warm: bool) -> tuple[TorchBackend, list[int], list[torch.Tensor]]:
        model, opt = _wide_net()
        cfg = TrainerConfig(
            global_batch_size=4, micro_batch_size=4, total_steps=1, reduce_dtype=reduce_dtype
        )
        be = TorchBackend(model, opt, _loss, cfg)
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(2))
        built: list[int] = []
        if warm:
            be.warm_up((x, torch.ones(4, 1)), EXTRA_SLOTS)
            built = [b.data_ptr() for b in [*be._flats, *be.reduce_buffers(), be._scratch]]
            assert all(q.grad is not None and not q.grad.any() for q in model.parameters())
        _one_step(be, x)
        return be, built, [q.detach().clone() for q in model.parameters()]

    be, built, after = run(True)
    assert built and be._scratch.numel() >= NORM_CHUNK
    # The first step reused them: nothing was rebuilt or grown.
    assert built == [b.data_ptr() for b in [*be._flats, *be.reduce_buffers(), be._scratch]]
    _, _, cold = run(False)
    assert all(torch.equal(a, b) for a, b in zip(after, cold, strict=True))


def test_clipping_follows_torchs_rule() -> None:
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(3)) * 10
    be, model, _ = _backend(max_grad_norm=0.01)
    update = _one_step(be, x)
    ref, _ = _net()
    _loss(ref, (x, torch.ones(4, 1))).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert update.skipped is None
    assert math.isclose(update.grad_norm, float(norm), rel_tol=1e-6)
    # Clipped grads: what torch's clip_grad_norm_ gives, to float32 rounding of the norm.
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=0)


def test_a_nonfinite_gradient_is_not_applied() -> None:
    seen: list[StepGrads] = []

    def hook(g: StepGrads) -> Decision | None:
        seen.append(g)
        return None

    be, model, opt = _backend(before_step=hook, step_index=lambda: 7)
    x = torch.ones(4, 4)
    x[2, 1] = float("inf")
    before = state_digest(TorchState(model, opt))
    update = _one_step(be, x)
    assert update.skipped == SkipReason.NONFINITE and not math.isfinite(update.grad_norm)
    assert state_digest(TorchState(model, opt)) == before  # params and Adam's state unchanged
    assert [(g.step, g.finite) for g in seen] == [(7, False)]
    update = _one_step(be, torch.ones(4, 4))
    assert update.skipped is None and seen[-1].finite
    assert state_digest(TorchState(model, opt)) != before


def test_the_hook_can_skip_a_step() -> None:
    be, model, opt = _backend(before_step=lambda g: Decision.SKIP, step_index=lambda: 0)
    before = state_digest(TorchState(model, opt))
    assert _one_step(be, torch.ones(4, 4)).skipped == SkipReason.HOOK
    assert state_digest(TorchState(model, opt)) == before


def test_grad_scaler_unscales_skips_an_overflow_and_backs_off() -> None:
    def fp16_loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        with torch.autocast("cpu", dtype=torch.float16):
            out = m(x)
        return nn.functional.mse_loss(out.float(), y)

    model, opt = _net()
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=4, total_steps=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    be = TorchBackend(model, opt, fp16_loss, cfg, grad_scaler=scaler)
    assert "grad_scaler" in be.objects
    ok = _one_step(be, torch.ones(4, 4))
    assert ok.skipped is None and scaler.get_scale() == 2.0**10
    # The grads the optimizer saw were unscaled: their norm is the plain loss's.
    ref, _ = _net()
    with torch.autocast("cpu", dtype=torch.float16):
        out = ref(torch.ones(4, 4))
    nn.functional.mse_loss(out.float(), torch.ones(4, 1)).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))  # type: ignore[union-attr]
    assert math.isclose(ok.grad_norm, float(want), rel_tol=1e-3)
    before = state_digest(be.state())
    x = torch.ones(4, 4)
    x[0, 0] = 1e5  # beyond float16
    bad = _one_step(be, x)
    assert bad.skipped == SkipReason.NONFINITE
    assert scaler.get_scale() == 2.0**9
    after = be.state()
    assert state_digest(after) != before  # the scale is part of the state
    assert [n for n, _ in flatten_state(model, opt).tensors] == [
        n for n, _ in after.flatten().tensors if not n.startswith("obj/")
    ]


def test_unregistered_scheduler_is_found() -> None:
    model, opt = _net()
    assert scheduler_problems(opt, {}) == []
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    problems = scheduler_problems(opt, {})
    assert len(problems) == 1 and 'trainer.register("sched", sched)' in problems[0]
    assert scheduler_problems(opt, {"sched": sched}) == []
    # A second scheduler that is not registered is found too.
    other = torch.optim.lr_scheduler.StepLR(opt, 3)
    assert len(scheduler_problems(opt, {"sched": sched})) == 1
    del other  # gone: its wrapper of opt.step stays, but nothing is left to carry
    assert scheduler_problems(opt, {"sched": sched}) == []
    # A registered SequentialLR carries its children.
    model2, opt2 = _net()
    warm = torch.optim.lr_scheduler.LinearLR(opt2, 0.1, total_iters=3)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt2, T_max=10)
    seq = torch.optim.lr_scheduler.SequentialLR(opt2, [warm, cos], milestones=[3])
    assert len(scheduler_problems(opt2, {})) == 3
    assert scheduler_problems(opt2, {"sched": seq}) == []
    # ReduceLROnPlateau does not wrap the optimizer's step; it is found all the same.
    model3, opt3 = _net()
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt3)
    assert "ReduceLROnPlateau" in scheduler_problems(opt3, {})[0]
    assert scheduler_problems(opt3, {"plateau": plateau}) == []


def test_trainer_refuses_an_unregistered_scheduler_at_start(tmp_path: Path) -> None:
    model, opt = _net()
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=2)
    trainer = ElasticTrainer(
        model, opt, data, _loss, cfg, coordinator="127.0.0.1:9", token="t", member_id="m"
    )
    torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
    with pytest.raises(WorkerExit) as e:
        next(trainer.steps())
    assert e.value.code == EXIT_MISCONFIGURED
    assert 'trainer.register("sched", sched)' in str(e.value.message)
    with pytest.raises(RuntimeError, match="before the loop"):
        trainer.register("sched", sched)


def test_register_refuses_what_cannot_travel() -> None:
    be, _, _ = _backend()

    class Opaque(Counter):
        def state_dict(self) -> dict[str, Any]:
            return {"fn": print}

    with pytest.raises(TypeError, match="builtin_function_or_method"):
        be.register("opaque", Opaque())
    with pytest.raises(ValueError, match="no '/'"):
        be.register("a/b", Counter())
    be.register("count", Counter())
    with pytest.raises(ValueError, match="already"):
        be.register("count", Counter())


# ---------------------------------------------------------------- jobs


def _records(job: Job | InProcessRun) -> dict[str, dict[int, dict[str, Any]]]:
    """member -> step -> what it logged after committing that step."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for f in sorted((job.run_dir / "loop").glob("*.jsonl")):
        out[f.stem] = {r["step"]: r for r in map(json.loads, f.read_text().splitlines())}
    return out


def _agree(recs: dict[str, dict[int, dict[str, Any]]], steps: int) -> dict[int, dict[str, Any]]:
    """Every member that committed a step logged the same values for it (a NaN norm
    compares by its text); returns one member's view of each step."""
    by_step: dict[int, dict[str, Any]] = {}
    for member, steps_of in recs.items():
        for s, r in steps_of.items():
            key = {k: v for k, v in r.items()}
            if s in by_step:
                assert json.dumps(by_step[s]) == json.dumps(key), (member, s, by_step[s], key)
            else:
                by_step[s] = key
    assert sorted(by_step) == list(range(steps))
    return by_step


STEPS, POISON = 30, 12
# With an evaluation every 10 steps (tests/test_evaluate.py compares its results).
LOOP_ARGS = [
    "--clip",
    "0.5",
    "--sched",
    "cosine",
    "--poison-step",
    str(POISON),
    "--eval-every",
    "10",
]
AMP_ARGS = ["--amp", "--sched", "cosine", "--min-step-s", "0.1"]


def reference_job(tmp_path_factory: pytest.TempPathFactory) -> InProcessRun:
    """The failure-free run of LOOP with LOOP_ARGS (the session's `loop_reference`
    fixture, shared with tests/test_evaluate.py): one member, trained in this process
    (`run_in_process`). Its records, loss curve, final parameters and evaluation
    equal a 3-worker job's bit for bit (checked), as the tests' jobs must."""
    return run_in_process(LOOP, tmp_path_factory.mktemp("loopref") / "ref", STEPS, LOOP_ARGS)


def _same_curve(a: Job | InProcessRun, b: Job) -> None:
    ca, cb = loss_curve(a.events), loss_curve(b.events)
    assert sorted(ca) == sorted(cb) == list(range(STEPS))
    for s in range(STEPS):
        assert repr(ca[s]) == repr(cb[s]), f"step {s}: {ca[s]!r} vs {cb[s]!r}"


def test_clipping_and_a_cosine_schedule_survive_a_kill_bit_for_bit(
    run_job: Callable[..., Job], loop_reference: InProcessRun
) -> None:
    # --min 3 with 3 workers: the job waits for the replacement, which is healed and
    # trains the rest (including the poisoned step) with its peers.
    job = run_job(
        script=LOOP,
        script_args=LOOP_ARGS,
        steps=STEPS,
        workers=3,
        min_workers=3,
        name="loopkill",
        points=[{"member": "w1", "step": 6, "phase": "compute", "action": "kill"}],
    )
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    assert job.of("heal_end", proc="w3", role="recv"), "the replacement was not healed"
    ref = _agree(_records(loop_reference), STEPS)
    got = _agree(_records(job), STEPS)
    # The replacement logged the same learning rate, state hash and grad norm as its
    # peers at every step it committed, and all equal the failure-free run's.
    assert min(_records(job)["w3"]) <= 8 and POISON in _records(job)["w3"]
    assert json.dumps(got) == json.dumps(ref)
    _same_curve(loop_reference, job)
    # Clipping happened (norms above 0.5) and the schedule moved the learning rate.
    assert any(r["grad_norm"] > 0.5 for r in got.values() if r["skipped"] is None)
    assert got[0]["lr"] > got[20]["lr"]
    # The poisoned step was skipped by every member alike: no update of the model or
    # the optimizer (the schedule still moved on), counted, and said in an event.
    assert [s for s, r in got.items() if r["skipped"]] == [POISON]
    assert got[POISON]["tensors"] == got[POISON - 1]["tensors"]
    assert got[POISON]["hash"] != got[POISON - 1]["hash"]
    skipped = job.of("step_skipped")
    assert {e["proc"] for e in skipped} == {"w0", "w2", "w3"}
    assert {(e["step"], e["reason"], e["skipped_total"]) for e in skipped} == {
        (POISON, "nonfinite", 1)
    }
    assert all(e["skipped"] == (e["step"] == POISON) for e in job.of("step_commit"))
    finals = [np.load(f) for f in sorted((job.run_dir / "final").glob("*.npy"))]
    assert len(finals) == 3 and all(np.array_equal(finals[0], f) for f in finals[1:])
    assert np.array_equal(finals[0], np.load(loop_reference.run_dir / "final" / "w0.npy"))


def test_grad_scaler_and_scheduler_travel_through_heal_and_resume(
    run_job: Callable[..., Job],
) -> None:
    # fp16 autocast with a GradScaler. w1 dies at step 6: its replacement w2 is healed.
    # Then every member dies once it committed step 17 (at the commit point, which no
    # peer's death can make a member miss, unlike a compute point): their replacements
    # resume from the checkpoint of step 10 and redo steps 10-17, the poisoned step 12
    # included. Every member waits after step 17 until the checkpoint of step 10 is
    # committed (rank 0 commits it in a background thread, which a loaded machine can
    # delay past the kill: then no checkpoint exists and the replacements start over).
    job = run_job(
        script=LOOP,
        script_args=[*AMP_ARGS, "--poison-step", str(POISON), "--await-checkpoint", "10@17"],
        steps=STEPS,
        workers=2,
        min_workers=2,
        checkpoint_every=10,
        name="loopamp",
        points=[
            {"member": "w1", "step": 6, "phase": "compute", "action": "kill"},
            *({"member": m, "step": 17, "phase": "commit", "action": "kill"} for m in ("w0", "w2")),
        ],
    )
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    assert job.of("heal_end", proc="w2", role="recv")
    resumed = {e["proc"]: e["step"] for e in job.of("checkpoint_loaded")}
    assert sorted(resumed) == ["w3", "w4"] and set(resumed.values()) == {10}
    recs = _records(job)
    assert POISON in recs["w2"] and min(recs["w3"]) == min(recs["w4"]) == 10
    # Steps 10-17 were logged by the members that died and by those that resumed:
    # the same learning rate, scale, state hash, grad norm (and 6-9 by the healed w2).
    got = _agree(recs, STEPS)
    assert [s for s, r in got.items() if r["skipped"]] == [POISON]
    assert {got[s]["scale"] for s in range(POISON)} == {2.0**10}
    assert {got[s]["scale"] for s in range(POISON, STEPS)} == {2.0**9}
    assert got[POISON]["tensors"] == got[POISON - 1]["tensors"]
    assert got[0]["lr"] > got[20]["lr"]

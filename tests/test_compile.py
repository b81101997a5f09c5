"""torch.compile (issue 17): a compiled model's state keeps the uncompiled model's
names, a replacement heals into a compiled model, and the trainer compiles it
before the member joins.

`BACKEND` is what torch.compile runs with: aot_eager by default (dynamo's graph
capture and AOTAutograd's compiled forward and backward, with eager kernels; a
few seconds here). Inductor works on this machine too (it needs a C++ compiler),
but compiling even this small MLP took ~100 s with a cold inductor cache on the
loaded 2-core machine (5 s warm), more than the suite can spend: run the file
with ELASTRAIN_TEST_COMPILE_BACKEND=inductor to test it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import TCPStore

from elastrain.observe.ledger import check_same_state
from elastrain.runtime.compiled import compile_now, is_compiled
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.engine import EXTRA_SLOTS
from elastrain.runtime.preflight import DDP_WRAPPED, model_problems
from elastrain.runtime.torch_backend import TorchBackend
from elastrain.runtime.trainer import ElasticTrainer
from elastrain.transfer import HealStats, TorchState, heal, model_signature, state_digest
from elastrain.transfer.flatten import flatten_state
from elastrain.transfer.names import named_parameters, state_name

from .conftest import ROOT, Job
from .test_transfer import run_threads

BACKEND = os.environ.get("ELASTRAIN_TEST_COMPILE_BACKEND", "aot_eager")
"""torch.compile's backend in these tests (see the module docstring)."""

LOOP = str(ROOT / "tests" / "scripts" / "train_loop.py")


class Net(nn.Module):
    """Dropout and batch norm: state a warm-up must not disturb (RNG, running stats)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Dropout(0.1))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def _net(seed: int = 0) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _loss(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(m(x), y)


def _batch(seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


def _backend(model: nn.Module, opt: torch.optim.Optimizer) -> TorchBackend:
    cfg = TrainerConfig(global_batch_size=8, micro_batch_size=8, total_steps=4, max_grad_norm=1.0)
    return TorchBackend(model, opt, _loss, cfg)


def _step(be: TorchBackend, step: int) -> None:
    be.begin_step(EXTRA_SLOTS)
    be.compute(step, 0, _batch(step), 8)
    be.apply()


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    be = _backend(model, opt)
    for s in range(steps):
        _step(be, s)


# ---------------------------------------------------------------- names (nothing compiles)


def test_a_compiled_model_keeps_the_uncompiled_names_signature_and_hash() -> None:
    model, opt = _net()
    _train(model, opt, 1)  # optimizer state too
    wrapped = torch.compile(model, backend=BACKEND)
    assert [k for k in wrapped.state_dict()][0].startswith("_orig_mod.")  # what torch says
    assert model_signature(wrapped) == model_signature(model)
    assert [n for n, _ in flatten_state(wrapped, opt).tensors] == [
        n for n, _ in flatten_state(model, opt).tensors
    ]
    assert state_digest(TorchState(wrapped, opt)) == state_digest(TorchState(model, opt))
    # A compiled submodule put back into its parent: the wrapper is mid-name.
    inner, _ = _net()
    inner.body = torch.compile(inner.body, backend=BACKEND)  # type: ignore[assignment]
    assert "body._orig_mod.0.weight" in inner.state_dict()
    assert model_signature(inner) == model_signature(model)
    assert list(named_parameters(inner)) == [n for n, _ in model.named_parameters()]
    assert is_compiled(wrapped) and is_compiled(inner) and not is_compiled(model)
    assert state_name("_orig_mod.body._orig_mod.0.weight") == "body.0.weight"


def test_a_name_that_collides_without_the_wrapper_is_refused() -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(2))
    model._orig_mod = nn.Module()  # type: ignore[assignment]
    model._orig_mod.w = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="both named 'w'"):
        model_signature(model)


def test_a_compiled_ddp_model_is_still_refused() -> None:
    class DistributedDataParallel(nn.Module):  # what preflight recognises, by its name
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert DDP_WRAPPED in model_problems(torch.compile(DistributedDataParallel(), backend=BACKEND))
    assert model_problems(torch.compile(nn.Linear(2, 2), backend=BACKEND)) == []


def test_a_model_compiled_in_place_cannot_be_sharded() -> None:
    """Sharded, ``torch.compile(model)`` is accepted (each replica group's FSDP2
    wrapper is compiled with its settings: tests/test_sharded_step.py runs it);
    ``model.compile()`` in place is refused before anything connects, with what
    to pass instead."""
    model, opt = _net()
    model.compile(backend=BACKEND)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=2, shard_size=2)
    with pytest.raises(ValueError, match=r"pass torch.compile\(model\) instead"):
        ElasticTrainer(
            model,
            opt,
            data,
            _loss,
            cfg,
            coordinator="127.0.0.1:9",
            token="t",
            member_id="m",
        )


# ---------------------------------------------------------------- compiled for real


@pytest.fixture(scope="module")
def compiled() -> tuple[nn.Module, Net, torch.optim.Optimizer]:
    """(compiled wrapper, its model, optimizer), compiled through the backend's warm-up.

    Inductor draws dropout masks with its own generator (seeded from torch's, so
    still a function of the seed), not eager's: compiled with eager's here, so that
    the step can be compared with the eager model's."""
    model, opt = _net(7)
    wrapped = torch.compile(model, backend=BACKEND)
    be = _backend(wrapped, opt)
    if BACKEND == "inductor":
        import torch._inductor.config as inductor_config

        with inductor_config.patch(fallback_random=True):
            be.warm_up(_batch(), EXTRA_SLOTS)
    else:
        be.warm_up(_batch(), EXTRA_SLOTS)
    return wrapped, model, opt


def test_warm_up_compiles_and_leaves_no_trace() -> None:
    model, _ = _net(5)
    calls: list[int] = []

    def counting(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        calls.append(1)
        return gm.forward

    model.compile(backend=counting)  # in place: no renaming, still seen as compiled
    assert is_compiled(model)
    model.eval()
    stats = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    compile_now(model, _loss, _batch())
    assert calls == [1], "the forward did not compile in the warm-up"
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(stats, model.buffers(), strict=True))
    assert torch.equal(rng, torch.get_rng_state())
    assert not model.training
    # The step compiles nothing more: the flat .grad views, the member's seeded RNG
    # and train mode are what the warm-up compiled for.
    be = _backend(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for s in range(2):
        _step(be, s)
    assert calls == [1]


def test_a_compiled_step_accumulates_into_the_flat_buffers(
    compiled: tuple[nn.Module, Net, torch.optim.Optimizer],
) -> None:
    wrapped, model, opt = compiled
    eager, eager_opt = _net(7)
    eager.load_state_dict(model.state_dict())
    eager_opt.load_state_dict(opt.state_dict())
    got, want = _backend(wrapped, opt), _backend(eager, eager_opt)
    for be in (got, want):
        be.begin_step(EXTRA_SLOTS)
        be.compute(0, 0, _batch(), 8)
    g, w = got.reduce_buffers()[0], want.reduce_buffers()[0]
    assert g.abs().sum() > 0, "the compiled backward did not write into the step's buffers"
    # A micro-batch's gradient depends on (seed, step, micro-batch) only, whatever the
    # RNG did before (the member that computes it does not matter).
    first = g.clone()
    torch.rand(100)
    got.begin_step(EXTRA_SLOTS)
    got.compute(0, 0, _batch(), 8)
    assert got.reduce_buffers()[0] is g and torch.equal(g, first)
    torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)  # inductor fuses; not bit-equal
    # (The parameters after AdamW's step are not compared: the bias before the batch
    # norm has a gradient of rounding noise, which Adam scales up to +-lr.)
    before = [p.detach().clone() for p in model.parameters()]
    u, v = got.apply(), want.apply()
    assert u.skipped is None and u.grad_norm == pytest.approx(v.grad_norm, rel=1e-4)
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    # FLOPs are counted on a compiled model too (it runs eagerly for the count).
    flops = got.count_flops(_batch(), 8, 8)["flops_per_step"]
    assert flops == want.count_flops(_batch(), 8, 8)["flops_per_step"] > 0


def test_heal_into_a_compiled_model_and_from_one(
    master_store: TCPStore, compiled: tuple[nn.Module, Net, torch.optim.Optimizer]
) -> None:
    # Rank 0 is an uncompiled member up to date, rank 1 the compiled replacement
    # (compiled and already run: its graphs hold the old weights' shapes, not values).
    wrapped, _, opt = compiled
    sender, sender_opt = _net(0)
    _train(sender, sender_opt, 3)
    want = state_digest(TorchState(sender, sender_opt))
    states = [TorchState(sender, sender_opt), TorchState(wrapped, opt)]

    def fn(rank: int, pg: Any) -> HealStats:
        return heal(pg, rank, [0], [1], states[rank], {}, 10.0)[1]

    res = run_threads(master_store, 2, fn)
    assert [type(r) for r in res] == [HealStats] * 2, res
    assert res[1].role == "recv" and res[1].bytes > 0
    assert state_digest(states[1]) == want
    sender.eval()
    wrapped.eval()
    x, _ = _batch(11)
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x), sender(x), rtol=1e-4, atol=1e-6)
    wrapped.train()
    # Back the other way: the compiled member sends, a fresh uncompiled one receives.
    fresh, fresh_opt = _net(9)
    states = [TorchState(wrapped, opt), TorchState(fresh, fresh_opt)]
    res = run_threads(master_store, 2, fn)
    assert [type(r) for r in res] == [HealStats] * 2, res
    assert state_digest(TorchState(fresh, fresh_opt)) == want


# ---------------------------------------------------------------- a job


def test_a_compiled_replacement_heals_in_a_job(run_job: Callable[..., Job]) -> None:
    # w0 trains uncompiled; w1 and its replacement w2 compile their model in place
    # (`model.compile()` after the trainer was built). w1 dies at step 2: w2 compiles
    # before it registers, is healed from w0, and they agree at every step after.
    job = run_job(
        script=LOOP,
        script_args=["--compile", BACKEND, "--compile-members", "w1,w2", "--sched", "cosine"],
        steps=6,
        workers=2,
        min_workers=2,
        name="compiled",
        points=[{"member": "w1", "step": 2, "phase": "compute", "action": "kill"}],
    )
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    assert job.of("heal_end", proc="w2", role="recv"), "the compiled replacement was not healed"
    assert f"compiled with {BACKEND}" in job.log("w2")
    assert "compiled with" not in job.log("w0")
    committed = {(e["proc"], e["step"]) for e in job.of("step_commit")}
    assert {("w0", 5), ("w2", 5)} <= committed

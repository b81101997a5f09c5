"""A sharded step with the loop of a real recipe (issue 41): the global gradient
norm, clipping, the non-finite skip, a `before_step` hook and a GradScaler.

The norm is defined row by row (`update.grad_norm`), so the rows' sums a
sharded member computes are the replicated member's; gathered over the
generation they give the replicated norm bit for bit, in any layout. The same
script (tests/scripts/train_sharded_step.py) runs replicated and as 2 x 2,
through a kill and a reshard: with float64 reductions the loss curves, the grad
norms and what the hook saw are bit-identical.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from elastrain.chaos.schedule import parse_fault
from elastrain.data import GlobalOrder, assign_rounds
from elastrain.launch.launcher import LaunchConfig, Launcher
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve
from elastrain.runtime.backend import SkipReason
from elastrain.runtime.shard_step import NormRows, StepFinish, norm_and_finite
from elastrain.runtime.sharded import shard_rows
from elastrain.runtime.update import grad_norm

from .conftest import REPLACE_AFTER_RESHARD_S, ROOT, FaultHold, Job, run_in_process

SCRIPT = str(ROOT / "tests" / "scripts" / "train_sharded_step.py")
B, SEED, DATASET = 24, 5, 2048
STEPS = 30
LOOP = ["--max-grad-norm", "0.05", "--hook", "--scaler-init", str(2.0**126)]
"""Clipping that bites (norms run 0.1-1), a hook that sets the learning rate and
skips every 9th step, and a GradScaler whose first scales overflow float32 in
some parameters' gradients but not others (the found-inf must be the model's)."""


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


# ---- the norm's rows: pure ---------------------------------------------------------


def _grads(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (37, 12), "b": (37,), "c": (), "d": (5, 3, 4), "e": (1, 9), "f": (111, 2)}
    return {n: torch.randn(s, generator=g) * 10 ** torch.randn((), generator=g) for n, s in
            shapes.items()}  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("twins", [1, 2, 3])
def test_any_layouts_rows_give_the_replicated_norm_bit_for_bit(size: int, twins: int) -> None:
    """Every shard of `size`, held by `twins` members of which the first writes:
    the sum of their vectors (the generation's all-reduce, in any order) gives
    `grad_norm` of the whole gradient, bit for bit."""
    full = _grads(size)
    want = grad_norm(list(full.values()))
    rows = {n: (t.shape[0] if t.dim() else 1) for n, t in full.items()}
    layout = NormRows(full, rows)
    total = torch.zeros(layout.size, dtype=torch.float64)
    for shard in range(size):
        mine, first = {}, {}
        for n, t in full.items():
            lo, hi = shard_rows(rows[n], size, shard)
            mine[n] = t.reshape(rows[n], *t.shape[1:])[lo:hi]
            first[n] = lo
        for twin in range(twins):
            v = torch.zeros(layout.size, dtype=torch.float64)
            if twin == 0:
                layout.fill(v, mine, first, None)
            total += v
    norm, finite = norm_and_finite(total)
    assert finite and norm.hex() == want.hex()


def test_a_non_finite_element_in_one_shard_is_every_members_verdict() -> None:
    full = _grads(1)
    full["d"][4, 2, 1] = float("inf")
    full["a"][3, 3] = float("nan")
    rows = {n: (t.shape[0] if t.dim() else 1) for n, t in full.items()}
    layout = NormRows(full, rows)
    total = torch.zeros(layout.size, dtype=torch.float64)
    for shard in range(2):
        mine = {n: t.reshape(rows[n], *t.shape[1:])[slice(*shard_rows(rows[n], 2, shard))]
                for n, t in full.items()}  # fmt: skip
        v = torch.zeros(layout.size, dtype=torch.float64)
        layout.fill(v, mine, {n: shard_rows(rows[n], 2, shard)[0] for n in full}, None)
        total += v
    norm, finite = norm_and_finite(total)
    assert not finite and float(total[0]) == 2.0 and norm != norm  # nan


def test_the_scaler_skips_and_backs_off_on_the_models_found_inf_not_the_rows() -> None:
    """This member's rows are finite, another shard's are not: the step is skipped
    and the scale backs off, as on that other shard's members."""
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    finish = StepFinish(1.0, scaler, None, None)
    finish.ready_scale()
    p.grad = torch.full((3,), 2048.0)
    finish.unscale([p.grad])
    assert p.grad.tolist() == [2.0, 2.0, 2.0]
    vector = torch.tensor([1.0, 4.0, 4.0, 4.0], dtype=torch.float64)  # one bad element elsewhere
    update = finish.finish([p], opt, vector)
    assert update.skipped == SkipReason.NONFINITE and p.tolist() == [1.0, 1.0, 1.0]
    assert scaler.get_scale() == 512.0
    finish.ready_scale()
    p.grad = torch.full((3,), 512.0)
    finish.unscale([p.grad])
    update = finish.finish([p], opt, torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64))
    assert update.skipped is None and update.grad_norm == 3**0.5
    # Clipped to norm 1 (coefficient 1 / (sqrt(3) + 1e-6)) and stepped.
    assert torch.allclose(p.detach(), torch.full((3,), 1.0 - 1.0 / (3**0.5 + 1e-6)))


# ---- the backend against the replicated one, in two processes ----------------------


def _hook_log(out: list[str]) -> Any:
    from elastrain.runtime.update import Decision, StepGrads

    def hook(g: StepGrads) -> Decision | None:
        out.append(f"{g.step} {g.grad_norm.hex()} {g.finite} {g.clipped}")
        return Decision.SKIP if g.step == 2 else None

    return hook


def _init_scale(autocast: torch.dtype | None) -> float:
    """A first scale that overflows (float32 gradients: in some parameters only);
    fp16 activations overflow at far smaller scales: one that overflows once it
    has grown (growth_interval 2)."""
    return 2.0**12 if autocast == torch.float16 else 2.0**126


def _autocast(loss_fn: Any, dtype: torch.dtype | None) -> Any:
    if dtype is None:
        return loss_fn

    def loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(model, batch)

    return loss


def _backend_worker(
    rank: int, port: int, q: Any, compiled: bool = False, autocast: torch.dtype | None = None
) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import torch.distributed as dist
    from train_sharded import Net, Regression, loss_fn

    from elastrain.runtime.config import TrainerConfig
    from elastrain.runtime.sharded import ShardedBackend, open_replica_group

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if compiled:
        # aot_eager: dynamo and AOTAutograd without a C++ compiler (inductor takes
        # minutes on a busy 2-core machine); the sharding does not depend on it.
        model = torch.compile(model, backend="aot_eager")
    cfg = TrainerConfig(
        global_batch_size=B, micro_batch_size=3, total_steps=5, shard_size=2, max_grad_norm=0.05
    )
    seen: list[str] = []
    step = [0]
    sb = ShardedBackend(
        model,
        opt,
        _autocast(loss_fn, autocast),
        cfg,
        grad_scaler=torch.amp.GradScaler(
            "cpu", init_scale=_init_scale(autocast), growth_interval=2
        ),
        before_step=_hook_log(seen),
        step_index=lambda: step[0],
    )
    sb.place(rank)
    sb.form_group(
        ("a", "b"),
        lambda: open_replica_group(store, "r0", rank, 2, connect_timeout_s=60, op_timeout_s=60),
    )
    data = Regression()
    norms = []
    for step[0] in range(5):
        sb.begin_step(2)
        for i in assign_rounds(B // 3, 1, 0, 2, rank):
            assert i is not None
            ids = expected_ids(step[0])[i * 3 : (i + 1) * 3]
            batch = torch.utils.data.default_collate([data[j] for j in ids])
            sb.compute(step[0], i, batch, 3)
        # One replica group, no twins: the generation is the group.
        v = sb.norm_vector(writes=True)
        dist.all_reduce(v)
        u = sb.apply()
        norms.append((u.grad_norm, u.skipped))
    params = {n: p.detach().numpy().copy() for n, p in sb.local.named_parameters()}
    if compiled:
        from torch._dynamo.eval_frame import OptimizedModule
        from torch._dynamo.utils import counters

        assert isinstance(sb._call, OptimizedModule) and sb._call._orig_mod is sb.model
        assert counters["stats"]["unique_graphs"] >= 1  # dynamo compiled graphs of it
    q.put((rank, params, norms, seen))
    sb.leave_group()


def _replicated_reference(
    autocast: torch.dtype | None,
) -> tuple[dict[str, torch.Tensor], list[Any], list[str]]:
    """The replicated backend's 5 steps of `_backend_worker`'s loop: rows, (norm,
    skipped) per step, what the hook saw."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from train_sharded import Net, Regression, loss_fn

    from elastrain.runtime.config import TrainerConfig
    from elastrain.runtime.torch_backend import TorchBackend

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    seen: list[str] = []
    step = [0]
    try:
        torch.manual_seed(0)
        model = Net()
        cfg = TrainerConfig(
            global_batch_size=B, micro_batch_size=3, total_steps=5, max_grad_norm=0.05
        )
        tb = TorchBackend(
            model,
            torch.optim.AdamW(model.parameters(), lr=3e-3),
            _autocast(loss_fn, autocast),
            cfg,
            grad_scaler=torch.amp.GradScaler(
                "cpu", init_scale=_init_scale(autocast), growth_interval=2
            ),
            before_step=_hook_log(seen),
            step_index=lambda: step[0],
        )
        data = Regression()
        want_norms = []
        for step[0] in range(5):
            tb.begin_step(2)
            for i in range(B // 3):
                ids = expected_ids(step[0])[i * 3 : (i + 1) * 3]
                tb.compute(step[0], i, torch.utils.data.default_collate([data[j] for j in ids]), 3)
            u = tb.apply()
            want_norms.append((u.grad_norm, u.skipped))
    finally:
        torch.set_num_threads(threads)
    full = {n.replace(".", "/"): p.detach() for n, p in model.named_parameters()}
    return full, want_norms, seen


def _two_members(compiled: bool, autocast: torch.dtype | None) -> dict[int, Any]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_backend_worker, args=(r, store.port, q, compiled, autocast))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = {r: rest for r, *rest in (q.get(timeout=300) for _ in procs)}
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


@pytest.mark.parametrize(
    ("compiled", "autocast"),
    [(False, None), (True, None), (False, torch.bfloat16), (False, torch.float16)],
    ids=["eager", "compiled", "bf16-autocast", "fp16-autocast"],
)
def test_a_one_by_two_step_is_the_replicated_step_bit_for_bit(
    compiled: bool, autocast: torch.dtype | None
) -> None:
    """Two members as one replica group of 2, with clipping, a GradScaler whose first
    scales overflow and a hook that skips step 2: the same norms, skips, hook
    inputs and AdamW rows as the (eager) replicated backend, bit for bit; also
    when the script passed ``torch.compile(model)`` (each member's FSDP2 wrapper
    compiled with its settings), and with the loss under bf16 or fp16 autocast
    (the replicated reference under the same autocast)."""
    full, want_norms, seen = _replicated_reference(autocast)
    # A scale overflowed somewhere (float32 gradients: the first; fp16: after it
    # grew), other steps ran, one was the hook's skip.
    reasons = {s for _, s in want_norms}
    assert reasons == {None, SkipReason.NONFINITE, SkipReason.HOOK}
    got = _two_members(compiled, autocast)
    for shard in range(2):
        params, norms, hook_seen = got[shard]
        assert [(repr(n), s) for n, s in norms] == [(repr(n), s) for n, s in want_norms]
        assert hook_seen == seen
        for name, want in full.items():
            lo, hi = shard_rows(want.shape[0], 2, shard)
            assert torch.equal(torch.from_numpy(params[name]), want[lo:hi]), (name, shard)


def test_a_model_compiled_in_place_is_refused_with_what_to_pass() -> None:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from train_sharded import Net, loss_fn

    from elastrain.runtime.config import TrainerConfig
    from elastrain.runtime.sharded import ShardedBackend

    model = Net()
    model.blocks[0].compile()
    cfg = TrainerConfig(global_batch_size=B, micro_batch_size=3, total_steps=1, shard_size=2)
    with pytest.raises(ValueError, match=r"pass torch.compile\(model\) instead"):
        ShardedBackend(model, torch.optim.AdamW(model.parameters()), loss_fn, cfg)


# ---- whole jobs --------------------------------------------------------------------


def _run(tmp: Path, name: str, shard_size: int | None, args: list[str], **kw: Any) -> Job:
    """A 4-member job of the script; with ``released``, its steps are held 1 s each
    from its fault (the first status poll whose events show the `fault_injected`)
    until ``released(events)`` (a replacement has to arrive while it runs)."""
    released = kw.pop("released", None)
    pace = tmp / f"{name}.pace"
    run_dir = tmp / name
    hold = None
    if released is not None:
        args = [*args, "--pace-file", str(pace)]
        hold = FaultHold(pace, "1.0", released)

    def watch(st: dict[str, Any]) -> None:
        if hold is not None:
            hold.poll(read_events(run_dir))

    cfg = LaunchConfig(
        script=SCRIPT,
        script_args=args,
        workers=4,
        steps=kw.pop("steps", STEPS),
        shard_size=shard_size,
        run_dir=str(run_dir),
        progress=False,
        extra_env={"PYTHONPATH": str(ROOT)},
        **kw,
    )
    la = Launcher(cfg, on_status=watch)
    try:
        return Job(la, la.run())
    finally:
        pace.unlink(missing_ok=True)


def _norms(job: Job | InProcess) -> dict[int, str]:
    """Each committed step's grad norm (repr), checked equal on every member."""
    out: dict[int, str] = {}
    for e in job.of("step_commit"):
        got = repr(e.get("grad_norm"))
        assert out.setdefault(e["step"], got) == got, (e["step"], out[e["step"]], got)
    return out


@dataclass
class InProcess:
    """A failure-free run of the script as one member in this process
    (`run_in_process`), with what it printed (its log)."""

    events: list[dict[str, Any]]
    printed: str

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())
        ]


def _in_process(run_dir: Path, args: list[str]) -> InProcess:
    """The replicated failure-free run, one member trained in this process: its
    gradients are the same exact float64 sums of the same micro-batch gradients as
    any replicated job's, so its curve, norms, skips and hook inputs are a 4-member
    replicated job's bit for bit."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # the script's prints: its hook's lines
        ref = run_in_process(SCRIPT, run_dir, STEPS, args)
    assert check_same_state(ref.events) == []
    led = check_exactly_once(ref.events, expected_ids)
    assert led.violations == [] and led.committed_steps == STEPS
    return InProcess(ref.events, out.getvalue())


def _logs(run: Job | InProcess) -> list[tuple[str, str]]:
    """(member, log) of every member of a job, or of the one in-process member."""
    if isinstance(run, InProcess):
        return [("w0", run.printed)]
    return [(m, run.log(m)) for m in {e["member"] for e in run.of("worker_spawned")}]


def _hooks(job: Job | InProcess) -> dict[int, str]:
    """What the hook saw per step, on every member that applied it."""
    out: dict[int, str] = {}
    for m, log in _logs(job):
        for step, rest in re.findall(r"^hook (\d+) (.*)$", log, re.M):
            # The number of parameters differs (a shard's vs the model's): not compared.
            seen = rest.rsplit(" ", 1)[0]
            assert out.setdefault(int(step), seen) == seen, (m, step, out[int(step)], seen)
    return out


@pytest.fixture(scope="module")
def loop_ref(tmp_path_factory: pytest.TempPathFactory) -> InProcess:
    return _in_process(tmp_path_factory.mktemp("loop") / "ref", LOOP)


def _assert_same(job: Job, ref: InProcess) -> None:
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    led = check_exactly_once(job.events, expected_ids)
    assert led.violations == [] and led.committed_steps == STEPS
    a, b = loss_curve(ref.events), loss_curve(job.events)
    assert [a[s].hex() for s in range(STEPS)] == [b[s].hex() for s in range(STEPS)]
    assert _norms(job) == _norms(ref)
    assert _hooks(job) == _hooks(ref)
    skipped = {(e["step"], e["reason"]) for e in job.of("step_skipped")}
    assert skipped == {(e["step"], e["reason"]) for e in ref.of("step_skipped")}


def test_the_reference_loop_clips_skips_and_scales(loop_ref: InProcess) -> None:
    """The replicated reference exercises what the sharded runs must equal: clipped
    steps, overflowed steps skipped (the scale backing off), the hook's skips."""
    hooks = _hooks(loop_ref)
    assert len(hooks) == STEPS
    assert any(h.endswith("True True") for h in hooks.values())  # finite and clipped
    assert any(" False " in h for h in hooks.values())  # an overflowed scale
    reasons = {e["reason"] for e in loop_ref.of("step_skipped")}
    assert reasons == {"nonfinite", "hook"}


def test_two_by_two_runs_the_loop_exactly_as_the_replicated_job(
    tmp_path: Path, loop_ref: InProcess
) -> None:
    _assert_same(_run(tmp_path, "2x2", 2, LOOP), loop_ref)


def test_the_loop_through_a_kill_and_heal_is_the_failure_free_one(
    tmp_path: Path, loop_ref: InProcess
) -> None:
    """Kill a rank of 2 x 2 at step 6: its group-mate is a shadow (it applies the
    clipped update from the gathered norm without computing), the replacement is
    healed its shard and the scaler's state from its twin."""
    job = _run(
        tmp_path,
        "kill",
        2,
        LOOP,
        faults=[parse_fault("kill@6:w1")],
        released=lambda ev: any(e["kind"] == "heal_end" and e["role"] == "recv" for e in ev),
    )
    _assert_same(job, loop_ref)
    assert job.of("heal_end", role="recv")


def test_the_loop_through_a_reshard_is_the_failure_free_one(
    tmp_path: Path, loop_ref: InProcess
) -> None:
    """2 x 2 -> 1 x 3 in memory (no replacement in time) and back: the norm does not
    depend on who holds which rows, so clipping and skips are the same."""
    job = _run(
        tmp_path,
        "reshard",
        2,
        LOOP,
        faults=[parse_fault("kill@5:w1")],
        reshard_after_s=0.5,
        replace_delay_s=REPLACE_AFTER_RESHARD_S,
        released=lambda ev: any(e["kind"] == "reshard_end" and e["new_size"] == 2 for e in ev),
    )
    _assert_same(job, loop_ref)
    sizes = [e.get("shard_size") for e in job.of("generation_ready")]
    assert 3 in sizes, sizes


# ---- FLOPs ---------------------------------------------------------------------------


def test_a_sharded_member_counts_the_jobs_flops_without_the_full_model() -> None:
    """The sharded count (on a meta-device copy) is the replicated member's count of
    the same model and batch; the model given is left untouched."""
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    from train_sharded import Net, Regression, loss_fn

    from elastrain.runtime.config import TrainerConfig
    from elastrain.runtime.sharded import ShardedBackend
    from elastrain.runtime.torch_backend import TorchBackend

    data = Regression()
    batch = torch.utils.data.default_collate([data[i] for i in range(3)])
    torch.manual_seed(0)
    model = Net()
    cfg = TrainerConfig(global_batch_size=B, micro_batch_size=3, total_steps=1)
    want = TorchBackend(model, torch.optim.AdamW(model.parameters()), loss_fn, cfg).count_flops(
        batch, 3, B
    )
    sharded = Net()
    before = {n: p.detach().clone() for n, p in sharded.named_parameters()}
    sb = ShardedBackend(
        sharded,
        torch.optim.AdamW(sharded.parameters()),
        loss_fn,
        TrainerConfig(global_batch_size=B, micro_batch_size=3, total_steps=1, shard_size=2),
    )
    got = sb.count_flops(batch, 3, B)
    assert got is not None and want["flops_per_step"] > 0
    for k in ("flops_per_step", "flops_per_microbatch", "flops_per_sample", "device_key"):
        assert got[k] == want[k], k
    assert all(torch.equal(p, before[n]) for n, p in sharded.named_parameters())
    assert all(p.grad is None for p in sharded.parameters())

    def reads_a_value(model: torch.nn.Module, batch: Any) -> torch.Tensor:
        loss = loss_fn(model, batch)
        return loss * float(loss.item() > 0)

    sb.loss_fn = reads_a_value
    assert sb.count_flops(batch, 3, B) is None


def test_a_step_rolled_forward_is_clipped_and_scaled_as_where_it_committed(
    tmp_path: Path, loop_ref: InProcess
) -> None:
    """Three members of 2 x 2 lose the answer of step 8's commit vote (one shard's
    twins both among them); the fourth commits it. The three apply the step they
    kept (its gradient and its gathered norm vector) at the next heal: the same
    clipping, hook decision and scaler update, so the run is the replicated one
    bit for bit."""
    import json

    lost = ("w0", "w1", "w2")
    points = [{"member": w, "step": 8, "phase": "vote", "action": "fail"} for w in lost]
    job = _run(tmp_path, "vote", 2, LOOP, fault_points=json.dumps(points))
    _assert_same(job, loop_ref)
    rolled = job.of("step_rolled_forward")
    assert sorted(e["proc"] for e in rolled) == list(lost)
    # The hook ran for step 8 on the three too, when they applied it, with the same inputs.
    for m in lost:
        assert re.search(r"^hook 8 ", job.log(m), re.M), m


def test_native_reductions_clip_within_1e_6_of_the_exact_run(tmp_path: Path) -> None:
    """reduce_dtype "native" (float32 sums, FSDP2's own accumulation) with clipping
    and the hook, 2 x 2, against the replicated float64 run: not bit for bit (the
    float32 sums round differently), within 1e-6 (max abs) on the loss curve and
    1e-6 (relative) on every grad norm; the hook's decisions are the same."""
    args = ["--max-grad-norm", "0.05", "--hook"]
    ref = _in_process(tmp_path / "exact", args)
    job = _run(tmp_path, "native", 2, [*args, "--reduce-dtype", "native"])
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    a, b = loss_curve(ref.events), loss_curve(job.events)
    diff = max(abs(a[s] - b[s]) for s in range(STEPS))
    print(f"native 2x2 vs float64 replicated, clipped: max abs loss difference {diff:.3g}")
    assert diff <= 1e-6
    na, nb = _norms(ref), _norms(job)
    assert sorted(na) == sorted(nb) == list(range(STEPS))
    for s in range(STEPS):
        assert abs(float(na[s]) - float(nb[s])) <= 1e-6 * float(na[s]), (s, na[s], nb[s])
    assert {e["step"] for e in job.of("step_skipped")} == {e["step"] for e in ref.of(
        "step_skipped")}  # fmt: skip

"""Durable checkpoints in the trainer, in-process: schedule agreement, who commits,
resume install, the coordinator's preemption verdict. Fast; no worker processes."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from elastrain.checkpoint import latest_verified, load
from elastrain.checkpoint.files import MARKER, step_dir
from elastrain.checkpoint.manager import Checkpointing, failed_marker, mark_failed
from elastrain.checkpoint.policy import Schedule
from elastrain.checkpoint.restore import (
    Loaded,
    RestoreRefused,
    RestoreSource,
    ResumeError,
    from_ordered_json,
    install_checkpoint,
    load_resume,
    ordered_json,
    parse_resume,
    resolve_directory,
)
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer
from elastrain.observe.events import EventLog, read_events
from elastrain.runtime.config import TrainerConfig
from elastrain.transfer import TorchState, state_hash
from elastrain.transfer.flatten import flatten_state


def cfg(**kw: Any) -> TrainerConfig:
    return TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=10, **kw)


def trained(seed: int = 0, steps: int = 2) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).mean().backward()
        opt.step()
    return model, opt


def state_fn(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> Any:
    def fn() -> tuple[dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
        flat = flatten_state(model, opt)
        meta = {"committed": n, "optimizer": ordered_json(flat.section)}
        return dict(flat.tensors), meta, flat.stable

    return fn


# ---- schedule ------------------------------------------------------------------


def test_fixed_schedule_is_a_pure_function_of_the_step() -> None:
    s = Schedule(every=5, mtbf_s=None)
    assert [n for n in range(1, 21) if s.due(n)] == [5, 10, 15, 20]
    assert not Schedule(every=0, mtbf_s=None).due(5)


def test_the_last_step_always_takes_a_checkpoint_when_checkpoints_are_periodic() -> None:
    # A 23-step job checkpointing every 5 steps ends with step 23's state on disk
    # (what `elastrain export` and a rerun read), not step 20's.
    assert Schedule(every=5, mtbf_s=None).due(23, final=True)
    automatic = Schedule(every=0, mtbf_s=3600.0)
    automatic.plan(1)
    automatic.taken(1)
    automatic.next = 601
    assert not automatic.due(23) and automatic.due(23, final=True)
    # No periodic checkpoints asked for: none at the end either.
    assert not Schedule(every=0, mtbf_s=None).due(23, final=True)


def test_automatic_schedule_bootstraps_then_follows_young_daly() -> None:
    s = Schedule(every=0, mtbf_s=3600.0)
    first = s.plan(1)
    assert first is not None and first.interval_steps == 0 and "first checkpoint" in first.reason
    assert s.due(1)
    s.taken(1)
    # The next all-reduce brings the members' mean save cost and step time.
    s.absorb([2 * 0.5, 2.0, 2 * 0.1, 2.0, 0.0, 0.0, 0.0])  # two members: 0.5 s save, 0.1 s steps
    choice = s.plan(2)
    assert choice is not None
    want_s = math.sqrt(2 * 3600 * 0.5)  # 60 s
    assert choice.interval_s == pytest.approx(want_s)
    assert choice.interval_steps == round(want_s / 0.1) == 600
    assert "Young/Daly" in choice.reason and "600 steps" in choice.reason
    assert s.next == 1 + 600 and not s.due(600) and s.due(601)
    # The same interval chosen again is not announced again.
    s.taken(601)
    s.absorb([1.0, 2.0, 0.2, 2.0, 0.0, 0.0, 0.0])
    assert s.step_s == pytest.approx(0.1)  # 0.8 x 0.1 + 0.2 x 0.1
    assert s.plan(602) is None and s.next == 1201


def test_automatic_schedule_when_saves_cost_more_than_the_mtbf() -> None:
    s = Schedule(every=3, mtbf_s=10.0, cost_s=20.0, step_s=1.0)
    c = s.plan(3)
    assert c is not None and c.interval_steps == 10 and "does not apply" in c.reason


def test_schedule_is_agreed_state_that_travels_in_meta() -> None:
    a = Schedule(every=0, mtbf_s=100.0, last=7, cost_s=0.2, step_s=0.05, interval_steps=40)
    b = Schedule(every=0, mtbf_s=100.0)
    b.load_json(a.to_json())
    assert b == a


def test_contribution_counts_only_real_measurements(tmp_path: Path) -> None:
    ck = Checkpointing(cfg().checkpoint, str(tmp_path), EventLog(None, "w0"), "w0")
    assert ck.contribution() == [0.0] * 7
    ck.note_step_time(0.25)
    assert ck.contribution() == [0.0, 0.0, 0.25, 1.0, 0.0, 0.0, 0.0]
    ck.note_generation("failure")
    since, since_n, failed = ck.contribution()[4:]
    assert since >= 0.0 and since_n == 1.0 and failed == 1.0
    ck.absorb([0.0, 0.0, 0.25, 1.0, since, 1.0, 1.0])
    assert ck.contribution()[6] == 0.0  # counted once, by the step that committed
    assert ck.schedule.failures == 1 and ck.schedule.elapsed_s == pytest.approx(since)
    ck.note_generation("join")
    assert ck.contribution()[6] == 0.0


def test_observed_failures_shorten_the_automatic_interval() -> None:
    s = Schedule(every=0, mtbf_s=3600.0, cost_s=0.5, step_s=0.1)
    quiet = s.plan(1)
    assert quiet is not None and quiet.mtbf_s == 3600.0 and "0 failure(s)" in quiet.reason
    s.taken(quiet.next_step)
    # Three members, each 10 s since its previous commit; one flagged a failure.
    for _ in range(3):
        s.absorb([0.0, 0.0, 0.3, 3.0, 30.0, 3.0, 1.0])
    assert s.failures == 3 and s.elapsed_s == pytest.approx(30.0)
    c = s.plan(quiet.next_step)
    assert c is not None
    assert c.mtbf_s == pytest.approx((3600 + 30) / 4)
    assert c.interval_steps < quiet.interval_steps
    assert "3 failure(s) observed" in c.reason and c.failures == 3
    # No failures for a long time: the estimate grows again.
    s.taken(c.next_step)
    s.absorb([0.0, 0.0, 0.1, 1.0, 20_000.0, 1.0, 0.0])
    assert s.mtbf_estimate() == pytest.approx((3600 + 20_030) / 4)


def test_config_rejects_bad_checkpoint_settings() -> None:
    with pytest.raises(ValueError, match="checkpoint_every must be >= 0"):
        cfg(checkpoint_every=-1)
    with pytest.raises(ValueError, match="checkpoint_mtbf_s"):
        cfg(checkpoint_mtbf_s=0.0)
    with pytest.raises(ValueError, match="checkpoint_keep_last"):
        cfg(checkpoint_keep_last=0)


def test_ordered_json_keeps_dict_order_through_sorted_json() -> None:
    import json

    v = {"step": 1, "exp_avg": {"$tensor": "x"}, "b": [{"z": 1, "a": (2, 3)}], "a": None}
    back = from_ordered_json(json.loads(json.dumps(ordered_json(v), sort_keys=True)))
    assert back == {"step": 1, "exp_avg": {"$tensor": "x"}, "b": [{"z": 1, "a": [2, 3]}], "a": None}
    assert list(back) == list(v) and list(back["b"][0]) == ["z", "a"]


def test_directory_resolution_and_resume_modes() -> None:
    assert resolve_directory("/c", "/launcher", "/run") == "/launcher"
    assert resolve_directory("/c", None, "/run") == "/c"
    assert resolve_directory(None, None, "/run") == "/run/checkpoints"
    assert resolve_directory(None, None, None) is None
    assert parse_resume(None, "none") == "none"
    assert parse_resume("latest", "none") == "latest"
    assert parse_resume("12", "none") == 12
    with pytest.raises(ValueError, match="ELASTRAIN_RESUME"):
        parse_resume("newest", "none")


# ---- saving and committing, two members in one process ----------------------------


def members_save(
    tmp_path: Path, n: int, ranks: list[int], timeout_s: float = 30.0
) -> tuple[list[Checkpointing], nn.Module, torch.optim.Optimizer]:
    model, opt = trained()
    c = cfg(checkpoint_every=5, checkpoint_commit_timeout_s=timeout_s, checkpoint_fsync=False)
    cks = [
        Checkpointing(c.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, f"w{r}"), f"w{r}")
        for r in (0, 1)
    ]
    for r in ranks:
        assert cks[r].save_due(n, r)
        cks[r].save(n, 3, ["w0", "w1"], r, state_fn(model, opt, n))
    return cks, model, opt


def test_every_member_writes_its_stripe_and_rank0_commits(tmp_path: Path) -> None:
    cks, model, opt = members_save(tmp_path, 5, [1, 0])
    for ck in cks:
        ck.close()
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.step == 5 and ckpt.num_shards == 2
    assert ckpt.members == ["w0", "w1"] and ckpt.generation == 3
    ev = read_events(tmp_path)
    saved = [e for e in ev if e["kind"] == "checkpoint_saved"]
    assert sorted(e["shard"] for e in saved) == [0, 1]
    assert all(e["blocking_s"] > 0 for e in saved)
    (done,) = [e for e in ev if e["kind"] == "checkpoint_committed"]
    assert done["proc"] == "w0" and done["step"] == 5 and done["blocking_s"] > 0
    # Not due: nothing happens.
    assert not cks[0].save_due(6, 0)


def test_save_due_answers_before_anything_is_snapshotted(tmp_path: Path) -> None:
    """The engine's first question: `save_due` writes nothing and marks a due step
    taken; only `save` writes, so nothing is built for a step that is not due."""
    model, opt = trained()
    c = cfg(checkpoint_every=5, checkpoint_fsync=False)
    ck = Checkpointing(c.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, "w0"), "w0")
    assert not ck.save_due(4, 0)
    assert ck.save_due(5, 0)
    assert latest_verified(tmp_path / "ck") is None  # the answer wrote nothing
    assert ck.schedule.last == 5
    ck.save(5, 1, ["w0"], 0, state_fn(model, opt, 5))
    assert not ck.save_due(6, 0)
    assert ck.save_due(7, 0, final=True)  # the last step, off the interval
    ck.close()
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.step == 5


def test_a_missing_member_never_yields_a_complete_checkpoint(tmp_path: Path) -> None:
    cks, _, _ = members_save(tmp_path, 5, [0], timeout_s=0.3)  # w1 died before its snapshot
    t0 = time.monotonic()
    for ck in cks:
        ck.close()
    assert time.monotonic() - t0 < 10
    assert latest_verified(tmp_path / "ck") is None
    assert not (step_dir(tmp_path / "ck", 5) / MARKER).exists()
    (failed,) = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_failed"]
    assert failed["phase"] == "commit" and "shard-00001-of-00002.json" in failed["error"]


def test_a_member_reporting_failure_makes_rank0_give_up_at_once(tmp_path: Path) -> None:
    # w1's write failed (e.g. ENOSPC): it leaves the empty failure marker.
    mark_failed(str(tmp_path / "ck"), 5, 1, 2, 3)
    cks, _, _ = members_save(tmp_path, 5, [0], timeout_s=120)
    t0 = time.monotonic()
    cks[0].close()
    assert time.monotonic() - t0 < 10, "rank 0 waited for a shard that was reported failed"
    assert latest_verified(tmp_path / "ck") is None
    (failed,) = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_failed"]
    assert failed["phase"] == "commit" and "reported that their write failed" in failed["error"]
    # A marker of another generation (a stale one) is not taken for this one.
    assert (
        failed_marker(str(tmp_path / "ck"), 5, 1, 2, 4).name == "shard-00001-of-00002.gen-4.failed"
    )


def test_emergency_checkpoint_waits_until_committed(tmp_path: Path) -> None:
    model, opt = trained()
    c = cfg(checkpoint_fsync=False)  # no periodic checkpoints: emergency only
    cks = [
        Checkpointing(c.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, f"w{r}"), f"w{r}")
        for r in (0, 1)
    ]
    deadline = time.monotonic() + 30
    results: dict[int, bool] = {}
    threads = [
        threading.Thread(
            target=lambda r=r: results.__setitem__(
                r, cks[r].emergency(7, 2, ["w0", "w1"], r, state_fn(model, opt, 7), deadline)
            )
        )
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True}
    # Rank 0 returned only after the commit marker was durable.
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.step == 7
    for ck in cks:
        ck.close()


# ---- resume ------------------------------------------------------------------------


def test_resume_installs_bit_identical_state(tmp_path: Path) -> None:
    cks, model, opt = members_save(tmp_path, 10, [0, 1])
    for ck in cks:
        ck.close()
    got = load_resume(str(tmp_path / "ck"), 10)
    assert got is not None
    ckpt, tensors, meta = got
    fresh, fresh_opt = trained(seed=1, steps=1)
    assert state_hash(fresh, fresh_opt) != state_hash(model, opt)
    section = from_ordered_json(meta["optimizer"])
    install_checkpoint(TorchState(fresh, fresh_opt), tensors, section, str(ckpt.path))
    # Bit for bit, and in the same order (the next checkpoint's layout depends on it).
    assert state_hash(fresh, fresh_opt) == state_hash(model, opt)
    assert [n for n, _ in flatten_state(fresh, fresh_opt).tensors] == [
        n for n, _ in flatten_state(model, opt).tensors
    ]
    assert meta["committed"] == 10
    # "latest" finds the same one; a step that is not the newest is an error.
    latest = load_resume(str(tmp_path / "ck"), "latest")
    assert latest is not None and latest[0].step == 10
    with pytest.raises(RuntimeError, match="chose checkpoint step 5"):
        load_resume(str(tmp_path / "ck"), 5)
    assert load_resume(str(tmp_path / "ck"), "none") is None


def test_resume_into_a_different_model_is_refused_clearly(tmp_path: Path) -> None:
    cks, _, _ = members_save(tmp_path, 5, [0, 1])
    for ck in cks:
        ck.close()
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None
    tensors, meta = load(ckpt)
    other = nn.Sequential(nn.Linear(4, 9), nn.Tanh(), nn.Linear(9, 2))
    other_opt = torch.optim.Adam(other.parameters())
    before = [t.clone() for t in other.state_dict().values()]
    with pytest.raises(ResumeError, match="does not fit this model") as e:
        section = from_ordered_json(meta["optimizer"])
        install_checkpoint(TorchState(other, other_opt), tensors, section, str(ckpt.path))
    assert str(ckpt.path) in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, other.state_dict().values(), strict=True))


# ---- the coordinator's preemption verdict ---------------------------------------------


class FakeTarget:
    """A worker side that records what the manager asked it to install."""

    def __init__(self, framework: str = "torch", order_ok: bool = True) -> None:
        self.framework = framework
        self.order_ok = order_ok
        self.installed: list[tuple[int, dict[str, torch.Tensor]]] = []
        self.plain_installed: list[str] = []

    def restore_problem(self, ckpt: Any) -> str | None:
        return None

    def order_problem(self, order: Any) -> str | None:
        return None if self.order_ok else f"trained on {order}, this job differs"

    def restore(self, ckpt: Any, tensors: Any, meta: dict[str, Any], loaded: Loaded) -> int | None:
        self.installed.append((ckpt.step, tensors))
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def read_plain(self, directory: str, wanted: int | None) -> tuple[int, Any]:
        if not Path(directory).is_dir():
            raise ValueError(f"{directory} is not a DCP checkpoint directory")

        def install(loaded: Loaded) -> None:
            self.plain_installed.append(directory)
            loaded(123, 0.01)

        return 40, install


def test_the_manager_restores_the_newest_verified_state_or_refuses_clearly(
    tmp_path: Path,
) -> None:
    cks, model, opt = members_save(tmp_path, 10, [0, 1])
    for ck in cks:
        ck.close()
    ck = Checkpointing(cfg().checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, "r"), "r")
    target = FakeTarget()
    got = ck.restore("latest", target)
    assert got is not None and got.source is RestoreSource.CHECKPOINT and got.step == 10
    assert got.meta is not None and got.meta["committed"] == 10
    assert got.meta["data"]["order"] in ("randperm", "feistel")
    assert [s for s, _ in target.installed] == [10]
    loaded = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_loaded"]
    assert [(e["step"], e["generation"]) for e in loaded] == [(10, 3)] and loaded[0]["bytes"] > 0
    # A standby's refresh takes only a newer one; "none" takes nothing.
    assert ck.restore("latest", FakeTarget(), newer_than=10) is None
    assert ck.restore("latest", FakeTarget(), newer_than=9) is not None
    assert ck.restore("none", FakeTarget()) is None
    # Another framework's checkpoint, or another data order, is refused with why.
    with pytest.raises(RestoreRefused, match="written by a torch job, this is jax"):
        ck.restore("latest", FakeTarget(framework="jax"))
    with pytest.raises(RestoreRefused, match="cannot be resumed: trained on"):
        ck.restore("latest", FakeTarget(order_ok=False))
    # With no checkpoint, a plain directory given as the source; a bad one is refused.
    empty = Checkpointing(cfg().checkpoint, str(tmp_path / "none"), EventLog(tmp_path, "p"), "p")
    plain = FakeTarget()
    got = empty.restore("latest", plain, plain=(str(tmp_path / "ck"), None))
    assert got is not None and got.source is RestoreSource.PLAIN and got.step == 40
    assert got.meta is None and plain.plain_installed == [str(tmp_path / "ck")]
    with pytest.raises(RestoreRefused, match="--resume-from: .* is not a DCP"):
        empty.restore("latest", FakeTarget(), plain=(str(tmp_path / "missing"), None))

    # A model or optimizer that is not the checkpoint's is refused, not a traceback.
    class OtherModel(FakeTarget):
        def restore(self, ckpt: Any, tensors: Any, meta: Any, loaded: Loaded) -> int | None:
            raise ResumeError(f"checkpoint {ckpt.path} does not fit this model: w is [3, 4]")

    with pytest.raises(RestoreRefused, match="does not fit this model"):
        ck.restore("latest", OtherModel())
    # A checkpoint there wins over the plain source.
    assert ck.restore("latest", FakeTarget(), plain=(str(tmp_path / "ck"), None)).source is (
        RestoreSource.CHECKPOINT
    )


def test_preemption_is_decided_once_per_step_for_every_member(tmp_path: Path) -> None:
    srv = CoordinatorServer(
        CoordinatorConfig(target=2, min_members=2), "tok", run_dir=str(tmp_path)
    )
    srv.start()
    try:
        c = CoordinatorClient(srv.address, "tok")
        sig: list[Any] = [["w", [2], "torch.float32"]]
        for m in ("w0", "w1"):
            c.register(p.RegisterRequest(m, 1, "h", sig))
        out: dict[str, p.RendezvousResponse] = {}
        ts = [
            threading.Thread(
                target=lambda m=m: out.__setitem__(
                    m, c.rendezvous(p.RendezvousRequest(m, 1, 0, 4, wait_s=10))
                )
            )
            for m in ("w0", "w1")
        ]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        gen = out["w0"].gen
        assert out["w0"].status == "ready" and out["w0"].start_step == 4

        def ask(m: str, step: int) -> p.QuorumResponse:
            return c.quorum(p.QuorumRequest(m, 1, gen, step))

        assert ask("w0", 4).preempt_s == 0.0
        assert c.preempt(p.PreemptRequest(20.0)).ok
        # w1 asks about the step already decided: same answer as w0 got.
        assert ask("w1", 4) == p.QuorumResponse("proceed", gen, 0.0)
        a, b = ask("w0", 5), ask("w1", 5)
        assert a.verdict == b.verdict == "proceed"
        assert 0 < a.preempt_s <= 20 and 0 < b.preempt_s <= 20
        assert c.status()["preempting"] is True
        assert any(e["kind"] == "preempt_notice" for e in read_events(tmp_path))
        c.close()
    finally:
        srv.stop()


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--ckpt-every", "-1"], "--ckpt-every must be >= 0"),
        (["--ckpt-mtbf", "0"], "--ckpt-mtbf must be a number of seconds > 0"),
        (["--grace", "0"], "--grace must be > 0"),
    ],
)
def test_bad_checkpoint_cli_arguments_are_clear_errors(
    args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrain.cli import main

    from .conftest import MLP

    assert main(["run", *args, MLP]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err

"""The member protocol, in-process: the pure state machine, and the step engine
driven against a scripted coordinator, process group, heal and backend.

No processes and no sockets: each test is one member (the engine under test)
whose peers are simulated by the fakes (the fake group completes the step's
sums as if the peers had computed their micro-batches). The multi-process
tests (test_elastic.py, test_chaos.py, ...) check the same paths for real.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import elastrain.transfer.landing as landing
from elastrain.checkpoint import latest_verified, load
from elastrain.checkpoint import replicated_parts as replicated_parts_module
from elastrain.checkpoint import restore as restore_module
from elastrain.checkpoint.deferred import DeferredCopy
from elastrain.checkpoint.files import MARKER, list_steps
from elastrain.checkpoint.writer import CheckpointWriter
from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorRefused, CoordinatorUnavailable
from elastrain.data import GlobalOrder, OrderKind, step_microbatches
from elastrain.exitcodes import (
    EXIT_DEVICE_POISONED,
    EXIT_LEFT,
    EXIT_MISCONFIGURED,
    EXIT_PREEMPTED,
    EXIT_REFUSED,
    EXIT_STATE_TORN,
    WorkerExit,
)
from elastrain.observe.events import read_events
from elastrain.runtime import engine as engine_module
from elastrain.runtime import healing as healing_module
from elastrain.runtime import hooks
from elastrain.runtime import member as m
from elastrain.runtime import rendezvous as rendezvous_module
from elastrain.runtime import replicas as replicas_module
from elastrain.runtime.config import TrainerConfig, WorkerEnv
from elastrain.runtime.engine import StepEngine, StepResult
from elastrain.transfer import HealError, HealStats, TornHeal

G = 8  # global batch
MB = 2  # micro-batch
LR = 0.001
DATA = 64

# ---- the pure protocol ------------------------------------------------------------


def ready(gen: int, members: tuple[str, ...], committed: dict[str, int], **kw: Any) -> Any:
    return m.RendezvousAnswer(
        p.RendezvousStatus.READY,
        gen,
        members,
        committed,
        kw.get("commit_gens", {}),
        kw.get("start_step", max(committed.values())),
    )


def joined(proto: m.MemberProtocol, gen: int = 1, peers: tuple[str, ...] = ("b",)) -> m.Action:
    """Drive `proto` (member "a") into COMPUTE of a fresh generation; returns that action."""
    proto.advance(m.Started())
    a = proto.advance(m.Registered(1))
    assert a.do is m.Do.RENDEZVOUS
    members = ("a", *peers)
    committed = dict.fromkeys(members, proto.committed)
    a = proto.advance(ready(gen, members, committed))
    assert a.do is m.Do.CONNECT and a.rank == 0
    a = proto.advance(m.Connected())
    assert a.do is m.Do.HEAL and a.receivers == ()
    a = proto.advance(m.Healed(proto.committed))
    assert a.do is m.Do.COMPUTE
    return a


def test_a_step_commits_only_with_the_full_sample_count() -> None:
    proto = m.MemberProtocol("a", total_steps=3, global_batch_size=G)
    a = joined(proto)
    assert proto.advance(m.Computed()).do is m.Do.VERDICT
    assert proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1)).do is m.Do.REDUCE
    a = proto.advance(m.Reduced(G - 1))
    assert a.do is m.Do.ABANDON and a.phase is m.AbortPhase.ALLREDUCE
    assert "expected 8" in a.error
    assert proto.committed == 0
    assert proto.advance(m.Abandoned()).do is m.Do.RENDEZVOUS


def test_commits_until_total_steps_then_finishes() -> None:
    proto = m.MemberProtocol("a", total_steps=2, global_batch_size=G)
    joined(proto)
    for step in range(2):
        proto.advance(m.Computed())
        proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1))
        a = proto.advance(m.Reduced(G))
        assert a.do is m.Do.APPLY and a.step == step
        a = proto.advance(m.Applied(step + 1, 0.0))
    assert a.do is m.Do.FINISH and proto.committed == 2 and proto.commit_gen == 1


def test_an_unreachable_coordinator_means_proceed_unless_leaving() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    assert proto.advance(m.Unreachable("quorum", "refused")).do is m.Do.REDUCE
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    a = proto.advance(m.Unreachable("quorum", "refused"), m.Flags(leaving=True))
    assert a.do is m.Do.EXIT and a.code == EXIT_LEFT


def test_a_restarted_coordinator_is_registered_with_and_asked_again() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    a = proto.advance(m.VerdictSeen(p.Verdict.UNKNOWN, 1, 1))
    assert a.do is m.Do.REGISTER_AGAIN and a.incarnation == 1
    a = proto.advance(m.Registered(2))
    assert a.do is m.Do.ASK_AGAIN and a.incarnation == 2
    assert proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 2, 2)).do is m.Do.REDUCE
    # Asked again and still not "proceed": the generation is abandoned, no loop.
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.UNKNOWN, 1, 1))
    proto.advance(m.Registered(2))
    a = proto.advance(m.VerdictSeen(p.Verdict.UNKNOWN, 2, 2))
    assert a.do is m.Do.ABANDON and a.phase is m.AbortPhase.QUORUM


def test_an_answer_about_a_stale_incarnation_is_asked_again() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    # The heartbeat thread registered again (incarnation 3) while the question
    # about incarnation 1 was in flight.
    a = proto.advance(m.VerdictSeen(p.Verdict.EXPELLED, 1, 3))
    assert a.do is m.Do.ASK_AGAIN and a.incarnation == 3


def test_a_leave_takes_effect_at_a_step_boundary() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    a = proto.advance(m.VerdictSeen(p.Verdict.REGROUP, 1, 1), m.Flags(leaving=True))
    assert a.do is m.Do.EXIT and a.reason is m.ExitReason.LEFT
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Superseded())
    a = proto.advance(m.Abandoned(), m.Flags(leaving=True))
    assert a.do is m.Do.EXIT and a.code == EXIT_LEFT


def test_preemption_rides_on_proceed_then_checkpoint_then_exit() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1, preempt_s=30.0))
    a = proto.advance(m.Reduced(G))
    assert a.do is m.Do.APPLY and a.grace_s == 30.0
    a = proto.advance(m.Applied(1, 30.0))
    assert a.do is m.Do.EMERGENCY_CHECKPOINT and a.step == 1 and a.grace_s == 30.0
    a = proto.advance(m.CheckpointWritten(True))
    assert a.do is m.Do.EXIT and a.code == EXIT_PREEMPTED


def test_expelled_registers_again_before_asking_for_a_generation() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto)
    proto.advance(m.Superseded())
    a = proto.advance(m.Abandoned(), m.Flags(expelled=True))
    assert a.do is m.Do.REGISTER_AGAIN and a.incarnation is None
    assert proto.advance(m.Registered(2)).do is m.Do.RENDEZVOUS
    a = proto.advance(m.RendezvousAnswer(p.RendezvousStatus.EXPELLED))
    assert a.do is m.Do.REGISTER_AGAIN
    a = proto.advance(m.Refused("model mismatch"))
    assert a.do is m.Do.EXIT and a.code == EXIT_REFUSED


def test_the_zombie_commit_is_healed_not_trusted() -> None:
    # c completed step 9 in gen 4 after a and b had abandoned it and re-ran it in gen 5.
    senders, receivers, lineage = m.heal_roles(
        ("a", "b", "c", "d"),
        {"a": 10, "b": 10, "c": 10, "d": 0},
        {"a": 5, "b": 5, "c": 4, "d": 0},
        10,
    )
    assert (senders, receivers, lineage) == ((0, 1), (2, 3), 5)
    proto = m.MemberProtocol("c", total_steps=20, global_batch_size=G)
    proto.resumed(10)
    proto.commit_gen = 4
    proto.advance(m.Started())
    proto.advance(m.Registered(1))
    proto.advance(
        ready(6, ("a", "b", "c"), {"a": 10, "b": 10, "c": 10}, commit_gens={"a": 5, "b": 5, "c": 4})
    )
    a = proto.advance(m.Connected())
    assert a.do is m.Do.HEAL and a.rank == 2 and a.receivers == (2,) and a.lineage == 5
    proto.advance(m.Healed(10, received=True))
    assert proto.committed == 10 and proto.commit_gen == 5


def test_connect_previews_the_heals_roles_so_the_root_can_prepare() -> None:
    """The CONNECT action names the heal's senders and receivers (what
    `Topology.prepare_heal` reads while the group is built): the same as the HEAL
    action's that follows."""
    proto = m.MemberProtocol("a", total_steps=20, global_batch_size=G)
    proto.resumed(10)
    proto.advance(m.Started())
    proto.advance(m.Registered(1))
    c = proto.advance(ready(6, ("a", "b", "c"), {"a": 10, "b": 10, "c": 4}))
    assert c.do is m.Do.CONNECT and c.rank == 0 and c.step == 10
    h = proto.advance(m.Connected())
    assert h.do is m.Do.HEAL
    assert (c.senders, c.receivers) == (h.senders, h.receivers) == ((0, 1), (2,))


def _reduced_then_lost(proto: m.MemberProtocol) -> None:
    """Member "a" of generation 1 at 0 commits step 0, then in step 1 reduces its
    shard over its twins and loses the commit vote's answer."""
    joined(proto, gen=1)
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1))
    proto.advance(m.Reduced(G))
    proto.advance(m.Applied(1, 0.0))
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1))
    a = proto.advance(m.ReduceAborted(m.AbortPhase.ALLREDUCE, "vote lost", kept=True))
    assert a.do is m.Do.ABANDON and proto.pending_gen == 1 and proto.committed == 1
    a = proto.advance(m.Abandoned())
    assert a.do is m.Do.RENDEZVOUS


def test_a_kept_step_is_applied_when_the_new_generation_says_it_committed() -> None:
    """b committed step 1 in generation 1; a lost the vote's answer and kept its
    shard's reduced gradient: told to roll forward, it counts the step at once (a
    failed heal after it must not leave the count behind the state), in b's lineage."""
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    _reduced_then_lost(proto)
    a = proto.advance(
        m.RendezvousAnswer(
            p.RendezvousStatus.READY, 2, ("a", "b"), {"a": 2, "b": 2}, {"a": 1, "b": 1}, 2,
            rolls_forward=("a",),
        )
    )  # fmt: skip
    assert a.do is m.Do.CONNECT and a.senders == a.receivers == ()  # its state will change
    a = proto.advance(m.Connected())
    assert a.do is m.Do.HEAL and a.roll_forward and a.step == 2 and a.receivers == ()
    assert (proto.committed, proto.commit_gen, proto.pending_gen) == (2, 1, 0)
    a = proto.advance(m.HealFailed("a sender died"))
    a = proto.advance(m.Abandoned())
    assert a.do is m.Do.RENDEZVOUS and a.step == 2 and proto.pending_gen == 0


def test_a_kept_step_nobody_committed_is_dropped_and_run_again() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    _reduced_then_lost(proto)
    proto.advance(ready(2, ("a", "b"), {"a": 1, "b": 1}, commit_gens={"a": 1, "b": 1}))
    a = proto.advance(m.Connected())
    assert a.do is m.Do.HEAL and not a.roll_forward and a.step == 1
    assert proto.pending_gen == 0
    a = proto.advance(m.Healed(1))
    assert a.do is m.Do.COMPUTE and a.step == 1


def test_a_roll_forward_without_a_kept_step_is_a_bug() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    joined(proto, gen=1)
    proto.advance(m.Computed())
    proto.advance(m.VerdictSeen(p.Verdict.PROCEED, 1, 1))
    proto.advance(m.ReduceAborted(m.AbortPhase.ALLREDUCE, "peer died"))
    proto.advance(m.Abandoned())
    assert proto.pending_gen == 0
    proto.advance(
        m.RendezvousAnswer(
            p.RendezvousStatus.READY, 2, ("a", "b"), {"a": 1, "b": 1}, {"a": 1, "b": 1}, 1,
            rolls_forward=("a",),
        )
    )  # fmt: skip
    with pytest.raises(m.ProtocolError, match="holding no step kept"):
        proto.advance(m.Connected())


def test_a_connect_failure_asks_for_a_newer_generation() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    proto.advance(m.Started())
    proto.advance(m.Registered(1))
    proto.advance(ready(3, ("a", "b"), {"a": 0, "b": 0}))
    a = proto.advance(m.ConnectFailed("timeout"))
    assert a.do is m.Do.RENDEZVOUS and a.gen == 3


def test_observations_out_of_place_are_bugs() -> None:
    proto = m.MemberProtocol("a", total_steps=5, global_batch_size=G)
    with pytest.raises(m.ProtocolError):
        proto.advance(m.Reduced(G))


# ---- the engine against fakes ---------------------------------------------------------


def step_ids(order: GlobalOrder, step: int) -> list[int]:
    return [i for mb in step_microbatches(step, G, MB) for i in order.ids(mb.start, mb.stop)]


def truth(steps: int) -> float:
    """The parameter of the failure-free run after `steps` steps (exact float64 arithmetic)."""
    order = GlobalOrder(DATA, 0, shuffle=True)
    w = torch.tensor([1.0], dtype=torch.float64)
    for s in range(steps):
        w -= LR * (torch.tensor([float(sum(step_ids(order, s)))], dtype=torch.float64) / G)
    return float(w[0])


@dataclass
class FakeFlat:
    tensors: list[tuple[str, torch.Tensor]]
    section: dict[str, Any]
    stable: frozenset[str] = frozenset({"w"})  # only apply writes w: copied in the background


class FakeState:
    kind = "fake"

    def __init__(self, backend: FakeBackend) -> None:
        self.backend = backend

    def steady(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def manifest_limit(self) -> int:
        return 1 << 20

    def expected_layout(self) -> None:
        return None  # a receiver's preparation lays nothing out (`PreparedReceive`)

    def flatten(self) -> FakeFlat:
        return FakeFlat([("w", self.backend.w)], {})

    def landing_estimate(self) -> list[tuple[str, int]]:
        return [("model/w", 4 << 20)]  # two huge pages: a section the reserve maps


class FakeBackend:
    """One float64 parameter; micro-batch gradient = sum of its sample ids; loss 1 per sample."""

    framework = "torch"
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.w = torch.tensor([1.0], dtype=torch.float64)
        self.buf: torch.Tensor | None = None
        self.extra = 0
        self.computed: list[tuple[int, int]] = []

    def signature(self) -> list[list[Any]]:
        return [["w", [1], "float64"]]

    def state(self) -> FakeState:
        return FakeState(self)

    def adopt(self, state: Any) -> None:
        pass

    def state_hash(self) -> str:
        return repr(float(self.w[0]))

    def meta(self) -> dict[str, Any]:
        return {}

    def load_meta(self, meta: dict[str, Any]) -> None:
        pass

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        pass

    def problems(self) -> list[str]:
        return []

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> None:
        return None

    def begin_step(self, extra_slots: int) -> None:
        self.extra = extra_slots
        self.buf = torch.zeros(1 + extra_slots, dtype=torch.float64)

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        assert self.buf is not None
        self.buf[0] += float(sum(batch))
        self.computed.append((step, microbatch))
        return float(samples)

    def reduce_buffers(self) -> list[torch.Tensor]:
        assert self.buf is not None
        return [self.buf]

    def extras(self) -> torch.Tensor:
        assert self.buf is not None
        return self.buf[-self.extra :]

    def apply(self) -> None:
        assert self.buf is not None
        self.w -= LR * (self.buf[:1] / G)

    def discard(self) -> None:
        self.buf = None


def wait_until(pred: Callable[[], bool], timeout_s: float = 5.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout_s / 0.005)):
        if pred():
            return
        done.wait(0.005)
    raise AssertionError("condition not reached")


class FakeWork:
    def __init__(self, mode: str, release: threading.Event) -> None:
        self.mode = mode
        self.release = release

    def wait(self, timeout: Any = None) -> bool:
        if self.mode == "error":
            raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        if self.mode == "hang":
            self.release.wait()
            raise RuntimeError("peer dropped the group")
        return True


class FakeGroup:
    """Completes the step's sums as the simulated peers would (every micro-batch of the
    step once), unless the harness scripted this generation's all-reduce to fail."""

    def __init__(self, h: Harness, gen: int) -> None:
        self.h, self.gen = h, gen
        # A new generation: the simulated peers dropped their old groups, which
        # ends any all-reduce still pending on them.
        h.release.set()
        h.release = threading.Event()

    def allreduce(self, tensors: list[torch.Tensor]) -> FakeWork:
        t = tensors[0]
        step = self.h.engine.committed
        mode = self.h.reduce_modes.pop((self.gen, step), "ok")
        if mode == "ok":
            t[0] = float(sum(step_ids(self.h.engine.feed.order, step)))
            t[-self.h.backend.extra] = float(G)  # loss sum: 1 per sample
            t[-self.h.backend.extra + 1] = float(G)  # sample count
        if mode == "hang":
            self.h.on_reduce_hang(self.gen)
        return FakeWork(mode, self.h.release)


@dataclass
class FakeCoordinator:
    """A scripted coordinator client. `generations` lists the generations it forms,
    in order: (members, committed, commit_gens). Verdicts are "proceed" unless
    `verdicts[(gen, step)]` says otherwise; `down` makes every call unreachable."""

    me: str
    generations: list[tuple[tuple[str, ...], dict[str, int], dict[str, int]]]
    verdicts: dict[tuple[int, int], Any] = field(default_factory=dict)
    rendezvous_script: list[p.RendezvousResponse] = field(default_factory=list)
    timeout_s: float = 5.0
    down: bool = False
    incarnation: int = 0
    progress_step: int = 0
    """What `register` says the job's progress is."""
    registrations: int = 0
    gen: int = 0
    broken: int = 0
    left: list[str] = field(default_factory=list)
    exits: list[int] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def register(self, req: p.RegisterRequest) -> p.RegisterResponse:
        if self.down:
            raise CoordinatorUnavailable("connection refused")
        if req.signature != [["w", [1], "float64"]]:
            raise CoordinatorRefused(409, "model_mismatch", "the model does not match the job's")
        self.registrations += 1
        self.incarnation += 1
        return p.RegisterResponse(
            self.incarnation, "127.0.0.1", 1, "job", 0.02, progress_step=self.progress_step
        )

    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse:
        with self.cond:
            self.cond.wait_for(lambda: bool(req.gen) and self.broken >= req.gen, req.wait_s)
            if req.gen and self.broken >= req.gen:
                return p.HeartbeatResponse(p.HeartbeatStatus.CHANGED, self.gen)
        return p.HeartbeatResponse(p.HeartbeatStatus.OK, self.gen)

    def break_gen(self, gen: int) -> None:
        with self.cond:
            self.broken = max(self.broken, gen)
            self.cond.notify_all()

    def rendezvous(self, req: p.RendezvousRequest) -> p.RendezvousResponse:
        if self.down:
            raise CoordinatorUnavailable("connection refused")
        if self.rendezvous_script:
            return self.rendezvous_script.pop(0)
        if not self.generations:
            return p.RendezvousResponse(p.RendezvousStatus.FINISHED)
        members, committed, commit_gens = self.generations.pop(0)
        self.gen += 1
        return p.RendezvousResponse(
            p.RendezvousStatus.READY,
            self.gen,
            list(members),
            committed,
            max(committed.values()),
            reason="start" if self.gen == 1 else "failure",
            commit_gens=commit_gens,
        )

    def quorum(self, req: p.QuorumRequest) -> p.QuorumResponse:
        if self.down:
            raise CoordinatorUnavailable("connection refused")
        v = self.verdicts.pop((req.gen, req.step), p.Verdict.PROCEED)
        if callable(v):
            v = v(req)
        if isinstance(v, p.QuorumResponse):
            return v
        return p.QuorumResponse(v, req.gen)

    def leave(self, req: p.LeaveRequest) -> p.OkResponse:
        self.left.append(req.reason)
        return p.OkResponse()

    def exit(self, req: p.ExitRequest) -> p.OkResponse:
        self.exits.append(req.returncode)
        return p.OkResponse()

    def close(self) -> None:
        pass


class Harness:
    def __init__(
        self,
        tmp: Path,
        generations: list[tuple[tuple[str, ...], dict[str, int], dict[str, int]]],
        *,
        total_steps: int = 6,
        heal: Callable[..., tuple[dict[str, Any], HealStats]] | None = None,
        dataset: Any = None,
        **config: Any,
    ) -> None:
        self.coord = FakeCoordinator("a", generations)
        self.backend = FakeBackend()
        self.release = threading.Event()
        self.reduce_modes: dict[tuple[int, int], str] = {}
        self.heals: list[tuple[str, int]] = []
        self.on_reduce_hang: Callable[[int], None] = lambda gen: None
        self.tmp = tmp
        self.engine = StepEngine(
            self.backend,  # type: ignore[arg-type]
            list(range(DATA)) if dataset is None else dataset,
            lambda xs: xs,
            TrainerConfig(
                global_batch_size=G,
                micro_batch_size=MB,
                total_steps=total_steps,
                initial_hang_timeout_s=10.0,
                **config,
            ),
            WorkerEnv(member="a", run_dir=str(tmp), token="secret"),
            client=self.coord,  # type: ignore[arg-type]
            groups=lambda gen, rank, size: FakeGroup(self, gen),
            heal_fn=heal or self.heal_from_truth,
        )

    def heal_from_truth(
        self,
        pg: Any,
        rank: int,
        senders: list[int],
        receivers: list[int],
        state: Any,
        *a: Any,
        **kw: Any,
    ) -> tuple[dict[str, Any], HealStats]:
        """Receivers get the failure-free state at the generation's start step."""
        start = max(self.coord_committed.values())
        role = "send" if rank in senders else "recv" if rank in receivers else "idle"
        self.heals.append((role, start))
        if role == "recv":
            state.backend.w = torch.tensor([truth(start)], dtype=torch.float64)
            return {"committed": start, "last_loss": 1.0}, HealStats(role, 8, 0.0, ())
        return {}, HealStats(role, 8, 0.0, ())

    @property
    def coord_committed(self) -> dict[str, int]:
        assert self.engine.ctx.links.ready is not None
        return self.engine.ctx.links.ready.committed

    def run(self) -> list[StepResult]:
        try:
            return list(self.engine.steps())
        finally:
            self.release.set()

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in read_events(self.tmp) if e["kind"] == kind]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("ELASTRAIN_METERING", "off")
    old = signal.getsignal(signal.SIGTERM)
    hooks.clear()
    yield
    hooks.clear()
    signal.signal(signal.SIGTERM, old)


TWO = ("a", "b")


def gen_of(members: tuple[str, ...], at: int, **commit_gens: int) -> Any:
    return (members, dict.fromkeys(members, at), {k: commit_gens.get(k, 0) for k in members})


def test_a_clean_run_matches_the_failure_free_parameter(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)])
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert float(h.backend.w[0]) == truth(6)
    assert h.coord.left == ["done"]
    assert [e["reason"] for e in h.events("worker_exit")] == ["done"]


def test_a_peer_killed_during_compute_supersedes_the_generation(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(("a", "c"), 2, a=1, c=1)])
    orig = h.backend.compute

    def compute(step: int, mb: int, batch: Any, samples: int) -> float:
        if step == 2 and h.coord.gen == 1:
            h.coord.break_gen(1)  # b was killed: the coordinator breaks generation 1
            wait_until(lambda: h.engine.session.gen_broken(1))
        return orig(step, mb, batch, samples)

    h.backend.compute = compute  # type: ignore[method-assign]
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert [r.gen for r in results] == [1, 1, 2, 2, 2, 2]
    assert [e["phase"] for e in h.events("step_abort")] == ["superseded"]
    assert float(h.backend.w[0]) == truth(6)


def test_prefetched_batches_are_replanned_when_membership_changes(tmp_path: Path) -> None:
    """Two steps prefetched on a background thread. Generation 1 (a, b) breaks in
    step 2; in generation 2 (c, a) `a` is rank 1: what it prefetched as rank 0
    is dropped, and every step it commits holds exactly its micro-batches' ids."""
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(("c", "a"), 2, a=1, c=1)], prefetch_steps=2)
    orig = h.backend.compute
    fed: list[tuple[int, int, int, list[int]]] = []

    def compute(step: int, mb: int, batch: Any, samples: int) -> float:
        if step == 2 and h.coord.gen == 1:
            h.coord.break_gen(1)
            wait_until(lambda: h.engine.session.gen_broken(1))
        fed.append((h.coord.gen, step, mb, list(batch)))
        return orig(step, mb, batch, samples)

    h.backend.compute = compute  # type: ignore[method-assign]
    results = h.run()
    assert [r.gen for r in results] == [1, 1, 2, 2, 2, 2]
    order = h.engine.feed.order
    for gen, step, mb, batch in fed:
        pos = step_microbatches(step, G, MB)[mb]
        assert batch == order.ids(pos.start, pos.stop)
        assert mb in ([0, 1] if gen == 1 else [2, 3])
    contribs = {(e["gen"], e["step"]): e["samples"] for e in h.events("step_contrib")}
    for r in results:
        mine = [0, 1] if r.gen == 1 else [2, 3]
        want = [
            i for mb in mine for i in order.ids(r.step * G + mb * MB, r.step * G + (mb + 1) * MB)
        ]
        assert contribs[(r.gen, r.step)] == want
    assert h.engine.feed.loader.dropped >= 2  # rank 0's micro-batches of steps 3 and 4
    assert float(h.backend.w[0]) == truth(6)
    assert not [t for t in threading.enumerate() if t.name.startswith("elastrain-data")]


class Positions:
    """A replayable stream whose sample at position k is k."""

    def iter_from(self, position: int) -> Iterator[int]:
        return iter(range(position, 10**9))


def test_a_stream_is_consumed_by_position_once_across_a_membership_change(
    tmp_path: Path,
) -> None:
    h = Harness(
        tmp_path,
        [gen_of(TWO, 0), gen_of(("c", "a"), 2, a=1, c=1)],
        dataset=Positions(),
        prefetch_steps=1,
    )
    h.reduce_modes[(1, 2)] = "error"
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    contribs = {(e["gen"], e["step"]): e["samples"] for e in h.events("step_contrib")}
    for r in results:
        # Rank 0 of gen 1 computes positions [0, 4) of the step's window, rank 1 of
        # gen 2 positions [4, 8): the stream's own order, no shuffle.
        lo = r.step * G + (0 if r.gen == 1 else G // 2)
        assert contribs[(r.gen, r.step)] == list(range(lo, lo + G // 2))


def test_a_checkpoint_keeps_its_sample_order(tmp_path: Path, monkeypatch: Any) -> None:
    first = Harness(tmp_path, [gen_of(("a",), 0)])
    first.coord.verdicts[(1, 2)] = p.QuorumResponse(p.Verdict.PROCEED, 1, preempt_s=20.0)
    with pytest.raises(WorkerExit):
        first.run()
    ckpt = latest_verified(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.step == 3
    assert load(ckpt)[1]["data"] == {"order": "feistel", "position": [3, 3 * G]}
    # The fake state has no manifest to check: install the checkpoint's tensor as is.
    monkeypatch.setattr(
        replicated_parts_module,
        "install_checkpoint",
        lambda state, tensors, section, where: state.backend.w.copy_(tensors["w"]),
    )
    # A config that asks for another order is refused, with what to set.
    other = Harness(tmp_path, [gen_of(("a",), 3)], checkpoint_every=100, sample_order="randperm")
    with pytest.raises(WorkerExit) as e:
        other.run()
    assert e.value.code == EXIT_MISCONFIGURED
    assert "sample_order='feistel'" in e.value.message
    # A checkpoint written before orders were recorded resumes on randperm.
    real = restore_module.load_resume

    def from_before(*args: Any) -> Any:
        got = real(*args)
        assert got is not None
        del got[2]["data"]
        return got

    monkeypatch.setattr(restore_module, "load_resume", from_before)
    old = Harness(tmp_path, [gen_of(("a",), 3)], checkpoint_every=100)
    results = old.run()
    assert [r.step for r in results] == [3, 4, 5]
    assert old.engine.feed.order.kind is OrderKind.RANDPERM
    randperm = GlobalOrder(DATA, 0, kind="randperm")
    (c,) = [e for e in old.events("step_contrib") if e["step"] == 3 and e["proc"] == "a"]
    assert c["samples"] == randperm.ids(3 * G, 4 * G)


def test_a_checkpoint_holds_its_step_though_the_next_one_ran_before_its_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No copier thread: the deferred copy of w happens only when the engine settles
    # the state's readers, which it must do before the next step's apply writes w.
    monkeypatch.setattr(DeferredCopy, "start", lambda self: None)
    h = Harness(tmp_path, [gen_of(("a",), 0)], checkpoint_every=3, checkpoint_keep_last=5)
    h.run()
    d = tmp_path / "checkpoints"
    steps = [s for s, path in list_steps(d) if (path / MARKER).exists()]
    assert 3 in steps  # the first is never skipped; 6 may be (3 still writing)
    for s in reversed(steps):
        ckpt = latest_verified(d)
        assert ckpt is not None and ckpt.step == s
        tensors, meta = load(ckpt)
        assert meta["committed"] == s and float(tensors["w"][0]) == truth(s)
        shutil.rmtree(ckpt.path)  # the older one is the newest then
    saved = h.events("checkpoint_saved")
    assert saved and all(e["blocking_s"] > 0 for e in saved)


def test_a_peer_killed_during_the_allreduce_abandons_and_retries_the_step(
    tmp_path: Path,
) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(("a", "c"), 3, a=1, c=1)])
    h.reduce_modes[(1, 3)] = "error"
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    aborts = h.events("step_abort")
    assert [(e["phase"], e["step"]) for e in aborts] == [("allreduce", 3)]
    assert float(h.backend.w[0]) == truth(6)  # step 3 applied once, not twice


def test_a_superseded_generation_interrupts_a_hung_allreduce(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(("a",), 2, a=1)])
    h.reduce_modes[(1, 2)] = "hang"
    h.on_reduce_hang = lambda gen: h.coord.break_gen(gen)
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert [e["phase"] for e in h.events("step_abort")] == ["superseded"]
    assert not h.events("watchdog_fired")
    assert float(h.backend.w[0]) == truth(6)


def test_the_coordinator_unreachable_and_back(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)])

    def down(req: p.QuorumRequest) -> p.QuorumResponse:
        h.coord.down = True
        raise CoordinatorUnavailable("connection refused")

    def back(req: p.QuorumRequest) -> p.QuorumResponse:
        h.coord.down = False
        return p.QuorumResponse(p.Verdict.PROCEED, req.gen)

    h.coord.verdicts[(1, 2)] = down
    h.coord.verdicts[(1, 4)] = back
    results = h.run()
    # Steps 2 and 3 were committed without a verdict, in the same generation.
    assert [(r.step, r.gen) for r in results] == [(s, 1) for s in range(6)]
    assert not h.events("step_abort")
    assert h.events("coordinator_unreachable")
    assert float(h.backend.w[0]) == truth(6)


def test_leave_exits_at_a_step_boundary_with_exit_left(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)])

    def leaving(req: p.QuorumRequest) -> p.QuorumResponse:
        assert req.leaving
        return p.QuorumResponse(p.Verdict.REGROUP, 2)

    h.coord.verdicts[(1, 3)] = leaving
    done: list[int] = []
    with pytest.raises(WorkerExit) as e:
        for r in h.engine.steps():
            done.append(r.step)
            if r.step == 2:
                h.engine.request_leave()
    h.release.set()
    assert e.value.code == EXIT_LEFT and e.value.reason == "left"
    assert done == [0, 1, 2]
    assert [x["reason"] for x in h.events("worker_exit")] == ["left"]
    assert not h.events("step_abort")


def test_preemption_takes_an_emergency_checkpoint_and_exits(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(("a",), 0)])
    h.coord.verdicts[(1, 2)] = p.QuorumResponse(p.Verdict.PROCEED, 1, preempt_s=20.0)
    with pytest.raises(WorkerExit) as e:
        h.run()
    assert e.value.code == EXIT_PREEMPTED
    (cp,) = h.events("checkpoint_emergency")
    assert cp["step"] == 3 and cp["ok"]  # the state after the step the notice came with
    ckpt = latest_verified(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.step == 3
    tensors, meta = load(ckpt)
    assert meta["committed"] == 3 and float(tensors["w"][0]) == truth(3)
    assert h.engine.committed == 3


def test_expelled_member_registers_again_and_trains_on(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(TWO, 2, a=1, b=1)])
    h.coord.verdicts[(1, 2)] = p.Verdict.REGROUP
    h.coord.rendezvous_script = []

    def expel_then_regroup(req: p.QuorumRequest) -> p.QuorumResponse:
        h.coord.rendezvous_script.append(p.RendezvousResponse(p.RendezvousStatus.EXPELLED))
        return p.QuorumResponse(p.Verdict.REGROUP, 1)

    h.coord.verdicts[(1, 2)] = expel_then_regroup
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert h.coord.registrations == 2
    assert [e["phase"] for e in h.events("step_abort")] == ["quorum"]
    assert float(h.backend.w[0]) == truth(6)


def test_a_refused_member_exits_with_exit_refused(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)])
    h.backend.signature = lambda: [["w", [2], "float32"]]  # type: ignore[method-assign]
    h.engine.session.signature = h.backend.signature()
    with pytest.raises(WorkerExit) as e:
        h.run()
    assert e.value.code == EXIT_REFUSED


def test_a_restarted_coordinator_adopts_the_member_without_a_regroup(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)])
    h.coord.verdicts[(1, 3)] = p.Verdict.UNKNOWN
    results = h.run()
    assert [(r.step, r.gen) for r in results] == [(s, 1) for s in range(6)]
    assert h.coord.registrations == 2
    assert not h.events("step_abort")


def test_a_joiner_heals_from_its_peers_and_resumes_at_their_step(tmp_path: Path) -> None:
    members = ("b", "c", "a")
    h = Harness(tmp_path, [(members, {"b": 4, "c": 4, "a": 0}, {"b": 3, "c": 3, "a": 0})])
    results = h.run()
    assert h.heals == [("recv", 4)]
    assert [r.step for r in results] == [4, 5]
    assert h.engine.proto.commit_gen == 1
    assert float(h.backend.w[0]) == truth(6)
    assert h.backend.computed[0][0] == 4  # never recomputed steps 0-3


@pytest.mark.skipif(landing._MADV_HUGEPAGE is None, reason="needs huge-page mappings")
@pytest.mark.parametrize("progress", [0, 4])
def test_a_joiner_behind_the_job_reserves_its_landing_and_hands_it_to_its_heal(
    tmp_path: Path, progress: int
) -> None:
    members = ("b", "c", "a")
    got: list[Any] = []

    def heal(*args: Any, reserve: Any = None, **kw: Any) -> tuple[dict[str, Any], HealStats]:
        got.append(reserve)
        return h.heal_from_truth(*args, **kw)

    h = Harness(
        tmp_path, [(members, {"b": 4, "c": 4, "a": 0}, {"b": 3, "c": 3, "a": 0})], heal=heal
    )
    h.coord.progress_step = progress  # registration says how far the job is
    results = h.run()
    assert [r.step for r in results] == [4, 5]
    if progress:
        # Mapped and touched at registration, handed to the one heal, then what
        # it did not take let go.
        assert len(got) == 1 and got[0] is not None and got[0].nbytes == 4 << 20
        assert got[0]._regions == {} and not got[0]._touched.is_alive()
    else:
        assert got == [None]  # a fresh job: nobody is behind at registration
    assert h.engine.healing.reserve is None


def test_a_reserve_no_heal_takes_is_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A standby that caught up from a checkpoint reserved at registration (the job
    was ahead then) and is in no heal when admitted: its reserve goes at once."""
    made: list[Any] = []

    class Spy(healing_module.LandingReserve):
        def __init__(self, sizes: Any) -> None:
            super().__init__(sizes)
            made.append(self)

    monkeypatch.setattr(healing_module, "LandingReserve", Spy)
    h = Harness(tmp_path, [gen_of(TWO, 0)])
    h.coord.progress_step = 4
    assert [r.step for r in h.run()] == list(range(6))
    assert h.heals == []  # nobody was behind in the generation
    assert len(made) == 1 and made[0]._regions == {} and not made[0]._touched.is_alive()
    assert h.engine.healing.reserve is None


def test_the_zombie_commit_member_is_healed_to_the_jobs_state(tmp_path: Path) -> None:
    # a completed step 2 in generation 1 after b and c had abandoned it and re-run
    # it in generation 2 without a: same count, different state.
    h = Harness(
        tmp_path,
        [gen_of(TWO, 0), (("b", "c", "a"), {"b": 3, "c": 3, "a": 3}, {"b": 2, "c": 2, "a": 1})],
    )
    h.coord.verdicts[(1, 3)] = p.Verdict.REGROUP
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert h.heals == [("recv", 3)]
    assert h.engine.proto.commit_gen == 2
    assert float(h.backend.w[0]) == truth(6)


def test_a_heal_sender_failing_mid_transfer_abandons_and_heals_again(tmp_path: Path) -> None:
    members = ("b", "c", "a")
    at4 = (members, {"b": 4, "c": 4, "a": 0}, {"b": 3, "c": 3, "a": 0})
    calls: list[int] = []

    def flaky(*args: Any, **kw: Any) -> tuple[dict[str, Any], HealStats]:
        calls.append(1)
        if len(calls) == 1:
            raise HealError("heal on rank 2: stripe from sender rank 0 failed: connection reset")
        return h.heal_from_truth(*args, **kw)

    h = Harness(tmp_path, [at4, at4], heal=flaky)
    results = h.run()
    assert len(calls) == 2
    assert [e["phase"] for e in h.events("step_abort")] == ["heal"]
    assert [r.step for r in results] == [4, 5]
    assert float(h.backend.w[0]) == truth(6)


def test_a_heal_torn_after_landing_began_ends_the_member_for_a_fresh_process(
    tmp_path: Path,
) -> None:
    """A heal that failed once it was writing the live state (a sender died mid-heal
    while the model landed in place) must not leave this member in the job, where
    it could be picked as a sender: it tells the coordinator and exits with
    EXIT_STATE_TORN (the launcher replaces it; test_startup's decision), and no
    step runs on the torn state."""
    members = ("b", "c", "a")
    at4 = (members, {"b": 4, "c": 4, "a": 0}, {"b": 3, "c": 3, "a": 0})

    def torn(*args: Any, **kw: Any) -> tuple[dict[str, Any], HealStats]:
        raise TornHeal("heal on rank 2 failed after it began landing: connection reset")

    h = Harness(tmp_path, [at4, at4], heal=torn)
    with pytest.raises(WorkerExit) as e:
        h.run()
    assert e.value.code == EXIT_STATE_TORN
    assert h.coord.exits == [EXIT_STATE_TORN]
    assert [ev["reason"] for ev in h.events("worker_exit")] == ["state_torn"]
    assert h.events("step_commit") == [] and h.coord.gen == 1  # never regrouped
    assert e.value.record is None  # a peer's failure: no exit record, nothing counted


@pytest.mark.parametrize("cause", ["own", "poisoned"])
def test_a_torn_heal_of_its_own_leaves_its_cause_and_a_poisoned_one_exits_74(
    tmp_path: Path, cause: str
) -> None:
    """A heal torn by this member's own failure (its install refused the state)
    leaves the innermost cause as the exit record, for the launcher's same-error
    rule; one torn by a sticky device error (the install's copy) is a poisoned
    device, EXIT_DEVICE_POISONED, not a torn state."""
    members = ("b", "c", "a")
    at4 = (members, {"b": 4, "c": 4, "a": 0}, {"b": 3, "c": 3, "a": 0})
    why = "refuses the state" if cause == "own" else "CUDA error: an illegal memory access"

    def torn(*args: Any, **kw: Any) -> tuple[dict[str, Any], HealStats]:
        try:
            try:
                raise ValueError(why)
            except ValueError as e:
                raise HealError(f"registered object refused the healed state: {e}") from e
        except HealError as e:
            raise TornHeal("heal on rank 2 failed after it began landing", own=True) from e

    h = Harness(tmp_path, [at4, at4], heal=torn)
    with pytest.raises(WorkerExit) as e:
        h.run()
    if cause == "poisoned":
        assert e.value.code == EXIT_DEVICE_POISONED and e.value.record is None
        assert [ev["reason"] for ev in h.events("worker_exit")] == ["device_poisoned"]
        return
    assert e.value.code == EXIT_STATE_TORN
    rec = e.value.record
    assert rec is not None and rec.type == "ValueError" and rec.message == why, rec
    assert rec.where.startswith(__file__), rec  # the innermost frame: the raise above


def test_hooks_see_every_point_of_every_step(tmp_path: Path) -> None:
    seen: list[tuple[int, str]] = []

    class Recorder:
        def attach(self, member: str, events: Any) -> None:
            seen.append((-1, member))

        def at(self, step: int, point: hooks.StepPoint) -> None:
            seen.append((step, str(point)))

    hooks.install(Recorder())
    h = Harness(tmp_path, [gen_of(TWO, 0)], total_steps=2)
    h.run()
    assert seen == [
        (-1, "a"),
        (0, "connect"),  # the generation's group, built before its first step
        (0, "compute"), (0, "allreduce"), (0, "commit"),
        (1, "compute"), (1, "allreduce"), (1, "commit"),
    ]  # fmt: skip


def test_trainer_log_is_rank_0s_in_its_events_and_next_quorum_request(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(TWO, 0)], total_steps=3)
    sent: list[dict[str, float]] = []
    quorum = h.coord.quorum

    def record(req: p.QuorumRequest) -> p.QuorumResponse:
        sent.append(req.scalars)
        return quorum(req)

    h.coord.quorum = record  # type: ignore[method-assign]
    with pytest.raises(ValueError, match="letters, digits"):
        h.engine.log("bad name", 1.0)
    h.engine.log("before", 1.0)  # no generation yet: nobody is rank 0, nothing reported
    try:
        for r in h.engine.steps():
            h.engine.log("lr", 0.1 * (r.step + 1))
            h.engine.log("lr", torch.tensor(0.5 * (r.step + 1)))  # the last one per name is sent
            with pytest.raises(ValueError, match="finite"):
                h.engine.log("lr", float("nan"))
    finally:
        h.release.set()
    got = [(e["name"], e["step"], e["value"]) for e in h.events("user_scalar")]
    assert got == [("lr", s, v * (s + 1)) for s in range(3) for v in (0.1, 0.5)]
    assert sent == [{}, {"lr": 0.5}, {"lr": 1.0}]  # step 2's would go with a step 3


def test_trainer_log_on_another_rank_is_checked_not_reported(tmp_path: Path) -> None:
    h = Harness(tmp_path, [gen_of(("b", "a"), 0)], total_steps=2)
    try:
        for _ in h.engine.steps():
            assert h.engine.rank == 1
            h.engine.log("lr", 0.1)
            with pytest.raises(TypeError, match="expected a number"):
                h.engine.log("lr", "0.1")
    finally:
        h.release.set()
    assert h.events("user_scalar") == []
    assert h.engine.tally.take_scalars() == {}


class FakeNccl:
    """An NCCL generation group: the step's sums as `FakeGroup` computes them, and
    a record of its abort."""

    def __init__(self, h: Harness, gen: int, prefix: str) -> None:
        self.inner, self.gen, self.prefix = FakeGroup(h, gen), gen, prefix
        self.reduces = 0
        self.aborted = threading.Event()

    def allreduce(self, tensors: list[torch.Tensor]) -> FakeWork:
        self.reduces += 1
        return self.inner.allreduce(tensors)

    def abort(self) -> None:
        self.aborted.set()


def test_a_cuda_member_reduces_on_its_generations_nccl_group_and_aborts_it_when_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """collectives "auto" on a CUDA model with a recent NCCL: each generation builds an
    NCCL group beside its gloo one, the step's all-reduce runs there (gloo carries
    none of it), and a generation that breaks has its NCCL group aborted, as has
    the last one when the worker ends."""
    monkeypatch.setattr(FakeBackend, "device", torch.device("cuda", 0))
    monkeypatch.setattr(replicas_module, "runtime_nccl_version", lambda: (2, 21, 5))
    monkeypatch.setattr(engine_module, "check_device", lambda device: None)
    built: list[FakeNccl] = []
    gloo_reduces: list[int] = []

    def build(store: Any, prefix: str, rank: int, size: int, device: Any, **kw: Any) -> FakeNccl:
        assert device == torch.device("cuda", 0) and size == 2
        built.append(FakeNccl(h, h.coord.gen, prefix))
        return built[-1]

    monkeypatch.setattr(rendezvous_module, "build_nccl_group", build)
    h = Harness(tmp_path, [gen_of(TWO, 0), gen_of(("a", "c"), 3, a=1, c=1)])
    h.engine.session.store = lambda timeout_s: None  # type: ignore[method-assign,assignment]
    gloo = h.engine.rendezvous.groups

    def gloo_group(gen: int, rank: int, size: int) -> Any:
        g = gloo(gen, rank, size)
        g.allreduce = lambda tensors: gloo_reduces.append(gen)  # type: ignore[method-assign]
        return g

    h.engine.rendezvous.groups = gloo_group
    h.reduce_modes[(1, 3)] = "error"  # b dies in step 3's all-reduce
    results = h.run()
    assert [r.step for r in results] == list(range(6))
    assert float(h.backend.w[0]) == truth(6)  # step 3 applied once, on the new group
    assert [(g.gen, g.reduces) for g in built] == [(1, 4), (2, 3)]
    assert all(g.prefix.endswith("/nccl") for g in built) and built[0].prefix != built[1].prefix
    assert gloo_reduces == []
    assert all(g.aborted.wait(5.0) for g in built)
    [start] = h.events("worker_start")
    assert start["collectives"] == "nccl" and start["collectives_why"] == "NCCL 2.21.5 on CUDA"


def test_collectives_nccl_on_a_cpu_model_is_refused_when_the_trainer_is_built(
    tmp_path: Path,
) -> None:
    with pytest.raises(ValueError, match="collectives='nccl' is not possible here: the model is"):
        Harness(tmp_path, [gen_of(TWO, 0)], collectives="nccl")


def test_the_last_steps_checkpoint_waits_for_a_previous_save_still_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Step 3's save is still writing when step 6, the job's last, commits: a periodic
    # checkpoint would be skipped then, the last one waits for it (no later checkpoint
    # will hold the trained state).
    h = Harness(tmp_path, [gen_of(("a",), 0)], checkpoint_every=3, checkpoint_keep_last=5)
    real = CheckpointWriter._write
    held = threading.Event()

    def slow(self: CheckpointWriter, d: Path, final: Path, step: int, *a: Any) -> int:
        if step == 3:
            held.set()
            # Written only once the engine has committed the last step.
            deadline = time.monotonic() + 60
            while h.engine.committed < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
        return real(self, d, final, step, *a)

    monkeypatch.setattr(CheckpointWriter, "_write", slow)
    h.run()
    assert held.is_set()
    d = tmp_path / "checkpoints"
    assert [s for s, path in list_steps(d) if (path / MARKER).exists()] == [3, 6]
    assert not h.events("checkpoint_skipped")


def test_a_job_ends_with_a_checkpoint_of_its_last_step(tmp_path: Path) -> None:
    # 7 steps, a checkpoint every 3: 3 and 6 by the schedule, 7 because it is the
    # last (its state is what an export or a rerun of the finished job reads).
    h = Harness(tmp_path, [gen_of(("a",), 0)], total_steps=7, checkpoint_every=3,
                checkpoint_keep_last=5)  # fmt: skip
    h.run()
    d = tmp_path / "checkpoints"
    steps = [s for s, path in list_steps(d) if (path / MARKER).exists()]
    # The first is never skipped; 6 may be (3 still writing: these steps take no time).
    assert steps in ([3, 6, 7], [3, 7])
    ckpt = latest_verified(d)
    assert ckpt is not None and ckpt.step == 7
    tensors, meta = load(ckpt)
    assert meta["committed"] == 7 and float(tensors["w"][0]) == truth(7)

"""The heal over its transport seam: the whole protocol on an in-memory wire.

`heal_over` talks to a `HealTransport` only, so the striped heal (manifest,
plan, stripes, seals, landing, install) runs here with every rank a thread and
the wire a few queues in this process: no gloo, no sockets. The wire can damage
a message in flight, which is how a corrupted stripe reaches a receiver, and
lose one, which is how a dead peer looks. The gloo transport is exercised by
tests/test_transfer.py's heal tests.
"""

from __future__ import annotations

import datetime
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from typing import Any

import pytest
import torch

import elastrain.transfer.prepared as prepared
import elastrain.transfer.torch_state as torch_state
from elastrain.transfer import (
    HealAuth,
    HealError,
    HealStats,
    HealTransport,
    Role,
    TorchState,
    TornHeal,
    heal_over,
    state_hash,
)
from elastrain.transfer.chunks import MAX_CHUNKS
from elastrain.transfer.flatten import flatten_state
from elastrain.transfer.seal import REFERENCE_BYTES, STRIPE_SEAL_BYTES
from elastrain.transfer.standby import WORD_TAG
from elastrain.transfer.tamper import Tamper
from elastrain.transfer.transport import ROUND_TAGS, Among, Pending, Reduce

KEY = b"job-token"

Damage = Callable[[int, int, int, torch.Tensor], torch.Tensor | None]
"""(src, dst, tag, message) -> the message as delivered, or None: lost."""


class Wire:
    """One generation's members in one process: numbered collective rounds, and a
    mailbox per (src, dst, tag). `damage` sees every point-to-point message."""

    def __init__(self, size: int, damage: Damage | None = None) -> None:
        self.size = size
        self.damage = damage
        self.cond = threading.Condition()
        self.rounds: dict[int, dict[int, tuple[str, torch.Tensor]]] = defaultdict(dict)
        self.mail: dict[tuple[int, int, int], deque[torch.Tensor]] = defaultdict(deque)
        self.damaged = 0
        self.dead: set[int] = set()
        """Ranks whose connections are closed: a receive from one fails at once (as
        gloo's does when the peer's process died)."""
        self.took_part: defaultdict[int, list[str]] = defaultdict(list)
        """Per rank, what it posted: a collective's kind, or ``send``/``recv`` and the tag."""

    def member(self, rank: int) -> Member:
        return Member(self, rank)


class _Waits:
    """A posted operation: done when `ready()` holds (under the wire's lock), then `finish()`."""

    def __init__(
        self, wire: Wire, ready: Callable[[], bool], finish: Callable[[], None], what: str
    ) -> None:
        self.wire, self.ready, self.finish, self.what = wire, ready, finish, what

    def wait(self, timeout: datetime.timedelta) -> None:
        with self.wire.cond:
            if not self.wire.cond.wait_for(self.ready, timeout.total_seconds()):
                raise RuntimeError(f"in-memory wire: {self.what} timed out")
            self.finish()


class Member:
    """`HealTransport` for one rank of a `Wire`."""

    def __init__(self, wire: Wire, rank: int) -> None:
        self.wire, self._rank, self._round = wire, rank, 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self.wire.size

    def _collective(
        self, kind: str, t: torch.Tensor, combine: Callable[[list[torch.Tensor]], torch.Tensor]
    ) -> Pending:
        w, k = self.wire, self._round
        self._round += 1
        with w.cond:
            w.took_part[self._rank].append(kind)
            w.rounds[k][self._rank] = (kind, t.clone())
            w.cond.notify_all()

        def ready() -> bool:
            return len(w.rounds[k]) == w.size

        def finish() -> None:
            got = [w.rounds[k][r] for r in range(w.size)]
            if {g[0] for g in got} != {kind} or {g[1].shape for g in got} != {t.shape}:
                raise RuntimeError(f"in-memory wire: round {k} mismatched: {got}")
            t.copy_(combine([g[1] for g in got]))

        return _Waits(w, ready, finish, f"{kind} round {k}")

    def allreduce(self, v: torch.Tensor, op: Reduce, timeout: datetime.timedelta) -> Pending:
        def combine(ts: list[torch.Tensor]) -> torch.Tensor:
            stacked = torch.stack(ts)
            return stacked.amax(0) if op == Reduce.MAX else stacked.sum(0)

        return self._collective(f"allreduce-{op}", v, combine)

    def broadcast(self, buf: torch.Tensor, root: int, timeout: datetime.timedelta) -> Pending:
        return self._collective(f"broadcast-{root}", buf, lambda ts: ts[root])

    def send(self, buf: torch.Tensor, dst: int, tag: int) -> Pending:
        w = self.wire
        msg: torch.Tensor | None = buf.clone()
        if w.damage is not None:
            assert msg is not None
            msg = w.damage(self._rank, dst, tag, msg)
        with w.cond:
            w.took_part[self._rank].append(f"send {tag}")
            if msg is not None:
                w.mail[(self._rank, dst, tag)].append(msg)
                w.cond.notify_all()
        return _Waits(w, lambda: True, lambda: None, "send")

    def recv(self, buf: torch.Tensor, src: int, tag: int) -> Pending:
        w, box = self.wire, (src, self._rank, tag)
        with w.cond:
            w.took_part[self._rank].append(f"recv {tag}")

        def finish() -> None:
            if src in w.dead:
                raise RuntimeError(f"in-memory wire: connection to rank {src} closed")
            msg = w.mail[box].popleft()
            if msg.shape != buf.shape or msg.dtype != buf.dtype:
                raise RuntimeError(f"in-memory wire: {msg.shape} into a {buf.shape} buffer")
            buf.copy_(msg)

        return _Waits(w, lambda: bool(w.mail[box]) or src in w.dead, finish, f"receive from {src}")


def _state(trained: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An up-to-date state (identical wherever it is built) or a joiner's."""
    torch.manual_seed(0 if trained else 99)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2 if trained else 0.5)
    if trained:
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(8, 16, generator=g)).square().mean().backward()
            opt.step()
    return model, opt


def run(
    wire: Wire,
    states: list[tuple[torch.nn.Module, torch.optim.Optimizer]],
    senders: list[int],
    receivers: list[int],
    timeout_s: float = 10.0,
    auth: HealAuth = HealAuth.DIGEST,
    in_place: bool = False,
    min_stripe_bytes: int = 0,
    tamper: dict[int, Tamper] | None = None,
) -> list[tuple[dict[str, Any], HealStats] | BaseException]:
    """Every rank heals over the wire on its own thread; its result or exception.
    ``tamper``: by rank, what that rank damages or forges (`Tamper`)."""
    results: list[Any] = [None] * wire.size

    def body(rank: int) -> None:
        tx: HealTransport = wire.member(rank)
        meta = {"step": 7} if rank in senders else None
        try:
            results[rank] = heal_over(
                tx, senders, receivers, TorchState(*states[rank]), meta, timeout_s, key=KEY,
                auth=auth, in_place=in_place, min_stripe_bytes=min_stripe_bytes,
                tamper=(tamper or {}).get(rank),
            )  # fmt: skip
        except BaseException as e:  # noqa: BLE001 - the test inspects it (interrupts too)
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(wire.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a heal thread hung"
    return results


def test_roles_are_one_enum() -> None:
    assert [Role.of(r, [0, 1], [3]) for r in range(4)] == [
        Role.SEND,
        Role.SEND,
        Role.IDLE,
        Role.RECV,
    ]
    assert Role.RECV == "recv"  # events and JSON carry the value


def test_a_heal_over_an_in_memory_transport_installs_the_senders_state() -> None:
    states = [_state(True), _state(True), _state(False), _state(False)]
    want = state_hash(*states[0])
    assert state_hash(*states[3]) != want
    res = run(Wire(4), states, senders=[0, 1], receivers=[3])
    assert all(isinstance(r, tuple) for r in res), res
    outs = [r for r in res if isinstance(r, tuple)]
    assert [st.role for _, st in outs] == [Role.SEND, Role.SEND, Role.IDLE, Role.RECV]
    assert outs[3][0] == {"step": 7} and outs[2][0] == {"step": 7}  # the root's meta
    assert all(st.refused == () for _, st in outs)
    assert state_hash(*states[3]) == want
    assert state_hash(*states[2]) != want  # an idle rank is not touched
    # Striped: each sender sent its half of the payload, the receiver got all of it.
    assert outs[0][1].bytes + outs[1][1].bytes == outs[3][1].bytes > 0
    assert abs(outs[0][1].bytes - outs[1][1].bytes) <= 1


def _flip_from(sender: int, wire_counter: list[Wire]) -> Damage:
    """Flip one byte of every payload message `sender` sends (not its seals, nor
    its sealed state digest: both travel under the seal tag; nor the messages of
    the rounds among some ranks, `Among`'s, and the root's word to its standbys,
    whose tags are below every payload tag)."""

    def damage(src: int, dst: int, tag: int, msg: torch.Tensor) -> torch.Tensor:
        if src == sender and tag >= ROUND_TAGS and tag & MAX_CHUNKS != MAX_CHUNKS:
            msg[msg.numel() // 2] ^= 0x5A
            wire_counter[0].damaged += 1
        return msg

    return damage


def _same_bytes(a: tuple[torch.nn.Module, torch.optim.Optimizer], b: Any) -> bool:
    """Every tensor of model and optimizer state bit-identical, and the same section."""
    fa, fb = flatten_state(*a), flatten_state(*b)
    return (
        [n for n, _ in fa.tensors] == [n for n, _ in fb.tensors]
        and all(
            x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))
            for (_, x), (_, y) in zip(fa.tensors, fb.tensors, strict=True)
        )
        and fa.section == fb.section
    )


@pytest.mark.parametrize("auth", list(HealAuth))
def test_a_stripe_corrupted_on_the_wire_is_refused_and_sent_again_by_another_sender(
    auth: HealAuth,
) -> None:
    """One flipped byte in the transport: the digest (or the seal) catches it, the
    other sender sends the stripe again, the receiver ends bit-identical."""
    states = [_state(True), _state(True), _state(False)]
    want = state_hash(*states[0])
    holder: list[Wire] = []
    wire = Wire(3, _flip_from(0, holder))
    holder.append(wire)
    res = run(wire, states, senders=[0, 1], receivers=[2], auth=auth)
    assert all(isinstance(r, tuple) for r in res), res
    assert wire.damaged > 0
    stats = [r[1] for r in res if isinstance(r, tuple)]
    assert all(st.refused == (0,) for st in stats)  # the same verdict on every rank
    assert state_hash(*states[2]) == want
    assert _same_bytes(states[2], states[0])
    # Sender 1 sent its own stripe and, again, the refused one: the whole payload.
    assert stats[1].bytes == stats[2].bytes - stats[0].bytes


def test_a_small_state_comes_from_the_root_alone_and_a_bad_one_from_the_next_sender() -> None:
    """min_stripe_bytes above the payload (the trainers' `heal_with` for a small
    state): the root sends all of it and the other sender nothing; when the root's
    bytes are damaged, the other sender sends the whole payload again."""
    states = [_state(True), _state(True), _state(False)]
    want = state_hash(*states[0])
    res = run(Wire(3), states, senders=[0, 1], receivers=[2], min_stripe_bytes=1 << 30)
    assert all(isinstance(r, tuple) for r in res), res
    sent = [r[1].bytes for r in res if isinstance(r, tuple)]
    assert sent[0] == sent[2] > 0 and sent[1] == 0
    assert state_hash(*states[2]) == want

    states[2] = _state(False)
    holder: list[Wire] = []
    wire = Wire(3, _flip_from(0, holder))
    holder.append(wire)
    res = run(wire, states, senders=[0, 1], receivers=[2], min_stripe_bytes=1 << 30)
    assert all(isinstance(r, tuple) for r in res), res
    stats = [r[1] for r in res if isinstance(r, tuple)]
    assert wire.damaged > 0 and all(st.refused == (0,) for st in stats)
    assert stats[0].bytes == stats[1].bytes == stats[2].bytes // 2  # once each, twice landed
    assert _same_bytes(states[2], states[0])


SMALL = 1 << 30
"""A `min_stripe_bytes` above the test state's payload: the root alone sends it."""


def test_senders_kept_in_reserve_sit_the_heal_out_until_the_roots_word() -> None:
    """A small state comes from the root alone; the other senders (its standbys)
    take part in the announcement and then only hear the root's word: no manifest,
    no verdict, no outcome round waits for their processes."""
    states = [_state(True), _state(True), _state(True), _state(False)]
    want = state_hash(*states[0])
    wire = Wire(4)
    res = run(wire, states, senders=[0, 1, 2], receivers=[3], min_stripe_bytes=SMALL)
    assert all(isinstance(r, tuple) for r in res), res
    stats = [r[1] for r in res if isinstance(r, tuple)]
    assert [st.standby for st in stats] == [False, True, True, False]
    assert [st.bytes for st in stats[1:3]] == [0, 0] and stats[0].bytes == stats[3].bytes > 0
    assert state_hash(*states[3]) == want
    # The announcement goes through the root (`STAR_FROM`: 4 ranks), under the
    # first round's tag: a standby's part is its vector in, the result out, the word.
    for standby in (1, 2):
        assert wire.took_part[standby] == ["send 1", "recv 1", f"recv {WORD_TAG}"]
    assert wire.took_part[0].count(f"send {WORD_TAG}") == 2
    # The root and the receiver: no collective of the whole group, every round as
    # messages (the rest between the two of them).
    assert [k for k in wire.took_part[3] if not k.startswith(("send", "recv"))] == []


def test_a_malformed_manifest_with_standbys_makes_a_standby_the_root() -> None:
    """The root's manifest lies: its standby is told to take part, becomes the root
    of the next pass, and the receiver ends bit-identical; every rank names the
    refused root."""
    states = [_state(True), _state(True), _state(False)]
    res = run(Wire(3), states, senders=[0, 1], receivers=[2], min_stripe_bytes=SMALL,
              tamper={0: Tamper(manifest="more_bytes")})  # fmt: skip
    assert all(isinstance(r, tuple) for r in res), res
    stats = [r[1] for r in res if isinstance(r, tuple)]
    assert all(st.refused == (0,) for st in stats) and not any(st.standby for st in stats)
    assert stats[1].bytes == stats[2].bytes > 0 and stats[0].bytes == 0
    assert _same_bytes(states[2], states[0])


def test_a_rejected_manifest_with_standbys_fails_every_rank_at_once() -> None:
    """A receiver whose state does not fit rejects the manifest: the root tells its
    standby, which raises with the others instead of waiting out the deadline."""
    states = [_state(True), _state(True), _state(False)]
    torch.manual_seed(5)
    # Larger than the senders' (so within its bounds) and of another shape.
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    states[2] = (other, torch.optim.Adam(other.parameters()))
    res = run(Wire(3), states, senders=[0, 1], receivers=[2], min_stripe_bytes=SMALL,
              timeout_s=60.0)  # fmt: skip
    assert all(isinstance(r, HealError) for r in res), res
    assert "kept in reserve" in str(res[1]) and "timed out" not in str(res[1]), res[1]


def test_in_place_when_the_standby_is_damaged_too_the_receiver_is_torn() -> None:
    """The root's bytes fail, the standby's in the next pass too: the receiver's
    live model was written in the first pass, so its failure is a TornHeal (a
    peer's), even where the second pass failed before landing anything."""
    states = [_state(True), _state(True), _state(False)]
    holder: list[Wire] = []
    flip0, flip1 = _flip_from(0, holder), _flip_from(1, holder)
    wire = Wire(3, lambda src, dst, tag, msg: flip1(src, dst, tag, flip0(src, dst, tag, msg)))
    holder.append(wire)
    res = run(wire, states, senders=[0, 1], receivers=[2], in_place=True, min_stripe_bytes=SMALL)
    assert isinstance(res[2], TornHeal) and not res[2].own, res
    assert all(isinstance(r, HealError) and not isinstance(r, TornHeal) for r in res[:2]), res


def test_a_receiver_never_installs_on_a_forged_outcome_whose_own_check_failed() -> None:
    """The root's bytes are damaged, and every round's answer from the root to the
    receiver after the announcement (round 1) is forged to say that nothing failed:
    the receiver still refuses to install, on the strength of its own digest check."""
    states = [_state(True), _state(True), _state(False)]
    before = state_hash(*states[2])
    holder: list[Wire] = []
    flip = _flip_from(0, holder)

    def damage(src: int, dst: int, tag: int, msg: torch.Tensor) -> torch.Tensor:
        if src == 0 and dst == 2 and 1 < tag < ROUND_TAGS and msg.dtype == torch.int64:
            return torch.zeros_like(msg)  # a round's answer: "status 0, nobody failed"
        return flip(src, dst, tag, msg)

    wire = Wire(3, damage)
    holder.append(wire)
    res = run(wire, states, senders=[0, 1], receivers=[2], min_stripe_bytes=SMALL, timeout_s=3.0)
    assert isinstance(res[2], HealError) and "damaged or forged" in str(res[2]), res
    assert state_hash(*states[2]) == before


def test_a_round_among_some_ranks_fails_everywhere_at_once_when_a_member_is_lost() -> None:
    """`Among`: a member's closed connection fails the round at its hub, and the hub
    answers the other members with the failure (not their deadlines)."""
    wire = Wire(4)
    wire.dead.add(3)
    errors: dict[int, BaseException] = {}

    def body(rank: int) -> None:
        among = Among(wire.member(rank), [0, 1, 3], hub=0)
        v = torch.ones(2, dtype=torch.int64)
        try:
            among.allreduce(v, Reduce.SUM, datetime.timedelta(seconds=60)).wait(
                datetime.timedelta(seconds=60)
            )
        except RuntimeError as e:
            errors[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)  # well before the round's 60 s deadline
    assert not any(t.is_alive() for t in threads)
    assert "rank 3 lost" in str(errors[0]) and "failed at rank 0" in str(errors[1]), errors


def test_a_round_among_some_ranks_combines_their_vectors_only() -> None:
    wire = Wire(4)
    got: dict[int, list[int]] = {}

    def body(rank: int) -> None:
        among = Among(wire.member(rank), [1, 2, 3], hub=2)
        v = torch.zeros(4, dtype=torch.int64)
        v[rank] = rank + 10
        among.allreduce(v, Reduce.MAX, datetime.timedelta(seconds=10)).wait(
            datetime.timedelta(seconds=10)
        )
        buf = torch.tensor([rank] * 3, dtype=torch.uint8)
        among.broadcast(buf, 3, datetime.timedelta(seconds=10)).wait(datetime.timedelta(seconds=10))
        got[rank] = v.tolist() + buf.tolist()

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert all(got[r] == [0, 11, 12, 13, 3, 3, 3] for r in (1, 2, 3)), got
    assert 0 not in wire.took_part  # rank 0 was never asked


@pytest.mark.parametrize("auth", list(HealAuth))
def test_when_every_sender_is_corrupted_the_receiver_is_left_untouched(auth: HealAuth) -> None:
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])
    holder: list[Wire] = []
    wire = Wire(2, _flip_from(0, holder))
    holder.append(wire)
    res = run(wire, states, senders=[0], receivers=[1], auth=auth)
    assert all(isinstance(r, HealError) for r in res), res
    word = "digest" if auth == HealAuth.DIGEST else "seal"
    assert f"failed their {word}" in str(res[1]) and "no sender is left" in str(res[1])
    if auth == HealAuth.DIGEST:
        assert "state digest mismatch" in str(res[1])
    assert not any(isinstance(r, TornHeal) for r in res)  # not in place: nothing torn
    assert state_hash(*states[1]) == before


def _live(model: torch.nn.Module) -> list[tuple[int, int]]:
    """Where each of the model's tensors lives: (address, bytes)."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in model.state_dict().values()]


def _count_walks(model: torch.nn.Module) -> list[int]:
    """Count the calls of ``model.state_dict()`` from now on (its own, not its children's)."""
    calls = [0]
    real = model.state_dict

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    model.state_dict = counted  # type: ignore[method-assign]
    return calls


def test_a_heal_walks_each_members_model_at_most_once() -> None:
    """A model's state_dict walk visits every module; a receiver's limit, bound,
    check, live targets and install each needed one. In a heal every rank walks
    its model at most once (a sender's flatten is that walk)."""
    states = [_state(True), _state(True), _state(False)]
    walks = [_count_walks(model) for model, _ in states]
    res = run(Wire(3), states, senders=[0, 1], receivers=[2], in_place=True)
    assert all(isinstance(r, tuple) for r in res), res
    assert [w[0] for w in walks] == [1, 1, 1]
    assert state_hash(*states[2]) == state_hash(*states[0])


def test_outside_a_heal_a_state_sees_the_models_structure_as_it_is_now() -> None:
    """The walk is kept only for the span of `TorchState.steady` (the outer one when
    nested): a buffer registered after a heal is part of the next one's layout."""
    model, opt = _state(True)
    state = TorchState(model, opt)
    walks = _count_walks(model)
    with state.steady():
        with state.steady():
            before = [n for n, _ in state.flatten().tensors]
        assert state.manifest_limit() > 0
        assert [n for n, _ in state.flatten().tensors] == before
    assert walks[0] == 1
    model.register_buffer("seen", torch.zeros(3))
    after = [n for n, _ in state.flatten().tensors]
    assert walks[0] == 2
    assert "model/seen" in after and "model/seen" not in before


@pytest.mark.parametrize("auth", list(HealAuth))
def test_in_place_the_model_lands_in_its_live_tensors_and_a_bad_stripe_is_fetched_again(
    auth: HealAuth, monkeypatch: pytest.MonkeyPatch
) -> None:
    """in_place: the receiver's model tensors are the landing (the install copies
    none of them); a stripe damaged on the wire is caught and fetched again from
    the other sender into the same tensors, and the receiver ends bit-identical."""
    copied: list[torch.Tensor] = []
    real_copy = torch_state.copy_bytes_into
    monkeypatch.setattr(
        torch_state, "copy_bytes_into", lambda dst, src: (copied.append(dst), real_copy(dst, src))
    )
    states = [_state(True), _state(True), _state(False)]
    where = _live(states[2][0])
    holder: list[Wire] = []
    wire = Wire(3, _flip_from(0, holder))
    holder.append(wire)
    res = run(wire, states, senders=[0, 1], receivers=[2], auth=auth, in_place=True)
    assert all(isinstance(r, tuple) for r in res), res
    assert wire.damaged > 0 and all(r[1].refused == (0,) for r in res if isinstance(r, tuple))
    assert copied == []  # every model tensor landed in place
    assert _live(states[2][0]) == where
    assert _same_bytes(states[2], states[0])


@pytest.mark.parametrize("auth", list(HealAuth))
def test_in_place_a_heal_that_fails_after_landing_began_is_torn_on_the_receiver_only(
    auth: HealAuth,
) -> None:
    """Every sender's stripes damaged, in place: the receiver's model was written
    before the check failed, so its HealError is a TornHeal (the engine then ends
    that member); the senders' is a plain HealError, their state untouched."""
    states = [_state(True), _state(False)]
    sender = state_hash(*states[0])
    holder: list[Wire] = []
    wire = Wire(2, _flip_from(0, holder))
    holder.append(wire)
    res = run(wire, states, senders=[0], receivers=[1], auth=auth, in_place=True)
    assert isinstance(res[1], TornHeal) and "no longer valid" in str(res[1]), res
    assert not res[1].own  # the senders' bytes failed: a fresh process may heal fine
    assert isinstance(res[0], HealError) and not isinstance(res[0], TornHeal), res
    assert state_hash(*states[0]) == sender


class _Refuses:
    """A registered object whose ``load_state_dict`` refuses every state."""

    def state_dict(self) -> dict[str, Any]:
        return {"n": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise ValueError("this object refuses the healed state")


@pytest.mark.parametrize("fault", ["bug", "refused", "interrupt"])
def test_in_place_whatever_the_install_raises_the_receiver_is_torn_and_says_whose_fault(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the payload landed in the live model, any failure tears it: a bug's
    KeyError or a registered object refusing the state becomes a TornHeal of this
    member's own (`own`, the cause chained); an interrupt stays an interrupt,
    marked torn. The sender never tears."""
    objects = {"sched": _Refuses()} if fault == "refused" else {}
    states = [(*_state(True), objects), (*_state(False), objects)]
    real = TorchState.install

    def install(self: TorchState, tensors: Any, section: Any) -> None:
        if fault == "bug":
            raise KeyError("model/0.weight")
        if fault == "interrupt":
            raise KeyboardInterrupt
        real(self, tensors, section)

    monkeypatch.setattr(TorchState, "install", install)
    res = run(Wire(2), states, senders=[0], receivers=[1], in_place=True)  # type: ignore[arg-type]
    assert isinstance(res[0], tuple), res  # the sender is done before the receiver installs
    err = res[1]
    if fault == "interrupt":
        assert isinstance(err, KeyboardInterrupt) and not isinstance(err, HealError), res
        assert any("no longer valid" in n for n in getattr(err, "__notes__", [])), err
        return
    assert isinstance(err, TornHeal) and err.own, res
    want = KeyError if fault == "bug" else HealError
    assert isinstance(err.__cause__, want), err.__cause__
    if fault == "refused":
        assert isinstance(err.__cause__.__cause__, ValueError)


def test_in_place_a_manifest_refused_before_the_payload_leaves_the_receiver_untouched() -> None:
    """A rejection before any receive is posted (another mode here) tears nothing."""
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])
    wire = Wire(2)
    results: list[Any] = [None, None]

    def body(rank: int, auth: HealAuth) -> None:
        try:
            heal_over(
                wire.member(rank), [0], [1], TorchState(*states[rank]), None, 10.0, key=KEY,
                auth=auth, in_place=True,
            )  # fmt: skip
        except HealError as e:
            results[rank] = e

    threads = [
        threading.Thread(target=body, args=(r, a), daemon=True)
        for r, a in ((0, HealAuth.DIGEST), (1, HealAuth.MAC))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(isinstance(r, HealError) and not isinstance(r, TornHeal) for r in results), results
    assert state_hash(*states[1]) == before


def test_mac_mode_refuses_a_forged_stripe_seal() -> None:
    """A seal message replaced on the wire (by a process without the token) is
    refused in mac mode, and the stripe comes again from the other sender."""
    states = [_state(True), _state(True), _state(False)]
    want = state_hash(*states[0])

    def forge(src: int, dst: int, tag: int, msg: torch.Tensor) -> torch.Tensor:
        if src == 0 and msg.numel() == STRIPE_SEAL_BYTES:
            return torch.full_like(msg, 7)
        return msg

    res = run(Wire(3, forge), states, senders=[0, 1], receivers=[2], auth=HealAuth.MAC)
    assert all(isinstance(r, tuple) and r[1].refused == (0,) for r in res), res
    assert state_hash(*states[2]) == want


def test_digest_mode_sends_the_payload_and_one_sealed_digest_per_receiver() -> None:
    """No seal or claim messages in a heal that went well: every point-to-point
    message past the rounds (the announcement's, through the root: `STAR_FROM`) is
    payload, but one per receiver: the root's sealed state digest, after its
    stripes."""
    states = [_state(True), _state(False), _state(False)]
    sent: list[tuple[int, int, int]] = []

    def watch(src: int, dst: int, tag: int, msg: torch.Tensor) -> torch.Tensor:
        if tag >= ROUND_TAGS:
            sent.append((dst, tag & MAX_CHUNKS == MAX_CHUNKS, msg.numel()))
        return msg

    res = run(Wire(3, watch), states, senders=[0], receivers=[1, 2])
    assert all(isinstance(r, tuple) for r in res), res
    for r in (1, 2):
        mine = [(sealed, n) for dst, sealed, n in sent if dst == r]
        assert sum(n for sealed, n in mine if not sealed) == res[r][1].bytes  # type: ignore[index]
        assert [n for sealed, n in mine if sealed] == [REFERENCE_BYTES]
        assert mine[-1] == (True, REFERENCE_BYTES)


def test_a_forged_state_digest_message_is_refused_and_nothing_installed() -> None:
    """The root's digest message damaged on the wire (its HMAC no longer verifies):
    the receiver cannot vouch for what landed, so every rank raises HealError and
    the receiver's state is untouched."""
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])

    def forge(src: int, dst: int, tag: int, msg: torch.Tensor) -> torch.Tensor:
        if tag & MAX_CHUNKS == MAX_CHUNKS:
            msg[0] ^= 0x01
        return msg

    res = run(Wire(2, forge), states, senders=[0], receivers=[1])
    assert all(isinstance(r, HealError) for r in res), res
    assert "does not verify" in str(res[1])
    assert state_hash(*states[1]) == before


def test_a_sender_whose_state_differs_from_the_roots_is_refused_in_digest_mode() -> None:
    """Same layout, other values: the whole digest differs, every claim matches its
    own bytes, so the stripes of the non-root sender go again from the root, and
    the receiver holds exactly the root's state."""
    states = [_state(True), _state(True), _state(False)]
    with torch.no_grad():  # the whole state, whatever stripe sender 1 is given
        for p in states[1][0].parameters():
            p.add_(1.0)
        for st in states[1][1].state.values():
            st["exp_avg"].add_(1.0)
    res = run(Wire(3), states, senders=[0, 1], receivers=[2])
    assert all(isinstance(r, tuple) and r[1].refused == (1,) for r in res), res
    assert _same_bytes(states[2], states[0])


def test_a_receiver_never_installs_state_whose_digest_does_not_match(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The root's manifest states a digest that what it sends does not have (as a
    root whose state changed under it would): the blame finds every stripe as
    claimed, the root's stripes are the only ones, nobody is left; the receiver's
    state is untouched."""
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])
    monkeypatch.setattr(prepared, "flat_digest", lambda flat: "ab" * 16)
    res = run(Wire(2), states, senders=[0], receivers=[1])
    assert all(isinstance(r, HealError) and "no sender is left" in str(r) for r in res), res
    assert "state digest mismatch" in str(res[1])
    assert state_hash(*states[1]) == before


def test_members_configured_with_different_modes_refuse_the_heal() -> None:
    """A receiver set to mac never accepts a digest-mode heal (no downgrade)."""
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])
    wire = Wire(2)
    results: list[Any] = [None, None]

    def body(rank: int, auth: HealAuth) -> None:
        try:
            results[rank] = heal_over(
                wire.member(rank), [0], [1], TorchState(*states[rank]), {}, 10.0, key=KEY,
                auth=auth,
            )  # fmt: skip
        except HealError as e:
            results[rank] = e

    threads = [
        threading.Thread(target=body, args=(0, HealAuth.DIGEST), daemon=True),
        threading.Thread(target=body, args=(1, HealAuth.MAC), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(isinstance(r, HealError) for r in results), results
    assert "heal_auth='digest'" in str(results[1]) and "heal_auth='mac'" in str(results[1])
    assert state_hash(*states[1]) == before


def test_a_lost_message_ends_the_heal_at_its_deadline() -> None:
    states = [_state(True), _state(False)]
    before = state_hash(*states[1])

    def lose(src: int, dst: int, tag: int, msg: torch.Tensor) -> None:
        return None

    res = run(Wire(2, lose), states, senders=[0], receivers=[1], timeout_s=0.5)
    assert isinstance(res[1], HealError) and "timed out" in str(res[1]), res
    assert state_hash(*states[1]) == before


@pytest.mark.parametrize("bad", [([], [1]), ([0, 0], [1]), ([0], [0]), ([0], [2])])
def test_bad_arguments_fail_before_the_wire_is_used(bad: tuple[list[int], list[int]]) -> None:
    wire = Wire(2)
    with pytest.raises(ValueError):
        heal_over(wire.member(0), *bad, TorchState(*_state(True)), None, 1.0, key=KEY)
    assert not wire.rounds and not wire.mail

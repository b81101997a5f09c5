"""The coordinator's decisions at scale: the incremental indexes give exactly the
answers of the plain O(members) definitions, on random histories, and the
per-request transitions do not grow with the number of members."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from elastrain.control.config import CoordinatorConfig
from elastrain.control.plan import Generation, LazySequence, in_rank_order
from elastrain.control.quorum import Membership


@pytest.fixture
def verify(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every incremental plan is checked against `plan_generation` (see evaluate)."""
    monkeypatch.setattr(Membership, "verify", True)
    yield


def check_indexes(m: Membership) -> None:
    """The derived indexes agree with the state they are derived from."""
    alive = sorted((x for x in m.members.values() if not x.leaving), key=lambda x: x.registered_at)
    assert m._alive_ids() == tuple(x.id for x in alive)
    assert m._leaving == {x.id for x in m.members.values() if x.leaving}
    assert set(m._seen) == set(m.members)
    assert all(m._seen[k] == x.last_seen for k, x in m.members.items())
    if m._seen_sorted:
        times = list(m._seen.values())
        assert times == sorted(times)
    g = m._ix_gen
    if g is not None:
        gone = {x for x in g.members if x not in m.members or m.members[x].leaving}
        assert set(m._lost) == gone
        # In registration order (the incremental planner is used only while
        # that is also the order of registration times).
        outside = [k for k, x in m.members.items() if not x.leaving and k not in g.member_set]
        assert list(m._outside) == outside


def random_history(seed: int, steps: int = 400) -> None:
    rng = random.Random(seed)
    target = rng.randint(2, 5)
    cfg = CoordinatorConfig(
        target=target,
        min_members=rng.randint(1, target),
        max_members=target + rng.randint(0, 2),
        start_grace_s=rng.choice([0.5, 3.0]),
        lease_s=3.0,
        suspect_s=1.0,
        ready_timeout_s=2.0,
    )
    m = Membership(cfg)
    names = [f"w{i}" for i in range(8)]
    now = 0.0
    step = 0
    for _ in range(steps):
        now += rng.choice([0.0, 0.05, 0.3, 0.9, 1.5])
        if rng.random() < 0.03:
            now -= 0.5  # a caller's clock reading from before the lock
        mid = rng.choice(names)
        x = m.members.get(mid)
        inc = x.incarnation if x is not None else 1
        g = m.gen
        op = rng.random()
        if op < 0.18:
            if rng.random() < 0.1 and g is not None:
                m.register(mid, 1, "h", now, gen=g.gen + 1, gen_members=g.members + (mid,))
            else:
                m.register(mid, rng.randint(1, 9), "h", now)
        elif op < 0.45:
            m.touch(mid, inc, now)
        elif op < 0.58 and g is not None:
            m.rendezvous(mid, inc, g.gen - rng.randint(0, 1), rng.randint(0, 5), now)
        elif op < 0.78 and g is not None:
            if rng.random() < 0.5:
                step += 1
            m.quorum(mid, inc, g.gen, step, rng.random() < 0.05, now)
        elif op < 0.84 and x is not None:
            m.exited(mid, x.pid, now)
        elif op < 0.88:
            m.leave(mid, inc, "left", now)
        elif op < 0.9:
            m.remove(mid, "suspected", now)
        else:
            want = [
                k for k, v in m.members.items() if now - v.last_seen > cfg.lease_s
            ]  # the plain definition, in registration order
            m.drain_removals()
            m.expire(now)
            got = [r.member for r in m.drain_removals() if r.reason == "lease_expired"]
            assert got[: len(want)] == want
        check_indexes(m)


@pytest.mark.parametrize("seed", range(60))
def test_incremental_decisions_match_the_plain_definitions(verify: None, seed: int) -> None:
    random_history(seed)


def test_random_histories_use_the_incremental_planner(
    verify: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above is not vacuous: most decisions go through the indexes."""
    calls = {"fast": 0, "all": 0}
    real = Membership._index

    def counting(self: Membership, g: Generation) -> bool:
        ok = real(self, g)
        calls["all"] += 1
        calls["fast"] += ok
        return ok

    monkeypatch.setattr(Membership, "_index", counting)
    for seed in range(10):
        random_history(seed)
    assert calls["fast"] > 0.8 * calls["all"] > 100


def test_lazy_sequence_builds_once_and_only_when_read() -> None:
    built: list[int] = []

    def build() -> tuple[str, ...]:
        built.append(1)
        return ("a", "b", "c")

    s = LazySequence(3, build)
    assert len(s) == 3 and not built
    assert s[:2] == ("a", "b") and s[2] == "c" and "b" in s and list(s) == ["a", "b", "c"]
    assert len(built) == 1


def test_missing_members_are_listed_in_rank_order_with_a_count() -> None:
    g = Generation(1, tuple(f"w{i}" for i in range(10)), 0.0, "start")
    assert g.missing(3) == (["w0", "w1", "w2"], 10)
    for i in (0, 1, 3):
        g.ready[f"w{i}"] = 0
    assert g.missing(2) == (["w2", "w4"], 7)
    g.ready.update(dict.fromkeys(g.members, 0))
    assert g.missing() == ([], 0)
    assert in_rank_order(g.members, {"w9", "w1", "w5"}) == ["w1", "w5", "w9"]

"""Abandoned collectives and exiting: elastrain.runtime.group's Waiter, Graveyard and
settle_before_exit.

A worker that leaves while an all-reduce it gave up on is still pending must exit
with its own code once its peers drop the group, not die of SIGABRT because the
blocked thread woke during interpreter shutdown. The in-process test builds a
2-member gloo group from two threads on a HashStore; the process test runs the
exiting member as a real process (`python tests/test_group.py RANK PORT MODE`), the
TCPStore on port 0 in the test process, and kills both by PID in teardown.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.exitcodes import EXIT_LEFT
from elastrain.runtime.group import (
    CollectiveAborted,
    Graveyard,
    HangCheck,
    Waiter,
    build_group,
    settle_before_exit,
    tensor_allreduce,
)

HERE = Path(__file__).resolve()


def two_groups(store: dist.Store) -> list[Any]:
    """Rank 0's and rank 1's group (the constructor blocks until both arrive)."""
    groups: list[Any] = [None, None]

    def make(rank: int) -> None:
        groups[rank] = build_group(
            store, "g1", rank, 2, host="127.0.0.1", connect_timeout_s=20, op_timeout_s=60
        )

    ts = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(g is not None for g in groups)
    return groups


def test_settle_waits_for_an_abandoned_allreduce_until_the_peer_drops_its_group() -> None:
    pg0, pg1 = two_groups(dist.HashStore())
    waiter, graveyard = Waiter(), Graveyard()
    # Rank 0 contributes; rank 1 never does (it moved on to the next generation).
    works = tensor_allreduce(pg0, [torch.ones(8)])
    with pytest.raises(CollectiveAborted) as e:
        waiter.wait(works, 60.0, lambda: True)
    assert e.value.reason == "superseded"
    graveyard.bury(pg0, works)
    del pg0, works
    # Both the abandoned wait's helper and the reaper are still blocked in gloo:
    # exiting now would let them wake during interpreter shutdown.
    assert settle_before_exit(waiter, graveyard, "w0", 0.2) == 2
    assert len(graveyard) == 1
    del pg1  # rank 1 drops its group: its sockets close and rank 0's work fails
    assert settle_before_exit(waiter, graveyard, "w0", 20.0) == 0
    assert len(graveyard) == 0 and waiter.blocked() == [] and graveyard.blocked() == []


def test_settle_returns_at_once_when_nothing_is_pending() -> None:
    pg0, pg1 = two_groups(dist.HashStore())
    waiter, graveyard = Waiter(), Graveyard()
    works0 = tensor_allreduce(pg0, [torch.ones(4)])
    works1 = tensor_allreduce(pg1, [torch.ones(4)])
    waiter.wait(works0, 20.0, lambda: False)
    waiter.wait(works1, 20.0, lambda: False)
    graveyard.bury(pg0, works0)
    graveyard.bury(pg1, works1)
    assert settle_before_exit(waiter, graveyard, "w0", 20.0) == 0
    assert len(graveyard) == 0


def test_waits_reuse_one_helper_thread_and_close_ends_it() -> None:
    """A wait that ended hands its helper thread to the next wait (starting a thread
    per all-reduce was a fixed cost of every step); an abandoned helper is not
    reused, and `close` (what an exiting worker does) ends the idle one."""

    class Done:
        def wait(self) -> bool:
            return True

    def helpers() -> list[threading.Thread]:
        return [t for t in threading.enumerate() if t.name == "elastrain-collective"]

    before = set(helpers())
    waiter = Waiter()
    waiter.wait([Done()], 5.0, lambda: False)
    first = [t for t in helpers() if t not in before]
    for _ in range(3):
        waiter.wait([Done()], 5.0, lambda: False)
    assert [t for t in helpers() if t not in before] == first and len(first) == 1
    gate = threading.Event()

    class Pending:
        def wait(self) -> bool:
            return gate.wait(5.0)

    with pytest.raises(CollectiveAborted):
        waiter.wait([Pending()], 5.0, lambda: True)
    assert waiter.blocked() == first  # abandoned inside the wait: not reused
    waiter.wait([Done()], 5.0, lambda: False)
    gate.set()
    first[0].join(5.0)
    assert not first[0].is_alive() and waiter.blocked() == []
    assert len([t for t in helpers() if t not in before]) == 1
    waiter.close()
    assert [t for t in helpers() if t not in before] == []


def test_an_overdue_wait_asks_and_gives_up_only_on_a_confirmed_hang() -> None:
    """Past the soft deadline the wait asks (again every `every_s`); "alive"
    answers keep it waiting for the work, a confirmed hang ends it at once with
    the silent peers named, long before the hard timeout."""
    gate = threading.Event()
    asked: list[float] = []

    class Pending:
        def wait(self) -> bool:
            return gate.wait(10.0)

    def alive_then_done(waited: float) -> tuple[str, ...]:
        asked.append(waited)
        if len(asked) == 3:
            gate.set()  # the slow peer finally arrives
        return ()

    waiter = Waiter()
    waiter.wait([Pending()], 10.0, lambda: False, HangCheck(0.05, 0.02, alive_then_done))
    assert len(asked) == 3 and asked[0] >= 0.05 and asked == sorted(asked)

    gate.clear()
    with pytest.raises(CollectiveAborted) as e:
        waiter.wait([Pending()], 10.0, lambda: False, HangCheck(0.05, 0.02, lambda w: ("w1",)))
    assert e.value.reason == "watchdog" and e.value.confirmed == ("w1",)
    assert "w1" in str(e.value)
    gate.set()
    waiter.close()


@pytest.fixture
def procs() -> Any:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def test_a_member_leaving_with_an_allreduce_pending_exits_with_its_code(procs) -> None:  # type: ignore[no-untyped-def]
    store = dist.TCPStore(
        "127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    for rank in (0, 1):
        cmd = [sys.executable, str(HERE), str(rank), str(store.port)]
        procs.append(subprocess.Popen(cmd, stderr=subprocess.PIPE))
    leaver, peer = procs
    _, err = leaver.communicate(timeout=60)
    assert leaver.returncode == EXIT_LEFT, err.decode()[-2000:]
    assert b"terminate called" not in err
    assert peer.wait(timeout=60) == 0


def member(rank: int, port: int) -> int:
    """One member of a 2-member generation. Rank 0 starts an all-reduce, gives it
    up (its generation was superseded), and leaves; rank 1 never contributes and
    drops its group the moment rank 0 says it is leaving: rank 0's abandoned work
    then fails while rank 0 is on its way out."""
    store = dist.TCPStore("127.0.0.1", port, 3, False, timeout=datetime.timedelta(seconds=30))
    pg = build_group(store, "g1", rank, 2, host="127.0.0.1", connect_timeout_s=20, op_timeout_s=60)
    if rank == 1:
        store.wait(["leaving"])
        del pg
        return 0
    waiter, graveyard = Waiter(), Graveyard()
    works = tensor_allreduce(pg, [torch.ones(1024)])
    try:
        waiter.wait(works, 60.0, lambda: True)
    except CollectiveAborted:
        pass
    graveyard.bury(pg, works)
    del pg, works
    store.set("leaving", "1")
    left = settle_before_exit(waiter, graveyard, "w0", 20.0)
    print(f"rank 0: {left} collective(s) still pending", file=sys.stderr, flush=True)
    return EXIT_LEFT if left == 0 else 1


if __name__ == "__main__":
    sys.exit(member(int(sys.argv[1]), int(sys.argv[2])))

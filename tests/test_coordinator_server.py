"""The coordinator's asyncio HTTP server: long polls, keep-alive, slow clients,
connection limits, restarts on the same port. Real servers on port 0."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from elastrain.control import protocol as p
from elastrain.control import server as server_mod
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer

TOKEN = "t0ken"
SIG = [["w", [2], "torch.float32"]]


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition (not a fixed sleep): fail if it does not hold in time."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.005)


@pytest.fixture
def make_server(tmp_path: Any) -> Iterator[Callable[..., CoordinatorServer]]:
    made: list[CoordinatorServer] = []

    def make(target: int = 2, **kw: Any) -> CoordinatorServer:
        srv = CoordinatorServer(
            CoordinatorConfig(target=target, min_members=1),
            TOKEN,
            run_dir=str(tmp_path / f"s{len(made)}"),
            **kw,
        )
        made.append(srv)
        return srv.start()

    yield make
    for srv in made:
        srv.stop()


def req(method: str, path: str, body: dict[str, Any] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    return (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


class Reader:
    """Reads HTTP responses off one socket, keeping what it read ahead (answers
    to pipelined requests arrive together)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("connection closed")
        self.buf += chunk

    def read(self) -> tuple[int, dict[str, Any], bool]:
        """(status, JSON body, the server closes)."""
        while b"\r\n\r\n" not in self.buf:
            self._more()
        head, _, self.buf = self.buf.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (h.partition(b":") for h in lines[1:])
        }
        n = int(headers.get(b"content-length", b"0"))
        while len(self.buf) < n:
            self._more()
        body, self.buf = self.buf[:n], self.buf[n:]
        return int(lines[0].split()[1]), json.loads(body), headers.get(b"connection") == b"close"


def connect(srv: CoordinatorServer) -> socket.socket:
    return socket.create_connection((srv.host, srv.port), timeout=10)


def test_many_long_polls_all_wake_on_one_change(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    n = 40
    srv = make_server(target=n)
    c = CoordinatorClient(srv.address, TOKEN)
    members = [f"w{i}" for i in range(n)]
    for m in members:
        c.register(p.RegisterRequest(m, 1, "h", SIG))
    for m in members:
        c.rendezvous(p.RendezvousRequest(m, 1, 0, 0, wait_s=0.0))
    assert srv.coord.state.gen is not None and srv.coord.state.gen.is_ready
    out: dict[str, tuple[str, float]] = {}

    def beat(m: str) -> None:
        cl = CoordinatorClient(srv.address, TOKEN)
        t0 = time.monotonic()
        r = cl.heartbeat(p.HeartbeatRequest(m, 1, 1, wait_s=20.0))
        out[m] = (r.status, time.monotonic() - t0)
        cl.close()

    threads = [threading.Thread(target=beat, args=(m,)) for m in members]
    for t in threads:
        t.start()
    wait_until(lambda: len(srv.coord.changes.waiters) == n)  # every poll is parked
    epoch = srv.coord.changes.epoch
    c.register(p.RegisterRequest("joiner", 9, "h", SIG))  # no visible change: nobody wakes
    assert srv.coord.changes.epoch == epoch and len(srv.coord.changes.waiters) == n
    t0 = time.monotonic()
    assert c.exit(p.ExitRequest("w0", 1, -9)).ok
    for t in threads:
        t.join(timeout=10)
    assert time.monotonic() - t0 < 5.0
    assert out.pop("w0")[0] == "expelled"
    assert {s for s, _ in out.values()} == {"changed"} and len(out) == n - 1
    c.close()


def test_pipelined_requests_are_answered_in_order_behind_a_long_poll(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    srv = make_server()
    CoordinatorClient(srv.address, TOKEN).register(p.RegisterRequest("w0", 1, "h", SIG))
    hb = {"member": "w0", "incarnation": 1, "gen": 0, "wait_s": 0.3}
    with connect(srv) as s:
        r = Reader(s)
        s.sendall(
            req("POST", "/v1/heartbeat", hb)
            + req("GET", "/v1/status")
            + req("POST", "/v1/nope", {})
            + req("POST", "/v1/heartbeat", {**hb, "member": "ghost", "wait_s": 0.0})
        )
        t0 = time.monotonic()
        assert r.read()[:2] == (200, {"status": "ok", "gen": 0})
        assert time.monotonic() - t0 >= 0.25  # the long poll held its turn
        status, body, _ = r.read()
        assert status == 200 and "w0" in body["registered"]
        assert r.read()[0] == 404
        status, body, closes = r.read()
        assert (status, body["status"], closes) == (200, "unknown", False)


def test_a_stalled_client_times_out_and_does_not_block_others(
    make_server: Callable[..., CoordinatorServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(server_mod, "BODY_TIMEOUT_S", 0.3)
    srv = make_server()
    with connect(srv) as head_only, connect(srv) as body_short:
        head_only.sendall(b"POST /v1/heartbeat HTTP/1.1\r\nAuthoriz")
        body_short.sendall(req("POST", "/v1/heartbeat", {"member": "w0"})[:-5])
        # Meanwhile others are served at once.
        c = CoordinatorClient(srv.address, TOKEN)
        t0 = time.monotonic()
        assert c.status()["api_version"] == p.API_VERSION
        assert time.monotonic() - t0 < 0.25
        status, body, closes = Reader(head_only).read()
        assert status == 408 and "headers did not arrive" in body["message"] and closes
        status, body, closes = Reader(body_short).read()
        assert status == 408 and "body did not arrive" in body["message"] and closes
        assert head_only.recv(1) == b"" and body_short.recv(1) == b""  # closed
        c.close()


def test_connections_past_the_limit_are_refused_until_one_closes(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    srv = make_server(max_connections=3)
    socks = [connect(srv) for _ in range(3)]
    for s in socks:
        s.sendall(req("GET", "/v1/status"))
        assert Reader(s).read()[0] == 200
    with connect(srv) as extra:
        status, body, closes = Reader(extra).read()
        assert status == 503 and body["error"] == "busy" and closes
    socks.pop().close()
    wait_until(lambda: len(srv.http.connections) == 2)
    with connect(srv) as s:
        s.sendall(req("GET", "/v1/status"))
        assert Reader(s).read()[0] == 200
    for s in socks:
        s.close()


def test_a_restarted_coordinator_binds_the_same_port_at_once(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    first = make_server()
    port = first.port
    c = CoordinatorClient(first.address, TOKEN)
    c.register(p.RegisterRequest("w0", 1, "h", SIG))  # a live keep-alive connection
    first.stop()
    second = make_server(port=port)
    assert second.port == port
    # The old connection is dead; the client reconnects once and is told to register again.
    assert c.heartbeat(p.HeartbeatRequest("w0", 1, 0, 0.0)).status == "unknown"
    c.close()


def test_rendezvous_barrier_over_the_wire_and_a_bounded_waiting_message(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    n = 12
    srv = make_server(target=n)
    c = CoordinatorClient(srv.address, TOKEN)
    for i in range(n):
        c.register(p.RegisterRequest(f"w{i}", 1, "h", SIG))
    r = c.rendezvous(p.RendezvousRequest("w0", 1, 0, 0, wait_s=0.0))
    assert r.status == "pending"
    assert r.message == "generation 1: waiting for w1, w2, w3, w4, w5 and 6 more"
    got: list[p.RendezvousResponse] = []
    t = threading.Thread(
        target=lambda: got.append(
            CoordinatorClient(srv.address, TOKEN).rendezvous(
                p.RendezvousRequest("w1", 1, 0, 3, wait_s=20.0)
            )
        )
    )
    t.start()
    wait_until(lambda: len(srv.coord.changes.waiters) == 1)
    for i in range(2, n):
        c.rendezvous(p.RendezvousRequest(f"w{i}", 1, 0, 2, wait_s=0.0))
    t.join(timeout=10)
    assert got and got[0].status == "ready" and got[0].start_step == 3
    assert got[0].members == [f"w{i}" for i in range(n)] and got[0].committed["w1"] == 3
    c.close()


def test_a_handoff_at_a_step_boundary_is_heard_at_once_by_the_old_generations_members(
    make_server: Callable[..., CoordinatorServer],
) -> None:
    """A generation superseded at a step boundary (here: a member leaves) aborts
    nobody's collectives, so its members' heartbeats do not say "changed". But a
    member that can compute no step in it (a sharded generation without a complete
    replica group) makes no quorum call, and learns of the next generation from its
    heartbeat alone: "superseded", at once, not when its long poll runs out (a
    member waiting so was expelled as not ready when the new generation's ready
    timeout passed)."""
    srv = make_server(target=2)
    c = CoordinatorClient(srv.address, TOKEN)
    for m in ("w0", "w1"):
        c.register(p.RegisterRequest(m, 1, "h", SIG))
    for m in ("w0", "w1"):
        c.rendezvous(p.RendezvousRequest(m, 1, 0, 0, wait_s=0.0))
    assert srv.coord.state.gen is not None and srv.coord.state.gen.gen == 1

    beat: dict[str, p.HeartbeatResponse] = {}

    def heartbeat() -> None:
        cl = CoordinatorClient(srv.address, TOKEN)
        beat["w1"] = cl.heartbeat(p.HeartbeatRequest("w1", 1, 1, wait_s=30.0))
        cl.close()

    t = threading.Thread(target=heartbeat)
    t.start()
    wait_until(lambda: len(srv.coord.changes.waiters) == 1)  # w1's poll is parked
    r = c.quorum(p.QuorumRequest("w0", 1, 1, 1, leaving=True))
    assert (r.verdict, r.gen) == (p.Verdict.REGROUP, 2)
    assert not srv.coord.state.gen_interrupted(1)  # a clean handoff: nothing aborted
    t.join(timeout=10)
    assert not t.is_alive(), "the heartbeat waited out its long poll"
    assert (beat["w1"].status, beat["w1"].gen) == (p.HeartbeatStatus.SUPERSEDED, 2)
    # The next beat, of a member still in generation 1, is answered at once too.
    hb = c.heartbeat(p.HeartbeatRequest("w1", 1, 1, wait_s=30.0))
    assert (hb.status, hb.gen) == (p.HeartbeatStatus.SUPERSEDED, 2)
    c.close()

"""The coordinator's wire API against a real server on port 0: auth, schema, errors."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorRefused
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import CoordinatorServer

TOKEN = "s3cret-token"
SIG = [["w", [2, 2], "torch.float32"]]


@pytest.fixture
def server(tmp_path: object) -> Iterator[CoordinatorServer]:
    srv = CoordinatorServer(
        CoordinatorConfig(target=2, min_members=1), TOKEN, run_dir=str(tmp_path)
    )
    srv.start()
    yield srv
    srv.stop()


def raw(
    srv: CoordinatorServer, method: str, path: str, body: bytes | None, token: str | None = TOKEN
) -> tuple[int, dict[str, object]]:
    c = http.client.HTTPConnection(srv.host, srv.port, timeout=5)
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    out = json.loads(r.read())
    c.close()
    return r.status, out


def test_binds_loopback_on_an_ephemeral_port(server: CoordinatorServer) -> None:
    assert server.host == "127.0.0.1" and server.port > 0 and server.store.port > 0


def test_register_heartbeat_status_roundtrip(server: CoordinatorServer) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    r = c.register(p.RegisterRequest("w0", 123, "h", SIG))
    assert r.incarnation == 1 and r.store_port == server.store.port
    hb = c.heartbeat(p.HeartbeatRequest("w0", 1, 0, 0.0))
    assert hb.status == "ok"
    st = c.status()
    assert st["registered"]["w0"]["pid"] == 123 and st["api_version"] == p.API_VERSION
    c.close()


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_missing_or_wrong_token_is_refused(server: CoordinatorServer, token: str | None) -> None:
    body = json.dumps({"member": "w0", "pid": 1, "host": "h", "signature": SIG}).encode()
    status, out = raw(server, "POST", "/v1/register", body, token=token)
    assert status == 401 and out["error"] == "unauthorized"
    assert raw(server, "GET", "/v1/status", None, token=token)[0] == 401
    assert server.coord.state.members == {}


def test_token_of_another_job_is_refused(server: CoordinatorServer) -> None:
    other = CoordinatorClient(server.address, "token-of-another-job")
    with pytest.raises(CoordinatorRefused) as e:
        other.register(p.RegisterRequest("w0", 1, "h", SIG))
    assert e.value.status == 401


@pytest.mark.parametrize(
    "body, needle",
    [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"member": "w0"}).encode(), "missing field"),
        (
            json.dumps({"member": "w0", "pid": "x", "host": "h", "signature": []}).encode(),
            "integer",
        ),
        (
            json.dumps(
                {"member": "w0", "pid": 1, "host": "h", "signature": [], "extra": 1}
            ).encode(),
            "unknown field",
        ),
        (b"\xff\xfe", "not JSON"),
    ],
)
def test_malformed_requests_get_a_clear_400(
    server: CoordinatorServer, body: bytes, needle: str
) -> None:
    status, out = raw(server, "POST", "/v1/register", body)
    assert status == 400 and out["error"] == "malformed"
    assert needle in str(out["message"])


def test_unknown_op_and_version(server: CoordinatorServer) -> None:
    status, out = raw(server, "POST", "/v1/frobnicate", b"{}")
    assert status == 404 and "known" in str(out["message"])
    status, out = raw(server, "POST", "/v2/register", b"{}")
    assert status == 404 and "/v1/" in str(out["message"])


def test_mismatched_joiner_is_refused_and_the_job_is_unharmed(server: CoordinatorServer) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    c.register(p.RegisterRequest("w0", 1, "h", SIG))
    bad = [["w", [2, 3], "torch.float32"]]
    with pytest.raises(CoordinatorRefused) as e:
        c.register(p.RegisterRequest("w1", 2, "h", bad))
    assert e.value.status == 409 and "w" in e.value.message and "shape" in e.value.message.lower()
    assert list(server.coord.state.members) == ["w0"]
    assert c.heartbeat(p.HeartbeatRequest("w0", 1, 0, 0.0)).status == "ok"


def test_heartbeat_says_unknown_to_strangers_and_expelled_to_stale_incarnations(
    server: CoordinatorServer,
) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    # Never registered here (e.g. the coordinator restarted): register again.
    assert c.heartbeat(p.HeartbeatRequest("ghost", 1, 0, 0.0)).status == "unknown"
    inc = c.register(p.RegisterRequest("w0", 1, "h", SIG)).incarnation
    assert c.register(p.RegisterRequest("w0", 1, "h", SIG)).incarnation == inc + 1
    assert c.heartbeat(p.HeartbeatRequest("w0", inc, 0, 0.0)).status == "expelled"


def test_restarted_coordinator_adopts_the_generation_workers_report(
    server: CoordinatorServer,
) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    members = ["w0", "w1"]
    r = c.register(
        p.RegisterRequest(
            "w1", 2, "h", SIG, gen=5, gen_members=members, committed=30, prev_incarnation=3
        )
    )
    assert r.incarnation == 4
    assert c.quorum(p.QuorumRequest("w1", 4, 5, 30)).verdict == "proceed"
    assert c.quorum(p.QuorumRequest("w0", 1, 5, 30)).verdict == "unknown"
    st = c.status()
    assert st["gen"] == 5 and st["members"] == members and st["step"] == 30
    # A newcomer learns how far the job is: it will be healed, and prepares for it.
    assert c.register(p.RegisterRequest("w2", 3, "h", SIG)).progress_step == 30


def test_registration_in_a_fresh_job_says_nobody_is_ahead(server: CoordinatorServer) -> None:
    c = CoordinatorClient(server.address, TOKEN)
    assert c.register(p.RegisterRequest("w0", 1, "h", SIG)).progress_step == 0


def test_decode_is_strict() -> None:
    with pytest.raises(p.ProtocolError, match="expected true/false"):
        p.decode(
            p.QuorumRequest, {"member": "a", "incarnation": 1, "gen": 1, "step": 0, "leaving": 1}
        )
    q = p.decode(
        p.QuorumRequest, {"member": "a", "incarnation": 1, "gen": 1, "step": 0, "last_loss": 2}
    )
    assert q.last_loss == 2.0 and q.leaving is False

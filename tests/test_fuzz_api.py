"""Hostile input against the coordinator's wire API (issue 5, item 4).

1. Decoding: `protocol.decode(cls, value)` on arbitrary and near-valid JSON either
   returns a valid message or raises ProtocolError, never anything else.
2. A live `CoordinatorServer` on port 0, fuzzed over raw sockets (random methods,
   paths, tokens, bodies, framing): every answer is 200 for a valid request or a
   JSON 4xx that says why, never a 5xx, a dropped or a hung connection, and the
   server answers a status request afterwards. Every socket has a timeout, so a
   hang fails the test instead of stalling it.
3. Regressions for the bugs the fuzzing found, and the token checks that
   tests/test_coordinator_api.py does not already make: two jobs side by side,
   every op refused without effect, replays from another job or incarnation.
"""

from __future__ import annotations

import dataclasses
import http.client
import io
import json
import math
import re
import socket
import time
from collections.abc import Iterator
from typing import Any, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastrain.control import protocol as p
from elastrain.control import server as server_mod
from elastrain.control.client import CoordinatorClient
from elastrain.control.config import CoordinatorConfig
from elastrain.control.server import MAX_BODY, ROUTES, CoordinatorServer

TOKEN = "fuzz-token-A"
OTHER_TOKEN = "fuzz-token-B"
SIG = [["w", [2, 2], "torch.float32"]]
SOCKET_TIMEOUT_S = 5.0
"""Longer than any answer may take (long polls are capped at 0.2 s here)."""
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

REQUESTS: list[type] = [cls for cls, _ in ROUTES.values()]
MESSAGES: list[type] = REQUESTS + [
    p.RegisterResponse,
    p.HeartbeatResponse,
    p.RendezvousResponse,
    p.QuorumResponse,
    p.HangResponse,
    p.OkResponse,
]
VALID: dict[type, dict[str, Any]] = {
    p.RegisterRequest: {"member": "w0", "pid": 7, "host": "h", "signature": SIG},
    p.HeartbeatRequest: {"member": "w0", "incarnation": 1, "gen": 0, "wait_s": 0.0},
    p.RendezvousRequest: {
        "member": "w0",
        "incarnation": 1,
        "known_gen": 0,
        "committed": 0,
        "wait_s": 0.0,
    },
    p.QuorumRequest: {"member": "w0", "incarnation": 1, "gen": 1, "step": 0, "last_loss": 1.5},
    p.LeaveRequest: {"member": "nobody", "incarnation": 1, "reason": "left", "committed": 0},
    p.HangRequest: {"member": "nobody", "incarnation": 1, "gen": 1, "step": 0, "waited_s": 0.5},
    p.ExitRequest: {"member": "nobody", "pid": 1, "returncode": -9},
    p.PreemptRequest: {"grace_s": 30.0},
}
OP_OF = {cls: op for op, (cls, _) in ROUTES.items()}

# ---------------------------------------------------------------- strategies

HUGE = [2**63, -(2**63) - 1, 10**30, -(10**400), 10**400]
leaf = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.sampled_from(HUGE + [2**63 - 1, -(2**63)])
    | st.floats()  # NaN and +-inf included
    | st.text(max_size=12)
)
json_values = st.recursive(
    leaf,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=16,
)


@st.composite
def near_valid(draw: st.DrawFn, cls: type) -> dict[str, Any]:
    """A valid body of `cls` with one or two fields replaced, dropped or added."""
    body = dict(VALID[cls])
    for _ in range(draw(st.integers(1, 2))):
        how = draw(st.sampled_from(["replace", "replace", "drop", "add"]))
        if how == "add":
            body[draw(st.text(max_size=10))] = draw(json_values)
        elif body:
            name = draw(st.sampled_from(sorted(body)))
            if how == "drop":
                del body[name]
            else:
                body[name] = draw(json_values)
    return body


def bodies_for(cls: type) -> st.SearchStrategy[Any]:
    return near_valid(cls) | json_values | st.just(VALID[cls])


# ---------------------------------------------------------------- 1. decoding


def _assert_valid_message(cls: type, msg: Any) -> None:
    assert isinstance(msg, cls)
    hints = get_type_hints(cls)
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if hints[f.name] is int:
            assert isinstance(value, int) and p.INT_MIN <= value <= p.INT_MAX, (f.name, value)
        if hints[f.name] is float and f.name.endswith("_s"):
            assert math.isfinite(value) and value >= 0, (f.name, value)
    # What decode accepted survives the trip through the wire unchanged.
    wire = json.dumps(p.encode(msg))
    assert json.dumps(p.encode(p.decode(cls, json.loads(wire)))) == wire


@FUZZ
@given(data=st.data())
def test_decode_returns_a_valid_message_or_raises_protocol_error(data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(MESSAGES))
    body = data.draw(near_valid(cls) if cls in VALID else json_values)
    try:
        msg = p.decode(cls, body)
    except p.ProtocolError as e:
        assert str(e).startswith(cls.__name__), e  # names the message (and the field)
        return
    _assert_valid_message(cls, msg)


def _decode_generic(cls: type, body: Any) -> Any:
    """`p.decode` with every field taking `_check`'s path (no fast path)."""
    plan, names = p._plan(cls)
    slow = tuple((*f[:4], p._GENERIC, *f[5:]) for f in plan)
    saved = p._plans[cls]
    p._plans[cls] = (slow, names)
    try:
        return p.decode(cls, body)
    finally:
        p._plans[cls] = saved


def _outcome(fn: Any, *args: Any) -> Any:
    try:
        return ("ok", json.dumps(p.encode(fn(*args)), sort_keys=True))
    except p.ProtocolError as e:
        return ("refused", str(e))


@FUZZ
@given(data=st.data())
def test_decodes_fast_paths_answer_as_the_generic_check_does(data: st.DataObject) -> None:
    # The fast paths (exact types, in-range ints and durations, empty containers,
    # null) are a shortcut of `_check`, never a looser rule: same message, or
    # the same refusal, for any body.
    cls = data.draw(st.sampled_from(sorted(VALID, key=lambda c: c.__name__)))
    field = data.draw(st.sampled_from([f.name for f in dataclasses.fields(cls)]))
    value = data.draw(
        st.sampled_from([None, {}, [], "", "x" * 300, 0, -1, 2**63, 1.5, -1.5, math.nan, True])
        | json_values
    )
    body = {**VALID[cls], field: value}
    assert _outcome(p.decode, cls, body) == _outcome(_decode_generic, cls, body)


@pytest.mark.parametrize(
    "cls, field, value, needle",
    [
        (p.HeartbeatRequest, "wait_s", 10**400, "out of range"),  # was OverflowError
        (p.HeartbeatRequest, "wait_s", math.nan, "finite"),
        (p.RendezvousRequest, "wait_s", math.inf, "finite"),
        (p.HeartbeatRequest, "wait_s", -1.0, ">= 0"),
        (p.PreemptRequest, "grace_s", math.inf, "finite"),
        (p.QuorumRequest, "step", 2**63, "64 bits"),
        (p.ExitRequest, "pid", -(2**63) - 1, "64 bits"),
        (p.RegisterRequest, "signature", [[]], "[name, [dim, ...], dtype]"),
        (p.RegisterRequest, "signature", [["w", [-1], "torch.float32"]], "dims >= 0"),
        (p.RegisterRequest, "signature", [["w", [2], 3]], "signature[0]"),
        (p.LeaveRequest, "reason", "bored", '"left" or "done"'),
    ],
)
def test_decode_refuses_what_the_coordinator_cannot_use(
    cls: type, field: str, value: Any, needle: str
) -> None:
    with pytest.raises(p.ProtocolError) as e:
        p.decode(cls, {**VALID[cls], field: value})
    assert needle in str(e.value) and f"{cls.__name__}.{field}" in str(e.value)
    assert len(str(e.value)) < 300  # hostile values are echoed cut short


def test_a_diverged_loss_is_still_a_loss() -> None:
    for loss in (math.nan, math.inf, -math.inf):
        q = p.decode(p.QuorumRequest, {**VALID[p.QuorumRequest], "last_loss": loss})
        assert q.last_loss is not None and not math.isfinite(q.last_loss)


# ---------------------------------------------------------------- 2. a live server


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorServer]:
    """One server for all fuzz examples; long polls and body reads are capped short."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_mod, "MAX_WAIT_S", 0.2)
        mp.setattr(server_mod, "BODY_TIMEOUT_S", 0.3)
        srv = CoordinatorServer(
            CoordinatorConfig(target=1, min_members=1),
            TOKEN,
            run_dir=str(tmp_path_factory.mktemp("fuzz")),
        )
        srv.start()
        try:
            yield srv
        finally:
            srv.stop()


class _KeepOpen(io.BufferedReader):
    def close(self) -> None:
        pass  # HTTPResponse closes its reader; the next response needs what it read ahead


class Conn:
    """A raw client socket with a timeout. Successive responses are parsed from one
    buffered reader (one per HTTPResponse would lose the bytes read ahead)."""

    def __init__(self, srv: CoordinatorServer) -> None:
        self.sock = socket.create_connection((srv.host, srv.port), timeout=SOCKET_TIMEOUT_S)
        self.reader = _KeepOpen(socket.SocketIO(self.sock, "rb"))  # type: ignore[arg-type]

    def makefile(self, *args: Any, **kwargs: Any) -> io.BufferedReader:
        return self.reader

    def sendall(self, data: bytes) -> None:
        self.sock.sendall(data)

    def shutdown(self, how: int) -> None:
        self.sock.shutdown(how)

    def recv(self, n: int) -> bytes:
        return self.sock.recv(n)

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def connect(srv: CoordinatorServer) -> Conn:
    return Conn(srv)


def request_bytes(
    method: str, path: str, body: bytes, headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: fuzz"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    if "Content-Length" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def read_response(sock: Conn, method: str = "POST") -> tuple[int, bytes, bool]:
    """(status, body, server closes) of one response; TimeoutError means it hung."""
    r = http.client.HTTPResponse(sock, method=method)  # type: ignore[arg-type]
    r.begin()
    body = r.read()
    return r.status, body, r.will_close


def exchange(srv: CoordinatorServer, raw: bytes, method: str = "POST") -> tuple[int, bytes]:
    with connect(srv) as s:
        s.sendall(raw)
        status, body, _ = read_response(s, method)
    return status, body


def auth(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def assert_clear_error(status: int, body: bytes) -> dict[str, Any]:
    assert 400 <= status < 500, (status, body)
    doc = json.loads(body)
    assert isinstance(doc, dict) and set(doc) == {"error", "message"}, doc
    assert isinstance(doc["error"], str) and isinstance(doc["message"], str) and doc["message"]
    return doc


def assert_healthy(srv: CoordinatorServer) -> None:
    status, body = exchange(srv, request_bytes("GET", "/v1/status", b"", auth()), "GET")
    assert status == 200 and json.loads(body)["api_version"] == p.API_VERSION


def expected_status(method: str, path: str, token: str | None, body: bytes) -> int | None:
    """The status the wire API promises, or None for "200, or 409 for a register"."""
    if method not in ("GET", "POST"):
        return 405
    if path.startswith("//"):  # http.server's guard against open redirects
        path = "/" + path.lstrip("/")
    if token != TOKEN:
        return 401
    if not path.startswith(p.PREFIX):
        return 404
    op = path[len(p.PREFIX) :]
    if method == "GET":
        return 200 if op == "status" else 404
    if op not in ROUTES:
        return 404
    try:
        p.decode(ROUTES[op][0], json.loads(body or b"null"))
    except (ValueError, RecursionError):  # ProtocolError is a ValueError
        return 400
    return None


paths = st.sampled_from(
    [f"/v1/{op}" for op in ROUTES] + ["/v1/status", "/v1/", "/v2/register", "/", "/v1/status?x=1"]
) | st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x85\xa0"),
    max_size=30,
).map(lambda s: "/" + s)
methods = st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE", "PATCH", "OPTIONS"]) | (
    st.text(st.characters(min_codepoint=ord("A"), max_codepoint=ord("Z")), min_size=1, max_size=8)
)
tokens = st.sampled_from([TOKEN, TOKEN, TOKEN, None, OTHER_TOKEN, TOKEN + "x", TOKEN[:-1], ""])


@st.composite
def http_bodies(draw: st.DrawFn, path: str) -> bytes:
    op = path[len(p.PREFIX) :] if path.startswith(p.PREFIX) else ""
    cls = ROUTES[op][0] if op in ROUTES else draw(st.sampled_from(REQUESTS))
    kind = draw(st.sampled_from(["json", "json", "json", "bytes", "deep", "unicode"]))
    if kind == "json":
        return json.dumps(draw(bodies_for(cls))).encode()  # NaN/Infinity tokens too
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "deep":
        n = draw(st.integers(1, 200_000))
        return b"[" * n + b"]" * draw(st.integers(0, n))
    text = draw(st.text(max_size=20))  # lone surrogates too
    return json.dumps({**VALID[cls], "member": text}, ensure_ascii=False).encode(
        "utf-8", "surrogatepass"
    )


@FUZZ
@given(data=st.data())
def test_fuzzed_requests_get_200_or_a_clear_4xx(
    fuzz_server: CoordinatorServer, data: st.DataObject
) -> None:
    method, path, token = data.draw(methods), data.draw(paths), data.draw(tokens)
    # http.server refuses other methods before reading the body; a body left unread
    # when the server closes makes the kernel reset the connection, so send none.
    body = data.draw(http_bodies(path)) if method in ("GET", "POST") else b""
    headers = auth(token) if token is not None else {}
    with connect(fuzz_server) as s:
        s.sendall(request_bytes(method, path, body, headers))
        status, reply, closes = read_response(s, method)
        want = expected_status(method, path, token, body)
        if want is None:
            op = path[len(p.PREFIX) :]
            assert status == 200 or (op == "register" and status == 409), (status, reply)
        else:
            assert status == want, (status, reply)
        if status == 200:
            assert isinstance(json.loads(reply), dict)
        elif method != "HEAD":
            assert_clear_error(status, reply)
        if not closes:  # keep-alive must still be in step: the next request works
            s.sendall(request_bytes("GET", "/v1/status", b"", auth()))
            assert read_response(s, "GET")[0] == 200
    assert_healthy(fuzz_server)


@settings(FUZZ, max_examples=60)
@given(
    raw=st.binary(max_size=300) | st.text(max_size=200).map(lambda t: t.encode("utf-8", "replace"))
)
def test_arbitrary_bytes_never_crash_or_hang_the_server(
    fuzz_server: CoordinatorServer, raw: bytes
) -> None:
    t0 = time.monotonic()
    with connect(fuzz_server) as s:
        s.sendall(raw)
        s.shutdown(socket.SHUT_WR)  # the server sees the end of whatever it got
        out = b""
        try:
            while chunk := s.recv(65536):  # the server must close: TimeoutError otherwise
                out += chunk
        except ConnectionResetError:
            pass  # the server answered and closed with some of our bytes unread: fine
    assert time.monotonic() - t0 < SOCKET_TIMEOUT_S
    for code in re.findall(rb"HTTP/1\.[01] (\d{3}) ", out):
        assert int(code) < 500, out
    assert_healthy(fuzz_server)


VALID_EXIT = json.dumps(VALID[p.ExitRequest]).encode()


@pytest.mark.parametrize(
    "raw, status, needle",
    [
        # Content-Length longer than the body, the client then waits: 408, not a hang.
        (request_bytes("POST", "/v1/exit", b"{}", {**auth(), "Content-Length": "50"}), 408, "did not arrive"),
        (request_bytes("POST", "/v1/exit", b"", {**auth(), "Content-Length": "-5"}), 400, "byte count"),
        (request_bytes("POST", "/v1/exit", b"", {**auth(), "Content-Length": "1e3"}), 400, "byte count"),
        (request_bytes("POST", "/v1/exit", b"", {**auth(), "Content-Length": "9" * 30}), 400, "byte count"),
        (request_bytes("POST", "/v1/exit", b"", {**auth(), "Content-Length": str(MAX_BODY + 1)}), 400, "exceeds"),
        # Nothing is sent past the point where the server refuses: bytes it never
        # reads make the kernel reset the connection, and the answer may be lost.
        (request_bytes("POST", "/v1/exit", b"", {**auth(), "Transfer-Encoding": "chunked"}), 400, "chunked"),
        (request_bytes("PUT", "/v1/exit", b"", auth()), 405, "'PUT' not allowed"),  # was 501 HTML
        (b"POST /v1/exit HTTP/2.0\r\n", 400, "HTTP"),  # was 505 with no status line
        (b"POST /v1/exit x HTTP/1.1\r\n", 400, "syntax"),  # was a body with no status line
        (b"GET /v1/" + b"x" * (65537 - 8), 414, "URI"),  # exactly what the server reads
        (b"GET /v1/status HTTP/1.1\r\n" + b"X-a: 1\r\n" * 101, 431, "headers"),
        (request_bytes("POST", "/v1/exit", b"[" * 100_000, auth()), 400, "not JSON"),  # was RecursionError
    ],
)  # fmt: skip
def test_broken_framing_gets_a_clear_4xx_and_a_closed_connection(
    fuzz_server: CoordinatorServer, raw: bytes, status: int, needle: str
) -> None:
    with connect(fuzz_server) as s:
        s.sendall(raw)
        got, body, closes = read_response(s)
        assert got == status and needle in assert_clear_error(got, body)["message"], body
        if status != 400 or b"not JSON" not in body:
            assert closes  # the rest of the stream cannot be trusted
    assert_healthy(fuzz_server)


def test_short_body_then_half_close_and_overlong_body_are_refused(
    fuzz_server: CoordinatorServer,
) -> None:
    with connect(fuzz_server) as s:
        s.sendall(request_bytes("POST", "/v1/exit", b"{}", {**auth(), "Content-Length": "9"}))
        s.shutdown(socket.SHUT_WR)
        got, body, _ = read_response(s)
    assert got == 400 and "ended after 2 of 9 bytes" in assert_clear_error(got, body)["message"]
    # Content-Length shorter than the body: the request is what the length says, the
    # rest is a (broken) next request on the same connection, refused on its own.
    with connect(fuzz_server) as s:
        s.sendall(request_bytes("POST", "/v1/exit", VALID_EXIT + b"GARBAGE\r\n",
                                {**auth(), "Content-Length": str(len(VALID_EXIT))}))  # fmt: skip
        assert read_response(s)[:2] == (200, b'{"ok": false}')
        got, body, closes = read_response(s)
        assert got == 400 and closes
        assert_clear_error(got, body)
    assert_healthy(fuzz_server)


# ---------------------------------------------------------------- 3. regressions and tokens


@pytest.fixture
def job_a(tmp_path: Any) -> Iterator[CoordinatorServer]:
    srv = CoordinatorServer(
        CoordinatorConfig(target=1), TOKEN, run_dir=str(tmp_path / "a"), job_id="job-a"
    )
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def job_b(tmp_path: Any) -> Iterator[CoordinatorServer]:
    srv = CoordinatorServer(
        CoordinatorConfig(target=1), OTHER_TOKEN, run_dir=str(tmp_path / "b"), job_id="job-b"
    )
    srv.start()
    yield srv
    srv.stop()


def post(
    srv: CoordinatorServer, op: str, body: dict[str, Any], token: str = TOKEN
) -> tuple[int, dict[str, Any]]:
    status, reply = exchange(
        srv, request_bytes("POST", f"/v1/{op}", json.dumps(body).encode(), auth(token))
    )
    return status, json.loads(reply)


def test_a_malformed_signature_cannot_poison_the_job(job_a: CoordinatorServer) -> None:
    """Before: the first registrant's signature [[]] was stored, and every later
    register died with IndexError (connection dropped, nobody could join)."""
    status, out = post(job_a, "register", {**VALID[p.RegisterRequest], "signature": [[]]})
    assert status == 400 and "signature[0]" in out["message"]
    assert job_a.coord.state.signature is None and not job_a.coord.state.members
    assert post(job_a, "register", VALID[p.RegisterRequest])[0] == 200


def test_extreme_but_valid_numbers_keep_status_working(job_a: CoordinatorServer) -> None:
    """A committed step of 2**63 - 1 (the most the wire allows) must not break the
    status page's throughput arithmetic; 10**30 is refused at the door."""
    c = CoordinatorClient(job_a.address, TOKEN)
    inc = c.register(p.RegisterRequest("w0", 1, "h", SIG)).incarnation
    r = c.rendezvous(p.RendezvousRequest("w0", inc, 0, 0, wait_s=5.0))
    assert r.status == "ready"
    for step in (0, p.INT_MAX):
        assert (
            c.quorum(p.QuorumRequest("w0", inc, r.gen, step, last_loss=math.nan)).verdict
            == "proceed"
        )
    status, out = post(
        job_a, "quorum", {"member": "w0", "incarnation": inc, "gen": r.gen, "step": 10**30}
    )
    assert status == 400 and "64 bits" in out["message"]
    st_ = c.status()
    assert st_["step"] == p.INT_MAX and math.isnan(st_["loss"]) and st_["steps_per_s"] > 0
    c.close()


def _state(srv: CoordinatorServer) -> tuple[Any, ...]:
    s = srv.coord.state
    members = {m.id: (m.incarnation, m.pid, m.leaving) for m in s.members.values()}
    return members, s.finished, s.progress_step, srv.coord.status()["preempting"]


def test_requests_with_another_jobs_token_are_refused_without_effect(
    job_a: CoordinatorServer, job_b: CoordinatorServer
) -> None:
    """Two jobs with the same member name and incarnation: every request made for
    job A (A's token), replayed verbatim to job B, is refused and changes nothing."""
    a = CoordinatorClient(job_a.address, TOKEN)
    b = CoordinatorClient(job_b.address, OTHER_TOKEN)
    ra = a.register(p.RegisterRequest("w0", 11, "h", SIG))
    rb = b.register(p.RegisterRequest("w0", 11, "h", SIG))
    assert ra.incarnation == rb.incarnation == 1 and ra.job_id != rb.job_id
    before = _state(job_b)
    captured = {
        "heartbeat": {"member": "w0", "incarnation": 1, "gen": 0, "wait_s": 0.0},
        "rendezvous": {"member": "w0", "incarnation": 1, "known_gen": 0, "committed": 0, "wait_s": 0.0},
        "quorum": {"member": "w0", "incarnation": 1, "gen": 1, "step": 0, "leaving": True},
        "leave": {"member": "w0", "incarnation": 1, "reason": "done", "committed": 5},
        "exit": {"member": "w0", "pid": 11, "returncode": 0},
        "hang": {"member": "w0", "incarnation": 1, "gen": 1, "step": 0, "waited_s": 0.5},
        "preempt": {"grace_s": 1.0},
        "register": {"member": "w0", "pid": 11, "host": "h", "signature": SIG},
    }  # fmt: skip
    assert set(captured) == set(ROUTES)
    for op, body in captured.items():
        status, out = post(job_b, op, body, token=TOKEN)
        assert status == 401 and out == {"error": "unauthorized", "message": "wrong job token"}
    status, _ = exchange(job_b, request_bytes("GET", "/v1/status", b"", auth(TOKEN)), "GET")
    assert status == 401
    assert _state(job_b) == before
    # The same requests with B's own token do take effect: the refusal was the token.
    assert post(job_b, "exit", captured["exit"], token=OTHER_TOKEN) == (200, {"ok": True})
    assert "w0" not in job_b.coord.state.members and "w0" in job_a.coord.state.members
    a.close()
    b.close()


@pytest.mark.parametrize(
    "header",
    [
        f"Basic {TOKEN}",
        f"Token {TOKEN}",
        TOKEN,
        f"Bearer {TOKEN[:-1]}",
        f"Bearer {TOKEN}x",
        f"Bearer {OTHER_TOKEN}",  # same length, different bytes
        "Bearer \u00e9t\u00e9",  # latin-1 bytes on the wire
        "Bearer",
    ],
)
def test_malformed_or_near_miss_authorization_is_refused(
    job_a: CoordinatorServer, header: str
) -> None:
    raw = request_bytes("POST", "/v1/preempt", b'{"grace_s": 1.0}', {"Authorization": header})
    status, body = exchange(job_a, raw)
    assert status == 401 and assert_clear_error(status, body)["error"] == "unauthorized"
    assert not job_a.coord.status()["preempting"]


def test_replays_from_an_earlier_incarnation_change_nothing(job_a: CoordinatorServer) -> None:
    """w0 registered twice (pid 11, then pid 12): requests of incarnation 1 are stale."""
    c = CoordinatorClient(job_a.address, TOKEN)
    assert c.register(p.RegisterRequest("w0", 11, "h", SIG)).incarnation == 1
    assert c.register(p.RegisterRequest("w0", 12, "h", SIG)).incarnation == 2
    before = _state(job_a)
    assert c.heartbeat(p.HeartbeatRequest("w0", 1, 0)).status == "expelled"
    assert c.quorum(p.QuorumRequest("w0", 1, 1, 0, leaving=True)).verdict == "expelled"
    assert c.rendezvous(p.RendezvousRequest("w0", 1, 0, 0, wait_s=0.0)).status == "expelled"
    assert c.leave(p.LeaveRequest("w0", 1, "done", 3)).ok is False
    assert c.exit(p.ExitRequest("w0", 11, 0)).ok is False
    assert _state(job_a) == before and not job_a.coord.state.finished
    assert c.heartbeat(p.HeartbeatRequest("w0", 2, 0)).status == "ok"
    c.close()

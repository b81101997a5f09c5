"""The coordinator client's own HTTP/1.1 framing, against a scripted server on
port 0: what it sends, how it reads answers cut into pieces, and which answers
it refuses (the connection is dropped and the call fails as unavailable)."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import pytest

from elastrain.control import protocol as p
from elastrain.control.client import (
    CoordinatorClient,
    CoordinatorError,
    CoordinatorRefused,
    CoordinatorUnavailable,
)

TOKEN = "wire-token"

# What the scripted server does with one request: send these pieces (each its
# own write, so the client sees an answer arrive in parts), then close or not.
Script = tuple[list[bytes], bool]


class ScriptedServer:
    """Accepts connections one after another and answers each request with the
    next script; records every request (head, body) it read."""

    def __init__(self, scripts: list[Script]) -> None:
        self.scripts = list(scripts)
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.scripts:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._answer_all(conn)

    def _answer_all(self, conn: socket.socket) -> None:
        buf = b""
        while self.scripts:
            while b"\r\n\r\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(buf) < length:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            self.requests.append((head, buf[:length]))
            buf = buf[length:]
            pieces, close = self.scripts.pop(0)
            for piece in pieces:
                conn.sendall(piece)
            if close:
                return

    def stop(self) -> None:
        self.scripts.clear()
        if self.sock.fileno() >= 0:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept
            self.sock.close()
        self.thread.join(timeout=10)
        assert not self.thread.is_alive()


@pytest.fixture
def serve() -> Iterator[type[ScriptedServer]]:
    started: list[ScriptedServer] = []

    class Tracked(ScriptedServer):
        def __init__(self, scripts: list[Script]) -> None:
            super().__init__(scripts)
            started.append(self)

    yield Tracked
    for s in started:
        s.stop()


def answer(body: object, status: int = 200, extra: bytes = b"") -> bytes:
    data = json.dumps(body).encode()
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n%s\r\n%s" % (status, len(data), extra, data)


OK = {"status": "ok", "lease_s": 5.0}


def test_a_request_is_one_message_with_the_token_and_the_json_body(
    serve: type[ScriptedServer],
) -> None:
    srv = serve([([answer(OK)], False)])
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    assert c.call("POST", "heartbeat", {"member": "w0"}) == OK
    c.close()
    head, body = srv.requests[0]
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/heartbeat HTTP/1.1"
    assert b"Authorization: Bearer wire-token" in lines
    assert b"Content-Type: application/json" in lines
    assert json.loads(body) == {"member": "w0"}


def test_answers_cut_anywhere_are_read_whole_and_the_connection_is_kept(
    serve: type[ScriptedServer],
) -> None:
    whole = answer({"n": 1}) + answer({"n": 2})
    first = answer({"n": 1})
    scripts: list[Script] = [
        ([first[:5], first[5:30], first[30:-1], first[-1:]], False),
        # A head cut inside its closing blank line, then the body byte by byte.
        (
            [answer({"n": 2})[:-9], *(bytes([b]) for b in answer({"n": 2})[-9:])],
            False,
        ),
        ([whole[len(first) :]], False),
    ]
    srv = serve(scripts)
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    assert c.call("GET", "status", None) == {"n": 1}
    assert c.call("GET", "status", None) == {"n": 2}
    assert c.call("GET", "status", None) == {"n": 2}
    c.close()
    assert srv.connections == 1


def test_an_answer_framed_by_connection_close_is_read_to_the_end_and_not_reused(
    serve: type[ScriptedServer],
) -> None:
    data = json.dumps(OK).encode()
    srv = serve(
        [
            ([b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n", data[:4], data[4:]], True),
            ([answer(OK)], False),
        ]
    )
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    assert c.call("GET", "status", None) == OK
    assert c.call("GET", "status", None) == OK
    c.close()
    assert srv.connections == 2


def test_an_error_answer_is_refused_with_its_code_and_message(
    serve: type[ScriptedServer],
) -> None:
    srv = serve([([answer({"error": "unauthorized", "message": "bad token"}, 401)], False)])
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    with pytest.raises(CoordinatorRefused) as e:
        c.call("GET", "status", None)
    c.close()
    assert (e.value.status, e.value.code, e.value.message) == (401, "unauthorized", "bad token")


def test_a_closed_keep_alive_connection_is_reopened_once(serve: type[ScriptedServer]) -> None:
    # The first answer keeps the connection by its headers, but the server then
    # closes it (an idle-connection sweep): the next call finds it dead and retries.
    srv = serve([([answer(OK)], True), ([answer({"again": True})], False)])
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    assert c.call("GET", "status", None) == OK
    assert c.call("GET", "status", None) == {"again": True}
    c.close()
    assert srv.connections == 2


@pytest.mark.parametrize(
    "bad, needle",
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
            "chunked",
        ),
        (b"HTTP/1.1 200 OK\r\n\r\n{}", "neither Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n{}", "Content-Length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 40\r\n\r\n{}", "ended after 2 of 40"),
        (b"HTTP/1.1 200 OK\r\nContent-Len", "inside an answer's headers"),
    ],
)
def test_answers_it_cannot_frame_fail_the_call_as_unavailable(
    serve: type[ScriptedServer], bad: bytes, needle: str
) -> None:
    # Twice: the call drops the connection and tries once more, like a stale one.
    srv = serve([([bad], True), ([bad], True)])
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    with pytest.raises(CoordinatorUnavailable, match=needle):
        c.call("GET", "status", None)
    c.close()
    assert srv.connections == 2


def test_an_answer_that_is_not_json_is_a_coordinator_error(serve: type[ScriptedServer]) -> None:
    srv = serve([([b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabc"], False)])
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN)
    with pytest.raises(CoordinatorError, match="invalid JSON"):
        c.call("GET", "status", None)
    c.close()


def test_a_silent_coordinator_times_out_without_a_second_try(
    serve: type[ScriptedServer],
) -> None:
    srv = serve([([], False), ([answer(OK)], False)])  # reads the request, never answers
    c = CoordinatorClient(f"127.0.0.1:{srv.port}", TOKEN, timeout_s=0.2)
    with pytest.raises(CoordinatorUnavailable, match="timed out"):
        c.heartbeat(p.HeartbeatRequest("w0", 1, 0, 0.0))
    c.close()
    srv.stop()  # the server has read all it will: no second connection came
    assert srv.connections == 1


def test_nothing_listening_is_unavailable() -> None:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    c = CoordinatorClient(f"127.0.0.1:{port}", TOKEN, timeout_s=2.0)
    with pytest.raises(CoordinatorUnavailable):
        c.call("GET", "status", None)


@pytest.mark.parametrize(
    "address, token",
    [("127.0.0.1", TOKEN), ("host:port", TOKEN), ("127.0.0.1:1", "a\r\nX-Evil: 1")],
)
def test_an_address_or_token_that_would_break_the_request_is_refused(
    address: str, token: str
) -> None:
    with pytest.raises(ValueError):
        CoordinatorClient(address, token)

"""Client of the coordinator's wire API (see `protocol`).

One `CoordinatorClient` per process; it keeps one HTTP keep-alive connection
per calling thread, so the trainer's main thread and its heartbeat thread never
share a socket. Every call raises `CoordinatorUnavailable` when the coordinator
cannot be reached (the caller decides whether to retry) and `CoordinatorRefused`
when it answers with an error.

The connection speaks the HTTP/1.1 the coordinator's server speaks
(`control/http.py`), by hand: each member asks for a verdict every step, and
`http.client` spent most of a call's CPU building headers one `putheader` at a
time, sending head and body in two writes (two wake-ups of the server's loop)
and parsing the answer's headers with the `email` package. A request here is
one write; an answer is read with one buffered read loop and framed by its
Content-Length (or by the end of the stream when it says `Connection: close`).
"""

from __future__ import annotations

import json
import socket
import threading
from typing import Any, TypeVar

from elastrain.control import protocol as p

T = TypeVar("T")


class CoordinatorError(RuntimeError):
    pass


class CoordinatorUnavailable(CoordinatorError):
    """Connection refused, reset or timed out."""


class CoordinatorRefused(CoordinatorError):
    """The coordinator answered with an error status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"coordinator refused ({status} {code}): {message}")
        self.status = status
        self.code = code
        self.message = message

    @property
    def transient(self) -> bool:
        """Worth asking again: see `transient_status`."""
        return transient_status(self.status)


def transient_status(status: int) -> bool:
    """An error answer that says "not now" rather than "no": 408 (the request
    was too slow), 429 and 503 (busy, e.g. the connection limit) and every
    other 5xx. A 4xx otherwise (400 malformed, 401 wrong token, 409 model
    mismatch) will be the same next time: the caller must not retry it."""
    return status in (408, 429) or 500 <= status <= 599


def backoff_s(attempt: int, *, base_s: float, cap_s: float, jitter: float) -> float:
    """Delay before retry `attempt` (0-based): exponential from `base_s`, at
    most `cap_s`, scaled by `jitter` in [0.5, 1.5) so that members refused
    together do not all come back at the same instant."""
    return min(cap_s, base_s * (2.0 ** min(attempt, 30))) * jitter


MAX_ANSWER_HEAD = 16 * 1024
"""Bytes an answer's status line and headers may take (the server's are ~90)."""

MAX_ANSWER_BODY = 64 * 1024 * 1024
"""Bytes an answer's body may take (a status of 100k members is a few MB)."""


class BadAnswer(ConnectionError):
    """The bytes on the connection are not an HTTP/1.1 answer this client reads:
    the connection is dropped (and the call tried once more, like a stale one)."""


class _Connection:
    """One keep-alive HTTP/1.1 connection to the coordinator, used by one thread."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.reusable = True

    def close(self) -> None:
        self.sock.close()

    def exchange(self, request: bytes, timeout: float) -> tuple[int, bytes]:
        """Send one request, return (status, body) of its answer."""
        self.sock.settimeout(timeout)
        if self.buf:
            raise BadAnswer(f"{len(self.buf)} bytes arrived unasked for")
        self.sock.sendall(request)
        end = self._fill_until_head()
        head = bytes(self.buf[:end])
        del self.buf[: end + 4]
        status, length, close = _read_head(head)
        if length is None:  # framed by the end of the stream
            while self._recv():
                if len(self.buf) > MAX_ANSWER_BODY:
                    raise BadAnswer(f"answer body over {MAX_ANSWER_BODY} bytes")
            body = bytes(self.buf)
            self.buf.clear()
            self.reusable = False
            return status, body
        while len(self.buf) < length:
            if not self._recv():
                raise BadAnswer(f"answer body ended after {len(self.buf)} of {length} bytes")
        body = bytes(self.buf[:length])
        del self.buf[:length]
        self.reusable = not close
        return status, body

    def _fill_until_head(self) -> int:
        start = 0
        while True:
            end = self.buf.find(b"\r\n\r\n", start)
            if end >= 0:
                return end
            if len(self.buf) > MAX_ANSWER_HEAD:
                raise BadAnswer(f"answer headers over {MAX_ANSWER_HEAD} bytes")
            start = max(0, len(self.buf) - 3)
            if not self._recv():
                if self.buf:
                    raise BadAnswer("the connection closed inside an answer's headers")
                raise ConnectionResetError("the coordinator closed the connection")

    def _recv(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)


def _read_head(head: bytes) -> tuple[int, int | None, bool]:
    """(status, Content-Length or None, Connection: close) of an answer's head."""
    lines = head.split(b"\r\n")
    words = lines[0].split(None, 2)
    if len(words) < 2 or not words[0].startswith(b"HTTP/1.") or not words[1].isdigit():
        raise BadAnswer(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    length: int | None = None
    close = words[0] == b"HTTP/1.0"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip()
        if name == b"content-length":
            if not value.isdigit() or int(value) > MAX_ANSWER_BODY:
                raise BadAnswer(f"answer Content-Length {value[:40]!r}")
            length = int(value)
        elif name == b"connection":
            close = value.lower() == b"close"
        elif name == b"transfer-encoding":
            raise BadAnswer(f"answer Transfer-Encoding {value[:40]!r} is not read here")
    if length is None and not close:
        raise BadAnswer("answer has neither Content-Length nor Connection: close")
    return int(words[1]), length, close


class CoordinatorClient:
    def __init__(self, address: str, token: str, *, timeout_s: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator address must be HOST:PORT, got {address!r}")
        if any(c in host for c in "\r\n /") or any(c in token for c in "\r\n"):
            raise ValueError(f"coordinator address or token has a line break or space: {address!r}")
        self.host = host
        self.port = int(port)
        self.token = token
        self.timeout_s = timeout_s
        self._local = threading.local()
        self._request_head = (
            f"Host: {host}:{port}\r\nAuthorization: Bearer {token}\r\n"
            "Content-Type: application/json\r\n"
        ).encode("latin-1")

    def _conn(self, timeout: float) -> _Connection:
        c: _Connection | None = getattr(self._local, "conn", None)
        if c is None:
            c = _Connection(self.host.strip("[]"), self.port, timeout)
            self._local.conn = c
        return c

    def _drop_conn(self) -> None:
        c = getattr(self._local, "conn", None)
        if c is not None:
            c.close()
            self._local.conn = None

    def call(
        self, method: str, op: str, body: dict[str, Any] | None, *, timeout: float | None = None
    ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        request = b"%s %s%s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method.encode("ascii"),
            p.PREFIX.encode("ascii"),
            op.encode("ascii"),
            self._request_head,
            len(data),
            data,
        )
        t = timeout if timeout is not None else self.timeout_s
        for attempt in (0, 1):
            try:
                conn = self._conn(t)
                status, raw = conn.exchange(request, t)
                if not conn.reusable:
                    self._drop_conn()
                break
            except OSError as e:  # ConnectionError, TimeoutError and BadAnswer among them
                self._drop_conn()
                # A stale keep-alive socket fails once; a dead server fails twice.
                if attempt == 1 or isinstance(e, TimeoutError):
                    raise CoordinatorUnavailable(f"coordinator {self.host}:{self.port}: {e}") from e
        try:
            out = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CoordinatorError(f"coordinator sent invalid JSON: {raw[:200]!r}") from e
        if status != 200:
            raise CoordinatorRefused(status, str(out.get("error")), str(out.get("message")))
        if not isinstance(out, dict):
            raise CoordinatorError("coordinator response is not an object")
        return out

    def _op(
        self,
        op: str,
        req: Any,
        resp_cls: type[T],
        *,
        wait_s: float = 0.0,
        timeout_s: float | None = None,
    ) -> T:
        t = self.timeout_s if timeout_s is None else timeout_s
        out = self.call("POST", op, p.encode(req), timeout=t + wait_s)
        return p.decode(resp_cls, out)

    # ---- typed ops ----------------------------------------------------------

    def register(self, req: p.RegisterRequest) -> p.RegisterResponse:
        return self._op("register", req, p.RegisterResponse)

    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse:
        return self._op("heartbeat", req, p.HeartbeatResponse, wait_s=req.wait_s)

    def rendezvous(self, req: p.RendezvousRequest) -> p.RendezvousResponse:
        return self._op("rendezvous", req, p.RendezvousResponse, wait_s=req.wait_s)

    def quorum(self, req: p.QuorumRequest) -> p.QuorumResponse:
        return self._op("quorum", req, p.QuorumResponse)

    def hang(self, req: p.HangRequest, timeout_s: float | None = None) -> p.HangResponse:
        """Asked from inside an overdue collective wait: bounded by `timeout_s`
        (default: the client's), so a slow coordinator cannot stretch the wait."""
        return self._op("hang", req, p.HangResponse, timeout_s=timeout_s)

    def leave(self, req: p.LeaveRequest) -> p.OkResponse:
        return self._op("leave", req, p.OkResponse)

    def preempt(self, req: p.PreemptRequest) -> p.OkResponse:
        return self._op("preempt", req, p.OkResponse)

    def exit(self, req: p.ExitRequest) -> p.OkResponse:
        # Without an error the body is the one every coordinator version decodes.
        body = {k: v for k, v in p.encode(req).items() if v != "" or not k.startswith("error_")}
        return p.decode(p.OkResponse, self.call("POST", "exit", body, timeout=self.timeout_s))

    def status(self) -> dict[str, Any]:
        return self.call("GET", "status", None)

    def close(self) -> None:
        self._drop_conn()

"""Client of the coordinator's wire API (see `protocol`).

One `CoordinatorClient` per process; it keeps one HTTP keep-alive connection
per calling thread, so the trainer's main thread and its heartbeat thread never
share a socket. Every call raises `CoordinatorUnavailable` when the coordinator
cannot be reached (the caller decides whether to retry) and `CoordinatorRefused`
when it answers with an error.
"""

from __future__ import annotations

import http.client
import json
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


class CoordinatorClient:
    def __init__(self, address: str, token: str, *, timeout_s: float = 10.0) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"coordinator address must be HOST:PORT, got {address!r}")
        self.host = host
        self.port = int(port)
        self.token = token
        self.timeout_s = timeout_s
        self._local = threading.local()

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        c: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if c is None:
            c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
            self._local.conn = c
        c.timeout = timeout
        if c.sock is not None:
            c.sock.settimeout(timeout)
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
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"}
        t = timeout if timeout is not None else self.timeout_s
        for attempt in (0, 1):
            conn = self._conn(t)
            try:
                conn.request(method, p.PREFIX + op, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, OSError, http.client.HTTPException) as e:
                self._drop_conn()
                # A stale keep-alive socket fails once; a dead server fails twice.
                if attempt == 1 or isinstance(e, TimeoutError):
                    raise CoordinatorUnavailable(f"coordinator {self.host}:{self.port}: {e}") from e
        try:
            out = json.loads(raw)
        except json.JSONDecodeError as e:
            raise CoordinatorError(f"coordinator sent invalid JSON: {raw[:200]!r}") from e
        if resp.status != 200:
            raise CoordinatorRefused(resp.status, str(out.get("error")), str(out.get("message")))
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
        return self._op("exit", req, p.OkResponse)

    def status(self) -> dict[str, Any]:
        return self.call("GET", "status", None)

    def close(self) -> None:
        self._drop_conn()

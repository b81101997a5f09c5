"""The coordinator's HTTP/1.1 transport: one asyncio event loop, stdlib only.

Why not `http.server`: a thread per connection does not reach 10k members
(10k threads, each heartbeat a context switch). Here one event-loop thread
serves every connection; a request is parsed, handled and answered inside one
`data_received` call unless the handler must wait (a long poll), in which case
it returns an awaitable and the connection waits for it while every other
connection goes on. Keep-alive and pipelining: requests on one connection are
answered in order; bytes that arrive while one is pending stay buffered.

Strict on purpose (errors are JSON `{"error", "message"}` and close the
connection, whose stream can no longer be trusted): one request line of at
most 64 KiB (414), at most 100 headers (431), GET or POST only (405), HTTP/1.x
only, a body only with a decimal Content-Length of at most `max_body` (no
chunked encoding), and every request must arrive within `read_timeout_s` of
its first byte (headers) or of its headers (body), else 408: a slow or stalled
client holds a buffer and a file descriptor, never a thread.

Connections are untrusted until a request on them passes `trusts` (the job
token). Untrusted connections idle for `untrusted_idle_s` are closed (a
socket that sends nothing costs a descriptor and nothing else, but holds a
slot); trusted ones after `idle_timeout_s` (clients reconnect). Past
`max_connections`, a new connection closes the oldest idle untrusted one to
make room, so a flood of tokenless sockets never locks the members out; only
when every connection is trusted or busy does the new one get 503.

Who calls: `CoordinatorServer` (server.py); the handler runs on the loop
thread and must not block.
"""

from __future__ import annotations

import asyncio
import functools
import json
import socket
import threading
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import TypeVar

MAX_LINE = 65536
"""Longest request line (as http.server)."""
MAX_HEADERS = 100
MAX_HEAD = MAX_LINE + 64 * 1024
"""Longest request line plus headers."""
HEAD_CACHE = 4096
"""Parsed request heads kept per server (see `HttpServer.parse_head`)."""
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


class HttpError(Exception):
    """An error answer: `status`, a short `code` and a message for the client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


@dataclass(slots=True)
class Request:
    method: str
    path: str
    headers: dict[bytes, bytes]
    """Lower-case names; the first of repeated headers."""
    body: bytes


@dataclass(slots=True)
class Response:
    status: int
    body: bytes
    content_type: bytes = b"application/json"
    close: bool = False
    """Close the connection after this response."""


Handler = Callable[[Request], "Response | Awaitable[Response]"]
R = TypeVar("R")


class Notifier:
    """Long polls on an event loop: `long_poll(attempt, ...)` repeats
    `attempt(deadline)` after each `notify()` until it answers or the deadline
    passes. Waking costs O(waiters) per notify and nothing per poll; a poll
    that times out leaves nothing behind. `notify` may be called from any
    thread; `epoch` counts the notifications (read it before an attempt so a
    change during the attempt is not missed)."""

    def __init__(self) -> None:
        self.epoch = 0
        self.waiters: set[asyncio.Future[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in_loop: Callable[[], bool] = lambda: False

    def attach(self, loop: asyncio.AbstractEventLoop, in_loop: Callable[[], bool]) -> None:
        """Wake polls on `loop`; `in_loop()`: is the caller the loop's thread?"""
        self._loop = loop
        self._in_loop = in_loop

    def notify(self) -> None:
        self.epoch += 1
        if self._loop is None or not self.waiters:
            return
        if self._in_loop():
            self._wake_all()
        else:
            self._loop.call_soon_threadsafe(self._wake_all)

    def _wake_all(self) -> None:
        waiters, self.waiters = self.waiters, set()
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def changed(self, epoch: int, timeout: float) -> None:
        """Return once notified since `epoch` was read, or after `timeout`."""
        if self.epoch != epoch or timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self.waiters.add(fut)
        timer = loop.call_later(timeout, _resolve, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self.waiters.discard(fut)

    async def long_poll(
        self, attempt: Callable[[float], R | None], deadline: float, epoch: int
    ) -> R:
        """After a first attempt made at `epoch`: wait, retry, until it answers."""
        while True:
            await self.changed(epoch, deadline - time.monotonic())
            epoch = self.epoch
            out = attempt(deadline)
            if out is not None:
                return out


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def error_response(status: int, code: str, message: str, *, close: bool = False) -> Response:
    body = json.dumps({"error": code, "message": message}).encode()
    return Response(status, body, close=close)


class _Connection(asyncio.Protocol):
    """One client connection: a byte buffer, a parser state and at most one
    request being handled (HTTP/1.1 answers in order)."""

    def __init__(self, server: HttpServer) -> None:
        self.srv = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.head: tuple[str, str, dict[bytes, bytes], int, bool] | None = None
        """The parsed request line and headers of a request whose body is due:
        (method, path, headers, content length, keep-alive)."""
        self.busy = False
        self.closing = False
        self.eof = False
        self.started = 0.0
        """Loop time when the request being read began (its first byte, then
        the end of its headers)."""
        self.last = 0.0
        self.now = 0.0
        """Loop time of the latest read or answer (one clock read per batch of requests)."""
        self.pending: list[bytes] | None = None
        """Answers collected while a batch of pipelined requests is processed, sent
        with one write (one syscall, not one per answer); None: send at once."""
        self.timer: asyncio.TimerHandle | None = None
        self.task: asyncio.Future[Response] | None = None
        self.trusted = False
        """A request on it passed the server's `trusts` (it carried the job token)."""

    # ---- asyncio callbacks -----------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.last = self.now = self.loop.time()
        self.srv.connections.add(self)
        self.srv.untrusted[self] = None
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if len(self.srv.connections) > self.srv.max_connections and not self.srv.make_room(self):
            self._send(
                error_response(
                    503,
                    "busy",
                    f"too many connections (limit {self.srv.max_connections}); try again",
                    close=True,
                )
            )

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        now = self.now = self.loop.time()
        if not self.buf and self.head is None:
            self.started = now
        self.last = now
        self.buf += data
        if not self.busy:
            self._process()
        elif len(self.buf) > self.srv.max_body + MAX_HEAD and self.transport is not None:
            self.transport.pause_reading()  # resumed when the pending answer is sent

    def eof_received(self) -> bool:
        self.eof = True
        if not self.busy:
            self._process()
        return True  # keep the transport open to answer

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.srv.connections.discard(self)
        self.srv.untrusted.pop(self, None)
        if self.timer is not None:
            self.timer.cancel()
        if self.task is not None and not self.task.done():
            self.task.cancel()

    # ---- requests ---------------------------------------------------------------

    def _process(self) -> None:
        """Answer every complete request in the buffer, in order, with one write."""
        self.pending = []
        try:
            self._process_batch()
        finally:
            out, self.pending = self.pending, None
            if out and self.transport is not None:
                self.transport.write(b"".join(out))
            if self.closing and self.transport is not None:
                self.transport.close()  # after the answers above are written

    def _process_batch(self) -> None:
        while not self.busy and not self.closing:
            try:
                req = self._parse()
            except HttpError as e:
                self._send(error_response(e.status, e.code, e.message, close=True))
                return
            if req is None:
                self._incomplete()
                return
            keep_alive = self.head_keep_alive
            if not self.trusted and self.srv.trusts(req):
                self.trusted = True
                self.srv.untrusted.pop(self, None)
            try:
                out = self.srv.handler(req)
            except Exception as e:  # a bug in the handler: say so rather than hang
                out = _internal_error(e)
            if isinstance(out, Response):
                self._send(out, keep_alive)
                continue
            self.busy = True
            self.task = asyncio.ensure_future(out, loop=self.loop)
            self.task.add_done_callback(functools.partial(self._answered, keep_alive=keep_alive))
            return

    def _answered(self, task: asyncio.Future[Response], *, keep_alive: bool) -> None:
        self.busy = False
        self.task = None
        if self.closing or task.cancelled():
            return
        exc = task.exception()
        out = _internal_error(exc) if exc is not None else task.result()
        self._send(out, keep_alive)
        if self.transport is not None and not self.closing:
            self.transport.resume_reading()
            self.started = self.last = self.now = self.loop.time()
            self._process()

    def _incomplete(self) -> None:
        """The buffer holds part of a request (or nothing): wait, time out, or,
        after the client's end of stream, answer what it cut short and close."""
        if self.eof:
            if self.head is not None:
                want = self.head[3]
                self._send(
                    error_response(
                        400,
                        "malformed",
                        f"body ended after {len(self.buf)} of {want} bytes",
                        close=True,
                    )
                )
            elif self.buf.strip():
                self._send(
                    error_response(
                        400, "malformed", "the request ended before its headers did", close=True
                    )
                )
            else:
                self._close()
            return
        if self.head is None and not self.buf:
            self._disarm()
            return
        deadline = self.started + self.srv.read_timeout_s
        if self.timer is None or self.timer.when() != deadline:
            self._disarm()
            self.timer = self.loop.call_at(deadline, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.busy or self.closing or (self.head is None and not self.buf):
            return
        t = self.srv.read_timeout_s
        if self.head is not None:
            msg = f"the {self.head[3]}-byte body did not arrive within {t:g} s"
        else:
            msg = f"the request headers did not arrive within {t:g} s"
        self._send(error_response(408, "timeout", msg, close=True))

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    head_keep_alive = True

    def _parse(self) -> Request | None:
        buf = self.buf
        if self.head is None:
            while buf.startswith(b"\r\n"):
                del buf[:2]  # stray line ends between requests
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                _check_partial_head(buf)
                return None
            self.head = self.srv.parse_head(bytes(buf[:end]))
            del buf[: end + 4]
            self.started = self.now
            if (
                self.head[2].get(b"expect", b"").lower() == b"100-continue"
                and len(buf) < (self.head[3])
            ):
                self._write(b"HTTP/1.1 100 Continue\r\n\r\n")  # after earlier answers
        method, path, headers, length, keep_alive = self.head
        if len(buf) < length:
            return None
        body = bytes(buf[:length])
        del buf[:length]
        self.head = None
        self.head_keep_alive = keep_alive
        self._disarm()
        if buf:
            self.started = self.now
        return Request(method, path, headers, body)

    def _send(self, out: Response, keep_alive: bool = True) -> None:
        if self.transport is None or self.closing:
            return
        close = out.close or not keep_alive
        head = b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n" % (
            out.status,
            _REASONS.get(out.status, b"Unknown"),
            out.content_type,
            len(out.body),
            b"Connection: close\r\n" if close else b"",
        )
        self._write(head + out.body)
        self.last = self.now
        if close:
            self._close()

    def _write(self, data: bytes) -> None:
        """Into the batch being answered (`_process`), else straight out."""
        if self.pending is not None:
            self.pending.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def _close(self) -> None:
        self.closing = True
        self._disarm()
        if self.transport is not None and self.pending is None:
            self.transport.close()  # after the buffered answer is written


def _internal_error(e: BaseException) -> Response:
    traceback.print_exception(e)
    return error_response(500, "internal", f"{type(e).__name__}: {e}", close=True)


def _check_partial_head(buf: bytearray) -> None:
    """Refuse a request line or header block that is already too long to be one."""
    line_end = buf.find(b"\r\n")
    if (line_end < 0 and len(buf) > MAX_LINE) or line_end > MAX_LINE:
        raise HttpError(414, "malformed", "Request-URI Too Long")
    if line_end >= 0:
        _parse_request_line(bytes(buf[:line_end]))  # refuse a bad one before its headers
    if buf.count(b"\r\n") > MAX_HEADERS + 1:
        raise HttpError(431, "malformed", f"too many headers (at most {MAX_HEADERS})")
    if len(buf) > MAX_HEAD:
        raise HttpError(431, "malformed", "request headers too large")


def _parse_request_line(line: bytes) -> tuple[bytes, bytes, bytes]:
    """(method, target, minor version) of `METHOD TARGET HTTP/1.x`, or HttpError."""
    words = line.split()
    if len(words) != 3:
        shown = line[:100].decode("latin-1")
        raise HttpError(400, "malformed", f"Bad request syntax ({shown!r})")
    method_b, target, version = words
    shown = version[:20].decode("latin-1")
    if not version.startswith(b"HTTP/"):
        raise HttpError(400, "malformed", f"Bad request version ({shown!r})")
    major, _, minor = version[5:].partition(b".")
    if not (major.isdigit() and minor.isdigit() and len(major) < 4 and len(minor) < 4):
        raise HttpError(400, "malformed", f"Bad request version ({shown!r})")
    if int(major) != 1:
        raise HttpError(400, "malformed", f"Invalid HTTP version ({shown}): use HTTP/1.1")
    return method_b, target, minor


def _parse_head(head: bytes, max_body: int) -> tuple[str, str, dict[bytes, bytes], int, bool]:
    lines = head.split(b"\r\n")
    line = lines[0]
    if len(line) > MAX_LINE:
        raise HttpError(414, "malformed", "Request-URI Too Long")
    if len(lines) - 1 > MAX_HEADERS:
        raise HttpError(431, "malformed", f"too many headers (at most {MAX_HEADERS})")
    method_b, target, minor = _parse_request_line(line)
    headers: dict[bytes, bytes] = {}
    for h in lines[1:]:
        name, sep, value = h.partition(b":")
        if not sep or not name or name != name.strip():
            raise HttpError(400, "malformed", f"bad header line {h[:60].decode('latin-1')!r}")
        name = name.lower()
        value = value.strip()
        if name not in headers:
            headers[name] = value
        elif name == b"content-length" and headers[name] != value:
            raise HttpError(400, "malformed", "conflicting Content-Length headers")
    method = method_b.decode("latin-1")
    if method not in ("GET", "POST"):
        raise HttpError(
            405, "method_not_allowed", f"method {method[:20]!r} not allowed: use GET or POST"
        )
    conn = headers.get(b"connection", b"").lower()
    keep_alive = conn != b"close" if minor != b"0" else conn == b"keep-alive"
    if b"transfer-encoding" in headers:
        raise HttpError(400, "malformed", "chunked bodies are not supported: send Content-Length")
    cl = headers.get(b"content-length", b"0")
    if not (cl.isdigit() and len(cl) <= 20):
        raise HttpError(
            400, "malformed", f"Content-Length {cl[:40].decode('latin-1')!r} is not a byte count"
        )
    length = int(cl)
    if length > max_body:
        raise HttpError(400, "too_large", f"body of {length} bytes exceeds {max_body}")
    path = target.decode("latin-1")
    if path.startswith("//"):
        path = "/" + path.lstrip("/")  # as http.server: no open redirects
    return method, path, headers, length, keep_alive


class HttpServer:
    """Binds at construction (port 0: any free port; SO_REUSEADDR, so a
    restarted coordinator gets its old port at once); `start()` serves on a
    background thread running the event loop; `stop()` closes everything.
    `call_every` and `call_soon` run functions on the loop thread."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        port: int,
        *,
        max_body: int,
        read_timeout_s: float,
        idle_timeout_s: float = 300.0,
        untrusted_idle_s: float | None = None,
        max_connections: int = 4096,
        backlog: int = 4096,
        trusts: Callable[[Request], bool] = lambda _req: True,
    ) -> None:
        self.handler = handler
        self.trusts = trusts
        """Does this request make its connection trusted (it carries the job token)?"""
        self.max_body = max_body
        self._heads: dict[bytes, tuple[str, str, dict[bytes, bytes], int, bool]] = {}
        self.read_timeout_s = read_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.untrusted_idle_s = read_timeout_s if untrusted_idle_s is None else untrusted_idle_s
        self.max_connections = max_connections
        self.connections: set[_Connection] = set()
        self.untrusted: dict[_Connection, None] = {}
        """Connections no request has made trusted yet, oldest first."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.sock.bind((host, port))
            self.sock.listen(backlog)
        except OSError:
            self.sock.close()
            raise
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.loop = asyncio.new_event_loop()
        self.thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None
        self._backlog = backlog

    def parse_head(self, head: bytes) -> tuple[str, str, dict[bytes, bytes], int, bool]:
        """`_parse_head`, remembered: a member sends the same head bytes with every
        heartbeat, and parsing them is a third of a heartbeat's cost. Only heads
        that parse are kept (errors are raised afresh), short ones, at most
        `HEAD_CACHE` of them; the parsed headers are never modified downstream."""
        out = self._heads.get(head)
        if out is None:
            out = _parse_head(head, self.max_body)
            if len(head) <= 1024 and len(self._heads) < HEAD_CACHE:
                self._heads[head] = out
        return out

    def start(self) -> None:
        ready = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self._server = self.loop.run_until_complete(
                    self.loop.create_server(
                        lambda: _Connection(self), sock=self.sock, backlog=self._backlog
                    )
                )
            except BaseException as e:  # noqa: BLE001 - reported to start()'s caller
                failed.append(e)
                ready.set()
                return
            self.call_every(1.0, self._close_idle)
            ready.set()
            self.loop.run_forever()
            self._shutdown()

        self.thread = threading.Thread(target=run, name="coordinator-http", daemon=True)
        self.thread.start()
        ready.wait()
        if failed:
            raise failed[0]

    def call_every(self, interval_s: float, fn: Callable[[], object]) -> None:
        """Run `fn` on the loop thread every `interval_s` (from the loop thread)."""

        def tick() -> None:
            try:
                fn()
            except Exception:  # a periodic task must not stop: log and go on
                traceback.print_exc()
            self.loop.call_later(interval_s, tick)

        self.loop.call_later(interval_s, tick)

    def _close_idle(self) -> None:
        now = self.loop.time()
        cutoff, untrusted_cutoff = now - self.idle_timeout_s, now - self.untrusted_idle_s
        idle = [
            c
            for c in self.connections
            if not c.busy and c.last < (cutoff if c.trusted else untrusted_cutoff)
        ]
        for c in idle:
            c._close()

    def make_room(self, newcomer: _Connection) -> bool:
        """Over the connection limit: close the oldest idle untrusted connection
        other than `newcomer`; False if there is none (every slot is in use by a
        trusted or busy connection)."""
        for c in self.untrusted:
            if c is not newcomer and not c.busy and not c.closing:
                self.untrusted.pop(c)
                c._send(
                    error_response(
                        503, "busy", "closed to make room for another connection", close=True
                    )
                )
                return True
        return False

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for c in list(self.connections):
            if c.transport is not None:
                c.transport.abort()
        tasks = asyncio.all_tasks(self.loop)
        for t in tasks:
            t.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.run_until_complete(asyncio.sleep(0))  # let connection_lost callbacks run

    def stop(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_closed() and not self.loop.is_running():
            self.loop.close()
        self.sock.close()

    def in_loop_thread(self) -> bool:
        return self.thread is not None and threading.get_ident() == self.thread.ident

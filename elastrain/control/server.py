"""The coordinator process: HTTP API over `Membership`, plus the TCPStore.

Run as its own process (the launcher does this) so that it can fail and be
restarted on its own:

    python -m elastrain.control.server --run-dir runs/x --target 4 --min 2

The job token comes from $ELASTRAIN_TOKEN or $ELASTRAIN_TOKEN_FILE, never from
the command line. SIGINT stops it at once. SIGTERM means the whole job is
being preempted (Kubernetes sends it to every pod of an evicted job, this one
included): it tells every member to take one emergency checkpoint after the
next step and exit, waits until they are gone or `--grace` seconds have
passed, then exits with status 0. On start it prints one JSON line to stdout with where it
listens: {"host": ..., "port": ..., "store_port": ...}.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from elastrain import env
from elastrain.control import protocol as p
from elastrain.control.config import CoordinatorConfig
from elastrain.control.quorum import Membership
from elastrain.observe.events import EventLog
from elastrain.observe.metrics import CONTENT_TYPE, prometheus_text

MAX_BODY = 1 << 20
MAX_WAIT_S = 30.0
BODY_TIMEOUT_S = 10.0
"""A request body must arrive within this long after its headers, or 408."""


class HttpError(Exception):
    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class Coordinator:
    """Owns the membership state, its lock, and the long-poll wake-ups.

    All handlers run on the HTTP server's threads; every state access holds
    `self.cond`. Long polls wait on the same condition, which is notified after
    every state change.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        token: str,
        *,
        job_id: str,
        store_host: str,
        store_port: int,
        events: EventLog,
    ) -> None:
        self.state = Membership(config)
        self.config = config
        self.token = token
        self.job_id = job_id
        self.store_host = store_host
        self.store_port = store_port
        self.events = events
        self.cond = threading.Condition()
        self.started = time.time()
        self._commits: list[tuple[float, int]] = []
        self._global_batch = 0
        self._preempt_deadline: float | None = None
        self._preempt_decision: tuple[int, int, float | None] | None = None
        """(gen, step, preemption deadline or None) of the latest "proceed" verdict."""

    # ---- helpers ------------------------------------------------------------

    def _flush(self, wake: bool = False) -> None:
        """Emit events for what changed; wake the long polls if membership or
        generations changed (or `wake`). Holds cond. Waking only on change
        keeps an idle coordinator idle: heartbeats are long polls."""
        removed = self.state.drain_removals()
        formed = self.state.drain_formed()
        adopted = self.state.drain_adopted()
        for g in adopted:
            self.events.emit(
                "generation_adopted",
                gen=g.gen,
                members=list(g.members),
                awaiting=sorted(g.awaiting),
                step=g.start_step,
            )
        for r in removed:
            self.events.emit("member_removed", member=r.member, reason=r.reason)
        for g in formed:
            self.events.emit(
                "generation_formed", gen=g.gen, members=list(g.members), reason=g.reason
            )
        wait_changed = self.state.waiting != getattr(self, "_last_wait", None)
        if self.state.waiting and wait_changed:
            self.events.emit(
                "waiting_for_members",
                message=self.state.waiting,
                have=len(self.state.members),
                min=self.config.min_members,
            )
        self._last_wait = self.state.waiting
        if wake or removed or formed or adopted or wait_changed:
            self.cond.notify_all()

    def check_token(self, header: str | None) -> None:
        if not header or not header.startswith("Bearer "):
            raise HttpError(
                401, "unauthorized", "missing job token (Authorization: Bearer <token>)"
            )
        if not hmac.compare_digest(header[len("Bearer ") :].encode(), self.token.encode()):
            raise HttpError(401, "unauthorized", "wrong job token")

    # ---- ops ----------------------------------------------------------------

    def register(self, req: p.RegisterRequest) -> p.RegisterResponse:
        with self.cond:
            if self.state.signature is None:
                self.state.signature = req.signature
            elif req.signature != self.state.signature:
                from elastrain.transfer import signature_mismatch

                why = signature_mismatch(req.signature, self.state.signature) or "differs"
                self.events.emit("member_refused", member=req.member, reason=why)
                raise HttpError(
                    409,
                    "model_mismatch",
                    f"refused {req.member}: its model does not match the job's: {why}",
                )
            now = time.monotonic()
            inc = self.state.register(
                req.member,
                req.pid,
                req.host,
                now,
                gen=req.gen,
                gen_members=tuple(req.gen_members),
                committed=req.committed,
                prev_incarnation=req.prev_incarnation,
            )
            self.events.emit(
                "member_registered",
                member=req.member,
                incarnation=inc,
                pid=req.pid,
                gen=req.gen,
                running=bool(req.gen_members),
            )
            self._flush(wake=True)
            return p.RegisterResponse(
                inc, self.store_host, self.store_port, self.job_id, self.config.heartbeat_s
            )

    def heartbeat(self, req: p.HeartbeatRequest) -> p.HeartbeatResponse:
        deadline = time.monotonic() + min(req.wait_s, MAX_WAIT_S)
        with self.cond:
            while True:
                now = time.monotonic()
                if not self.state.touch(req.member, req.incarnation, now):
                    known = self.state.knows(req.member)
                    return p.HeartbeatResponse("expelled" if known else "unknown", self._gen_id())
                if req.gen and self.state.gen_interrupted(req.gen):
                    return p.HeartbeatResponse("changed", self._gen_id())
                if now >= deadline:
                    return p.HeartbeatResponse("ok", self._gen_id())
                self.cond.wait(deadline - now)

    def rendezvous(self, req: p.RendezvousRequest) -> p.RendezvousResponse:
        deadline = time.monotonic() + min(req.wait_s, MAX_WAIT_S)
        with self.cond:
            while True:
                now = time.monotonic()
                before = self._barrier()
                status = self.state.rendezvous(
                    req.member, req.incarnation, req.known_gen, req.committed, now, req.commit_gen
                )
                # Wake the other waiters only when the barrier moved, or they
                # would wake each other forever.
                self._flush(wake=self._barrier() != before)
                g = self.state.gen
                if status == "ready" and g is not None:
                    if not getattr(g, "_announced", False):
                        g._announced = True  # type: ignore[attr-defined]
                        self.events.emit(
                            "generation_ready",
                            gen=g.gen,
                            members=list(g.members),
                            steps=dict(g.ready),
                            start_step=g.start_step,
                        )
                    return p.RendezvousResponse(
                        "ready",
                        g.gen,
                        list(g.members),
                        dict(g.ready),
                        g.start_step,
                        reason=g.reason,
                        commit_gens=dict(g.commit_gens),
                    )
                if status in ("expelled", "unknown", "finished") or now >= deadline:
                    msg = self.state.waiting or ""
                    if status == "pending" and g is not None and not msg:
                        missing = [m for m in g.members if m not in g.ready]
                        msg = f"generation {g.gen}: waiting for {', '.join(missing) or 'members'}"
                    return p.RendezvousResponse(status, message=msg)
                self.cond.wait(deadline - now)

    def quorum(self, req: p.QuorumRequest) -> p.QuorumResponse:
        with self.cond:
            verdict, gen = self.state.quorum(
                req.member, req.incarnation, req.gen, req.step, req.leaving, time.monotonic()
            )
            preempt_s = 0.0
            if verdict == "proceed":
                d = self._preempt_decision
                if d is None or d[:2] != (req.gen, req.step):
                    # The first request for (gen, step) decides for every member.
                    d = (req.gen, req.step, self._preempt_deadline)
                    self._preempt_decision = d
                if d[2] is not None:
                    preempt_s = max(0.001, d[2] - time.monotonic())
            if verdict == "proceed" and req.last_loss is not None:
                self.state.last_loss = req.last_loss
            if req.global_batch:
                self._global_batch = req.global_batch
            if verdict == "proceed" and (not self._commits or self._commits[-1][1] < req.step):
                self._commits.append((time.monotonic(), req.step))
                del self._commits[:-50]
            self._flush()
            return p.QuorumResponse(verdict, gen, preempt_s)

    def preempt(self, req: p.PreemptRequest) -> p.OkResponse:
        """The whole job is being preempted: from the next step decided on, every
        member is told to take an emergency checkpoint after it and exit."""
        with self.cond:
            if self._preempt_deadline is None:
                self._preempt_deadline = time.monotonic() + max(0.0, req.grace_s)
                self.events.emit("preempt_notice", grace_s=req.grace_s)
            self._flush(wake=True)
            return p.OkResponse(True)

    def leave(self, req: p.LeaveRequest) -> p.OkResponse:
        with self.cond:
            ok = self.state.leave(req.member, req.incarnation, req.reason, time.monotonic())
            if ok and req.reason == "done":
                self.state.progress_step = max(self.state.progress_step, req.committed)
            self._flush(wake=True)
            return p.OkResponse(ok)

    def exit(self, req: p.ExitRequest) -> p.OkResponse:
        with self.cond:
            ok = self.state.exited(req.member, req.pid, time.monotonic())
            self._flush(wake=True)
            return p.OkResponse(ok)

    def status(self) -> dict[str, Any]:
        with self.cond:
            s = self.state
            g = s.gen
            rate = 0.0
            if len(self._commits) >= 2:
                (t0, s0), (t1, s1) = self._commits[0], self._commits[-1]
                if t1 > t0:
                    rate = (s1 - s0) / (t1 - t0)
            return {
                "api_version": p.API_VERSION,
                "job_id": self.job_id,
                "gen": g.gen if g else 0,
                "members": list(g.members) if g else [],
                "ready": bool(g and g.is_ready and not g.broken),
                "registered": {
                    m.id: {"pid": m.pid, "host": m.host, "incarnation": m.incarnation}
                    for m in s.members.values()
                },
                "step": s.progress_step,
                "loss": s.last_loss,
                "steps_per_s": rate,
                "samples_per_s": rate * self._global_batch,
                "waiting": s.waiting,
                "finished": s.finished,
                "preempting": self._preempt_deadline is not None,
                "target": self.config.target,
                "min": self.config.min_members,
                "uptime_s": time.time() - self.started,
            }

    def tick(self) -> None:
        with self.cond:
            self.state.expire(time.monotonic())
            self._flush()

    def _barrier(self) -> tuple[int, int, bool]:
        g = self.state.gen
        return (g.gen, len(g.ready), g.broken) if g is not None else (0, 0, False)

    def _gen_id(self) -> int:
        return self.state.gen.gen if self.state.gen else 0


ROUTES: dict[str, tuple[type, str]] = {
    "register": (p.RegisterRequest, "register"),
    "heartbeat": (p.HeartbeatRequest, "heartbeat"),
    "rendezvous": (p.RendezvousRequest, "rendezvous"),
    "quorum": (p.QuorumRequest, "quorum"),
    "leave": (p.LeaveRequest, "leave"),
    "exit": (p.ExitRequest, "exit"),
    "preempt": (p.PreemptRequest, "preempt"),
}


def make_handler(coord: Coordinator) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # requests are not logged line by line; events carry what matters

        def _reply(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            """http.server's own refusals (bad request line or headers, unknown method,
            HTTP/2) as a JSON 4xx like ours; the connection is closed after it."""
            status, err = {501: (405, "method_not_allowed"), 505: (400, "malformed")}.get(
                code, (code, "malformed")
            )
            if code == 501:
                message = (
                    f"method {self.command[:20]!r} not allowed: use GET or POST {p.PREFIX}<op>"
                )
            self.close_connection = True
            self.request_version = (
                self.protocol_version
            )  # a status line even for HTTP/0.9 or garbage
            self._reply(status, {"error": err, "message": message or HTTPStatus(code).phrase})

        def _read_body(self) -> bytes:
            """The whole body (by Content-Length), or HttpError; any error before the
            body was read closes the connection, so that keep-alive never desyncs."""
            if self.headers.get("Transfer-Encoding") is not None:
                self.close_connection = True
                raise HttpError(
                    400, "malformed", "chunked bodies are not supported: send Content-Length"
                )
            text = self.headers.get("Content-Length") or "0"
            if not re.fullmatch(r"[0-9]{1,20}", text.strip()):
                self.close_connection = True
                raise HttpError(
                    400, "malformed", f"Content-Length {text[:40]!r} is not a byte count"
                )
            length = int(text)
            if length > MAX_BODY:
                self.close_connection = True
                raise HttpError(400, "too_large", f"body of {length} bytes exceeds {MAX_BODY}")
            self.connection.settimeout(BODY_TIMEOUT_S)
            try:
                raw = self.rfile.read(length) if length else b""
            except TimeoutError:
                self.close_connection = True
                raise HttpError(
                    408,
                    "timeout",
                    f"the {length}-byte body did not arrive within {BODY_TIMEOUT_S:g} s",
                ) from None
            finally:
                self.connection.settimeout(self.timeout)
            if len(raw) < length:
                self.close_connection = True
                raise HttpError(400, "malformed", f"body ended after {len(raw)} of {length} bytes")
            return raw

        def _dispatch(self, method: str) -> None:
            try:
                raw = self._read_body()
                coord.check_token(self.headers.get("Authorization"))
                if method == "GET" and self.path.split("?", 1)[0] == "/metrics":
                    data = prometheus_text(coord.status()).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", CONTENT_TYPE)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if not self.path.startswith(p.PREFIX):
                    raise HttpError(
                        404,
                        "not_found",
                        f"unknown path {self.path[:100]!r}; this coordinator speaks {p.PREFIX}",
                    )
                op = self.path[len(p.PREFIX) :]
                if method == "GET":
                    if op != "status":
                        raise HttpError(404, "not_found", f"unknown GET op {op[:100]!r}")
                    self._reply(200, coord.status())
                    return
                if op not in ROUTES:
                    raise HttpError(
                        404, "not_found", f"unknown op {op[:100]!r}; known: {sorted(ROUTES)}"
                    )
                try:
                    body = json.loads(raw or b"null")
                except (ValueError, RecursionError) as e:  # incl. UnicodeDecodeError
                    raise HttpError(400, "malformed", f"body is not JSON: {str(e)[:200]}") from None
                cls, name = ROUTES[op]
                try:
                    req: Any = p.decode(cls, body)
                except p.ProtocolError as e:
                    raise HttpError(400, "malformed", str(e)) from None
                self._reply(200, p.encode(getattr(coord, name)(req)))
            except HttpError as e:
                self._reply(e.status, {"error": e.code, "message": e.message})
            except (ValueError, TypeError) as e:
                self._reply(400, {"error": "malformed", "message": str(e)})
            except Exception as e:  # a bug: say so (500) rather than drop the connection
                traceback.print_exc()
                self.close_connection = True
                self._reply(500, {"error": "internal", "message": f"{type(e).__name__}: {e}"})

        def do_POST(self) -> None:  # noqa: N802
            self._dispatch("POST")

        def do_GET(self) -> None:  # noqa: N802
            self._dispatch("GET")

    return Handler


class CoordinatorServer:
    """The coordinator's HTTP server, TCPStore and expiry ticker, in-process.

    `start()` binds (port 0 picks a free port) and serves on background threads;
    `stop()` closes everything. Tests use this class directly; the launcher runs
    `main()` in a process of its own.
    """

    def __init__(
        self,
        config: CoordinatorConfig,
        token: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        store_port: int = 0,
        run_dir: str | None = None,
        job_id: str | None = None,
    ) -> None:
        if not token:
            raise ValueError(
                "a job token is required (set ELASTRAIN_TOKEN or ELASTRAIN_TOKEN_FILE)"
            )
        from torch.distributed import TCPStore

        self.store = TCPStore(host, store_port, is_master=True, wait_for_workers=False)
        self.events = EventLog(run_dir, "coordinator")
        self.coord = Coordinator(
            config,
            token,
            job_id=job_id or uuid.uuid4().hex[:12],
            store_host=host,
            store_port=self.store.port,
            events=self.events,
        )
        self.httpd = ThreadingHTTPServer((host, port), make_handler(self.coord))
        self.httpd.daemon_threads = True
        self.host = host
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def port(self) -> int:
        return int(self.httpd.server_address[1])

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> CoordinatorServer:
        self.coord.events.emit(
            "coordinator_start", host=self.host, port=self.port, store_port=self.store.port
        )
        t = threading.Thread(
            target=self.httpd.serve_forever,
            kwargs={"poll_interval": 0.1},
            name="coordinator-http",
            daemon=True,
        )
        t.start()
        self._threads.append(t)
        k = threading.Thread(target=self._ticker, name="coordinator-tick", daemon=True)
        k.start()
        self._threads.append(k)
        return self

    def _ticker(self) -> None:
        while not self._stop.wait(0.1):
            self.coord.tick()

    def drain_for_preemption(self, grace_s: float) -> bool:
        """The whole job is being preempted: notice every member (as the `preempt`
        op does), then block until no member is registered or `grace_s` has
        passed; returns whether every member left in time. A margin of the
        grace (at most 5 s) is kept for the members' own exit."""
        margin = min(5.0, 0.2 * grace_s)
        deadline = time.monotonic() + grace_s
        self.coord.preempt(p.PreemptRequest(grace_s - margin))
        with self.coord.cond:
            while self.coord.state.members:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.coord.cond.wait(min(left, 0.5))
        return True

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        for t in self._threads:
            t.join(timeout=5)
        self.events.close()


def read_token() -> str:
    tok = os.environ.get(env.TOKEN)
    if tok:
        return tok.strip()
    path = os.environ.get(env.TOKEN_FILE)
    if path:
        return Path(path).read_text().strip()
    raise SystemExit(f"no job token: set {env.TOKEN} or {env.TOKEN_FILE}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="elastrain coordinator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--bind",
        default="127.0.0.1:0",
        help="HOST:PORT for the HTTP API (default loopback, port 0)",
    )
    ap.add_argument("--store-port", type=int, default=0)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--job-id", default=None)
    ap.add_argument("--target", type=int, required=True)
    ap.add_argument("--min", type=int, default=1, dest="min_members")
    ap.add_argument("--max", type=int, default=0, dest="max_members")
    ap.add_argument("--lease", type=float, default=5.0)
    ap.add_argument("--suspect", type=float, default=1.0)
    ap.add_argument("--start-grace", type=float, default=60.0)
    ap.add_argument(
        "--gen-floor",
        type=int,
        default=0,
        help="a restart: number generations after this one (the highest seen before)",
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=30.0,
        help="on SIGTERM: seconds for the members' emergency checkpoint and exit (default 30)",
    )
    args = ap.parse_args(argv)
    host, _, port = args.bind.rpartition(":")
    try:
        cfg = CoordinatorConfig(
            target=args.target,
            min_members=args.min_members,
            max_members=args.max_members,
            lease_s=args.lease,
            suspect_s=args.suspect,
            start_grace_s=args.start_grace,
        )
    except ValueError as e:
        ap.error(str(e))
    srv = CoordinatorServer(
        cfg,
        read_token(),
        host=host or "127.0.0.1",
        port=int(port or 0),
        store_port=args.store_port,
        run_dir=args.run_dir,
        job_id=args.job_id,
    )
    if args.gen_floor < 0:
        ap.error("--gen-floor must be >= 0")
    srv.coord.state.gen_floor = args.gen_floor
    srv.start()
    info = {"host": srv.host, "port": srv.port, "store_port": srv.store.port, "pid": os.getpid()}
    if args.run_dir:
        Path(args.run_dir, "coordinator.json").write_text(json.dumps(info))
    print(json.dumps(info), flush=True)
    done = threading.Event()
    preempted = threading.Event()

    def on_term(*_: object) -> None:
        preempted.set()
        done.set()

    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, on_term)
    done.wait()
    if preempted.is_set() and not srv.drain_for_preemption(args.grace):
        print("elastrain coordinator: grace period over with members left", file=sys.stderr)
    srv.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import resource
import secrets
import signal
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from elastrain import env
from elastrain.children import die_with_parent, end_process
from elastrain.control import protocol as p
from elastrain.control.config import CoordinatorConfig, parse_bytes
from elastrain.control.http import (
    HttpError,
    HttpServer,
    Notifier,
    Request,
    Response,
    error_response,
)
from elastrain.control.layout import Layout, slots_from_wire
from elastrain.control.plan import Generation
from elastrain.control.quorum import Membership
from elastrain.control.store import generation_key, open_store
from elastrain.observe.events import EventKind, EventLog
from elastrain.observe.failures import EVIDENCE_KINDS
from elastrain.observe.metrics import CONTENT_TYPE, CoordinatorMetrics, failure_counts

MAX_BODY = 1 << 20
MAX_WAIT_S = 30.0
BODY_TIMEOUT_S = 10.0
"""A request must arrive within this long (its headers after its first byte,
its body after its headers), or 408."""

__all__ = [
    "BODY_TIMEOUT_S",
    "MAX_BODY",
    "MAX_WAIT_S",
    "ROUTES",
    "Coordinator",
    "HttpError",
    "parse_args",
]


class Coordinator:
    """Owns the membership state, its lock, and the long-poll wake-ups.

    Requests are handled on the server's event-loop thread; every state access
    holds `self.lock` (other threads, e.g. tests calling `status()`, may read).
    A long poll (heartbeat, rendezvous) is an attempt that either answers or
    returns None, then an `await` on `changes` (a `Notifier`), woken when the state
    changed in a way a long poll can see (a removal, a generation formed,
    adopted, broken or ready, the job finished), or at the deadline. Waking
    only on such changes keeps an idle coordinator idle and makes waking cost
    O(waiters) per change, never per heartbeat or registration.

    It keeps the events it emitted that are evidence of failures
    (`EVIDENCE_KINDS`: removals, generations, re-registrations, and
    `exit_reported` for each exit the launcher reports) and counts the failures
    `recognise_failures` finds in them (`failures()`, `status()["failures"]`,
    `elastrain_failures_total` on /metrics).
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = Membership(config)
        self.clock = clock
        """The membership's `now` (tests pass a fake one to drive time; long-poll
        deadlines and rates stay on the real monotonic clock)."""
        self.config = config
        self.token = token
        self._token = token.encode()
        self.job_id = job_id
        self.store_host = store_host
        self.store_port = store_port
        self.events = events
        self.lock = threading.Lock()
        self.members_left = threading.Event()
        """Set whenever members are removed (a preemption drain waits on it)."""
        self.started = time.time()
        self._commits: list[tuple[float, int]] = []
        self._global_batch = 0
        self._preempt_deadline: float | None = None
        self._preempt_decision: tuple[int, int, float | None] | None = None
        """(gen, step, preemption deadline or None) of the latest "proceed" verdict."""
        self.changes = Notifier()
        """Wakes the long polls (see the class docstring)."""
        self._last_key: tuple[int, bool, bool, bool] = (0, False, False, False)
        self._last_wait: str | None = None
        self._ready_body: tuple[Generation, int, bytes] | None = None
        self._gen_secret = secrets.token_bytes(32)
        """Derives each generation's `group_key` (see control/store.py)."""
        self._evidence: list[dict[str, Any]] = []
        """The events this coordinator emitted whose kind is in EVIDENCE_KINDS."""
        self._counted: tuple[int, dict[str, int]] = (-1, {})
        """(len(_evidence) when counted, failure_counts of them): counted again
        only when new evidence came."""
        self.metrics = CoordinatorMetrics(self.status)
        """The Prometheus registry behind /metrics (elastrain.observe.metrics)."""

    def _emit(self, kind: EventKind, **fields: Any) -> None:
        """Write an event; keep it when it is evidence of failures. Holds the lock."""
        rec = self.events.emit(kind, **fields)
        if kind in EVIDENCE_KINDS:
            self._evidence.append(rec)

    def failures(self) -> dict[str, int]:
        """Failures recognised in what this coordinator saw, per kind
        (`elastrain.observe.metrics.failure_counts`). Holds the lock."""
        n, counts = self._counted
        if n != len(self._evidence):
            counts = failure_counts(self._evidence)
            self._counted = (len(self._evidence), counts)
        return dict(counts)

    # ---- helpers ------------------------------------------------------------

    def _key(self) -> tuple[int, bool, bool, bool]:
        g = self.state.gen
        if g is None:
            return (0, False, False, self.state.finished)
        return (g.gen, g.broken, g.is_ready, self.state.finished)

    def _flush(self, wake: bool = False) -> None:
        """Emit events for what changed; wake the long polls if membership or
        generations changed (or `wake`). Holds the lock."""
        removed = self.state.drain_removals()
        formed = self.state.drain_formed()
        adopted = self.state.drain_adopted()
        for g in adopted:
            self._emit(
                EventKind.GENERATION_ADOPTED,
                gen=g.gen,
                members=list(g.members),
                awaiting=sorted(g.awaiting),
                step=g.start_step,
                **self._layout_field(g),
            )
        for r in removed:
            self._emit(EventKind.MEMBER_REMOVED, member=r.member, reason=r.reason)
        if removed:
            self.members_left.set()
        for g in formed:
            self._emit(
                EventKind.GENERATION_FORMED,
                gen=g.gen,
                members=list(g.members),
                reason=g.reason,
                **self._layout_field(g),
            )
        for c in self.state.drain_layout_changes():
            self._emit(EventKind.LAYOUT_CHANGED, gen=c.gen, old=c.old, new=c.new, reason=c.reason)
            _log(f"generation {c.gen} regroups ({c.reason}): {c.old} -> {c.new}")
        for no in self.state.drain_refusals():
            self._emit(
                EventKind.RESHARD_REFUSED,
                alive=no.alive,
                preferred=no.preferred,
                shard_size=no.shard_size,
                needed=no.needed,
                budget=no.budget,
                message=no.message,
            )
            _log(f"reshard refused: {no.message}")
        if self.state.waiting and self.state.waiting != self._last_wait:
            self._emit(
                EventKind.WAITING_FOR_MEMBERS,
                message=self.state.waiting,
                have=len(self.state.members),
                min=self.config.min_members,
            )
        self._last_wait = self.state.waiting
        key = self._key()
        if wake or removed or formed or adopted or key != self._last_key:
            self._last_key = key
            self.changes.notify()

    def _layout_field(self, g: Generation) -> dict[str, Any]:
        """A generation event's `layout` (`Layout.describe()`) and `shard_size`
        (the generation's), only when the job is sharded."""
        if self.config.shard_size == 1:
            return {}
        return {"layout": Layout(g.shard_size, g.slots).describe(), "shard_size": g.shard_size}

    def check_token(self, header: str | bytes | None) -> None:
        """401 unless `header` is `Bearer <the job token>` (the scheme in any
        case, as RFC 7235 says; the token exactly)."""
        if isinstance(header, str):
            header = header.encode()
        if not header or header[:7].lower() != b"bearer ":
            raise HttpError(
                401, "unauthorized", "missing job token (Authorization: Bearer <token>)"
            )
        if not hmac.compare_digest(header[7:].strip(), self._token):
            raise HttpError(401, "unauthorized", "wrong job token")

    def token_ok(self, header: bytes | None) -> bool:
        try:
            self.check_token(header)
        except HttpError:
            return False
        return True

    # ---- ops ----------------------------------------------------------------

    def register(self, req: p.RegisterRequest) -> p.RegisterResponse:
        with self.lock:
            if not self.state.members:
                # The job's model is its current members' model: with none
                # registered, the next one to register sets it.
                self.state.signature = None
            if self.state.signature is None:
                self.state.signature = req.signature
            elif req.signature != self.state.signature:
                from elastrain.transfer import signature_mismatch

                why = signature_mismatch(req.signature, self.state.signature) or "differs"
                self._emit(EventKind.MEMBER_REFUSED, member=req.member, reason=why)
                raise HttpError(
                    409,
                    "model_mismatch",
                    f"refused {req.member}: its model does not match the job's: {why}",
                )
            now = self.clock()
            inc = self.state.register(
                req.member,
                req.pid,
                req.host,
                now,
                gen=req.gen,
                gen_members=tuple(req.gen_members),
                committed=req.committed,
                prev_incarnation=req.prev_incarnation,
                gen_slots=slots_from_wire(req.gen_slots),  # the wire checked their shape
                gen_shard_size=req.gen_shard_size,
            )
            self._emit(
                EventKind.MEMBER_REGISTERED,
                member=req.member,
                incarnation=inc,
                pid=req.pid,
                gen=req.gen,
                running=bool(req.gen_members),
            )
            self._flush()
            return p.RegisterResponse(
                inc,
                self.store_host,
                self.store_port,
                self.job_id,
                self.config.heartbeat_s,
                progress_step=self.state.progress_step,
            )

    def heartbeat(self, req: p.HeartbeatRequest, deadline: float) -> p.HeartbeatResponse | None:
        """One attempt of a heartbeat long poll; None: nothing to say yet."""
        with self.lock:
            now = time.monotonic()
            if not self.state.touch(req.member, req.incarnation, self.clock()):
                known = self.state.knows(req.member)
                return p.HeartbeatResponse(
                    p.HeartbeatStatus.EXPELLED if known else p.HeartbeatStatus.UNKNOWN,
                    self._gen_id(),
                )
            if req.gen and self.state.gen_interrupted(req.gen):
                return p.HeartbeatResponse(p.HeartbeatStatus.CHANGED, self._gen_id())
            if req.gen and self._gen_id() > req.gen:
                # A handoff at a step boundary: the members still stepping in the old
                # generation learn it at their next quorum call, but one that can
                # compute no step there makes none, and waits for exactly this.
                return p.HeartbeatResponse(p.HeartbeatStatus.SUPERSEDED, self._gen_id())
            if now >= deadline:
                return p.HeartbeatResponse(p.HeartbeatStatus.OK, self._gen_id())
            return None

    def rendezvous(
        self, req: p.RendezvousRequest, deadline: float
    ) -> p.RendezvousResponse | bytes | None:
        """One attempt of a rendezvous long poll; None: wait for a change. The
        "ready" answer is the same for every member of a generation: encoded
        once (bytes), not once per member."""
        with self.lock:
            now = time.monotonic()
            status = self.state.rendezvous(
                req.member,
                req.incarnation,
                req.known_gen,
                req.committed,
                self.clock(),
                req.commit_gen,
                req.pending_gen,
            )
            self._flush()
            g = self.state.gen
            if status == p.RendezvousStatus.READY and g is not None:
                if not g.announced:
                    g.announced = True
                    self._emit(
                        EventKind.GENERATION_READY,
                        gen=g.gen,
                        members=list(g.members),
                        steps=dict(g.ready),
                        start_step=g.start_step,
                        **self._layout_field(g),
                        **({"rolls_forward": list(rolls)} if (rolls := g.rolls_forward) else {}),
                    )
                cached = self._ready_body
                if cached is None or cached[0] is not g or cached[1] != g.ready_version:
                    committed, commit_gens = g.answer_counts()
                    r = p.RendezvousResponse(
                        p.RendezvousStatus.READY,
                        g.gen,
                        list(g.members),
                        committed,
                        g.start_step,
                        reason=g.reason,
                        commit_gens=commit_gens,
                        rolls_forward=list(g.rolls_forward),
                        group_key=generation_key(self._gen_secret, g.gen),
                        slots={m: [s.replica, s.shard] for m, s in g.slots.items()},
                        shard_size=g.shard_size,
                        held={m: [h.shard_size, h.shard] for m, h in g.held.items()},
                    )
                    cached = (g, g.ready_version, json.dumps(p.encode(r)).encode())
                    self._ready_body = cached
                return cached[2]
            if status in _FINAL or now >= deadline:
                msg = self.state.waiting or ""
                if status == p.RendezvousStatus.PENDING and g is not None and not msg:
                    names, count = g.missing(5)
                    who = ", ".join(names) or "members"
                    if names and count > len(names):
                        who += f" and {count - len(names)} more"
                    msg = f"generation {g.gen}: waiting for {who}"
                size = g.shard_size if g is not None else self.config.shard_size
                return p.RendezvousResponse(status, message=msg, shard_size=size)
            return None

    def quorum(self, req: p.QuorumRequest) -> p.QuorumResponse:
        with self.lock:
            verdict, gen = self.state.quorum(
                req.member, req.incarnation, req.gen, req.step, req.leaving, self.clock()
            )
            preempt_s = 0.0
            if verdict == p.Verdict.PROCEED:
                d = self._preempt_decision
                if d is None or d[:2] != (req.gen, req.step):
                    # The first request for (gen, step) decides for every member.
                    d = (req.gen, req.step, self._preempt_deadline)
                    self._preempt_decision = d
                if d[2] is not None:
                    preempt_s = max(0.001, d[2] - time.monotonic())
            if verdict == p.Verdict.PROCEED and req.last_loss is not None:
                self.state.last_loss = req.last_loss
            if req.global_batch:
                self._global_batch = req.global_batch
            if verdict == p.Verdict.PROCEED and (
                not self._commits or self._commits[-1][1] < req.step
            ):
                self._commits.append((time.monotonic(), req.step))
                del self._commits[:-50]
                self.metrics.count_commit(self._global_batch)
            if req.observed:
                self.metrics.observe(req.observed)
            if req.scalars:
                self.metrics.observe_scalars(req.scalars)
            self._flush()
            return p.QuorumResponse(verdict, gen, preempt_s)

    def hang(self, req: p.HangRequest) -> p.HangResponse:
        """A member's collective is overdue: expel peers found silent."""
        with self.lock:
            status, silent = self.state.confirm_hang(
                req.member, req.incarnation, req.gen, self.clock()
            )
            self.metrics.hang_checks.labels(answer=str(status)).inc()
            if status == p.HangStatus.CONFIRMED:
                self._emit(
                    EventKind.HANG_CONFIRMED,
                    gen=req.gen,
                    step=req.step,
                    by=req.member,
                    waited_s=req.waited_s,
                    silent=list(silent),
                )
            self._flush(wake=status == p.HangStatus.CONFIRMED)
            return p.HangResponse(status, list(silent))

    def preempt(self, req: p.PreemptRequest) -> p.OkResponse:
        """The whole job is being preempted: from the next step decided on, every
        member is told to take an emergency checkpoint after it and exit."""
        with self.lock:
            if self._preempt_deadline is None:
                self._preempt_deadline = time.monotonic() + max(0.0, req.grace_s)
                self._emit(EventKind.PREEMPT_NOTICE, grace_s=req.grace_s)
            self._flush(wake=True)
            return p.OkResponse(True)

    def leave(self, req: p.LeaveRequest) -> p.OkResponse:
        with self.lock:
            ok = self.state.leave(req.member, req.incarnation, req.reason, self.clock())
            if ok and req.reason == "done":
                self.state.progress_step = max(self.state.progress_step, req.committed)
            self._flush(wake=True)
            return p.OkResponse(ok)

    def exit(self, req: p.ExitRequest) -> p.OkResponse:
        """The launcher saw a worker process exit: drop it, and record the exit
        status (`exit_reported`: evidence of what the failure was)."""
        with self.lock:
            ok = self.state.exited(req.member, req.pid, self.clock())
            self._emit(
                EventKind.EXIT_REPORTED,
                member=req.member,
                pid=req.pid,
                returncode=req.returncode,
                **(
                    {
                        "error_type": req.error_type,
                        "error_message": req.error_message,
                        "error_where": req.error_where,
                    }
                    if req.error_type
                    else {}
                ),
            )
            self._flush(wake=True)
            return p.OkResponse(ok)

    def status(self) -> dict[str, Any]:
        with self.lock:
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
                # Registered and outside the generation: hot spares, and joiners not
                # admitted yet (the next step boundary, or a failure, takes them).
                "standby": sorted(m for m in s.members if g is None or m not in g.member_set),
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
                "failures": self.failures(),
            }

    def tick(self) -> None:
        with self.lock:
            self.state.expire(self.clock())
            self._flush()

    def _gen_id(self) -> int:
        return self.state.gen.gen if self.state.gen else 0


def _log(line: str) -> None:
    """A line in the coordinator's log (its stderr: logs/coordinator.log)."""
    print(f"elastrain coordinator: {line}", file=sys.stderr, flush=True)


ROUTES: dict[str, tuple[type, str]] = {
    "register": (p.RegisterRequest, "register"),
    "heartbeat": (p.HeartbeatRequest, "heartbeat"),
    "rendezvous": (p.RendezvousRequest, "rendezvous"),
    "quorum": (p.QuorumRequest, "quorum"),
    "leave": (p.LeaveRequest, "leave"),
    "hang": (p.HangRequest, "hang"),
    "exit": (p.ExitRequest, "exit"),
    "preempt": (p.PreemptRequest, "preempt"),
}


LONG_POLLS = frozenset({"heartbeat", "rendezvous"})
_json_decode = json.JSONDecoder().decode
"""`json.loads` less its encoding sniffing: the wire is UTF-8 (anything else is a 400)."""


def _wait_s(wait_s: float) -> float:
    """`wait_s` clamped to [0, MAX_WAIT_S] (NaN: 0)."""
    if 0.0 <= wait_s <= MAX_WAIT_S:
        return wait_s
    return MAX_WAIT_S if wait_s > MAX_WAIT_S else 0.0


_FINAL = (p.RendezvousStatus.EXPELLED, p.RendezvousStatus.UNKNOWN, p.RendezvousStatus.FINISHED)
"""Rendezvous answers that end a long poll at once."""

_SMALL = (p.HeartbeatResponse, p.QuorumResponse, p.OkResponse)
_encoded: dict[Any, bytes] = {}
"""Encoded small answers (frozen, hashable): a heartbeat answer is one lookup."""


def _ok(out: Any) -> Response:
    if isinstance(out, bytes):
        return Response(200, out)
    if type(out) in _SMALL:
        data = _encoded.get(out)
        if data is None:
            data = json.dumps(p.encode(out)).encode()
            if len(_encoded) < 4096:
                _encoded[out] = data
        return Response(200, data)
    return Response(200, json.dumps(out if isinstance(out, dict) else p.encode(out)).encode())


def make_handler(coord: Coordinator) -> Callable[[Request], Response | Awaitable[Response]]:
    """The wire API over `coord`: token, route, strict decoding, then the op.
    Answers at once, or returns an awaitable for a long poll that must wait."""

    async def wait(attempt: Callable[[float], Any], deadline: float, epoch: int) -> Response:
        return _ok(await coord.changes.long_poll(attempt, deadline, epoch))

    def _dispatch(req: Request) -> Response | Awaitable[Response]:
        try:
            path = req.path
            if req.method == "GET" and path == "/healthz":
                # Tokenless liveness for probes: says only that it serves.
                return Response(200, b'{"ok":true}')
            coord.check_token(req.headers.get(b"authorization"))
            if req.method == "GET" and path.split("?", 1)[0] == "/metrics":
                # Prometheus text; the bearer token is required like everywhere else.
                return Response(
                    200,
                    coord.metrics.exposition(),
                    content_type=CONTENT_TYPE.encode(),
                )
            if not path.startswith(p.PREFIX):
                raise HttpError(
                    404,
                    "not_found",
                    f"unknown path {path[:100]!r}; this coordinator speaks {p.PREFIX}",
                )
            op = path[len(p.PREFIX) :]
            if req.method == "GET":
                if op != "status":
                    raise HttpError(404, "not_found", f"unknown GET op {op[:100]!r}")
                return _ok(coord.status())
            route = ROUTES.get(op)
            if route is None:
                raise HttpError(
                    404, "not_found", f"unknown op {op[:100]!r}; known: {sorted(ROUTES)}"
                )
            try:
                body = _json_decode(req.body.decode()) if req.body else None
            except (ValueError, RecursionError) as e:  # incl. UnicodeDecodeError
                raise HttpError(400, "malformed", f"body is not JSON: {str(e)[:200]}") from None
            cls, name = route
            try:
                msg: Any = p.decode(cls, body)
            except p.ProtocolError as e:
                raise HttpError(400, "malformed", str(e)) from None
            if name in LONG_POLLS:
                deadline = time.monotonic() + _wait_s(msg.wait_s)
                attempt = getattr(coord, name)
                epoch = coord.changes.epoch
                out = attempt(msg, deadline)
                if out is None:
                    return wait(lambda d: attempt(msg, d), deadline, epoch)
                return _ok(out)
            return _ok(getattr(coord, name)(msg))
        except HttpError as e:
            return error_response(e.status, e.code, e.message)
        except (ValueError, TypeError) as e:
            return error_response(400, "malformed", str(e))

    return _dispatch


def default_max_connections() -> int:
    """What the open-file limit allows, less a margin for the store and logs."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(64, min(soft - 64, 1 << 17))


class CoordinatorServer:
    """The coordinator's HTTP server, TCPStore and expiry ticker, in-process.

    The constructor binds (port 0 picks a free port); `start()` serves on a
    background thread running an asyncio event loop (see control/http.py), so
    this API stays synchronous; `stop()` closes everything. Tests use this
    class directly (with a fake `clock` to drive the membership's time); the
    launcher runs `main()` in a process of its own.
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
        max_connections: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not token:
            raise ValueError(
                "a job token is required (set ELASTRAIN_TOKEN or ELASTRAIN_TOKEN_FILE)"
            )
        self.store = open_store(host, store_port)
        self.events = EventLog(run_dir, "coordinator")
        self.coord = Coordinator(
            config,
            token,
            job_id=job_id or uuid.uuid4().hex[:12],
            store_host=host,
            store_port=self.store.port,
            events=self.events,
            clock=clock,
        )
        self.http = HttpServer(
            make_handler(self.coord),
            host,
            port,
            max_body=MAX_BODY,
            read_timeout_s=BODY_TIMEOUT_S,
            max_connections=max_connections or default_max_connections(),
            trusts=lambda req: self.coord.token_ok(req.headers.get(b"authorization")),
        )
        self.host = host

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> CoordinatorServer:
        self.coord.events.emit(
            EventKind.COORDINATOR_START, host=self.host, port=self.port, store_port=self.store.port
        )
        self.coord.changes.attach(self.http.loop, self.http.in_loop_thread)
        self.http.start()
        self.http.loop.call_soon_threadsafe(self.http.call_every, 0.1, self.coord.tick)
        return self

    def drain_for_preemption(self, grace_s: float) -> bool:
        """The whole job is being preempted: notice every member (as the `preempt`
        op does), then block until no member is registered or `grace_s` has
        passed; returns whether every member left in time. A margin of the
        grace (at most 5 s) is kept for the members' own exit. Called from the
        main thread while the event loop serves the members' last requests."""
        margin = min(5.0, 0.2 * grace_s)
        deadline = time.monotonic() + grace_s
        self.coord.preempt(p.PreemptRequest(grace_s - margin))
        while True:
            with self.coord.lock:
                self.coord.members_left.clear()
                if not self.coord.state.members:
                    return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.coord.members_left.wait(left)

    def stop(self) -> None:
        self.http.stop()
        self.events.close()


def parse_args(
    argv: list[str] | None = None,
) -> tuple[argparse.ArgumentParser, argparse.Namespace, CoordinatorConfig]:
    """`elastrain coordinator`'s command line and the config it makes; a bad one
    exits with status 2 and a usage message."""
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
    ap.add_argument(
        "--min",
        type=int,
        default=0,
        dest="min_members",
        help="fewest members that may train (default: one replica group, --shard-size)",
    )
    ap.add_argument("--max", type=int, default=0, dest="max_members")
    ap.add_argument(
        "--shard-size",
        type=int,
        default=1,
        help="members per replica group, each holding one shard of the model "
        "(default 1: unsharded); --target, --min and --max must be multiples of it",
    )
    ap.add_argument(
        "--reshard-after",
        type=float,
        default=None,
        metavar="S",
        help="sharded jobs: when a replica group has had a vacancy for S seconds with no "
        "replacement, regroup the members in memory to a shard size that makes whole "
        "groups (e.g. 3 members of a 2x2 job as 1x3), and back when replacements return "
        "(default: never; wait for replacements)",
    )
    ap.add_argument(
        "--memory-per-member",
        default=None,
        metavar="BYTES",
        help="bytes of training state a member can hold (512M, 2G, 16Gi, ...): a reshard "
        "to a shard size whose shard does not fit is refused (default: no limit)",
    )
    ap.add_argument(
        "--state-factor",
        type=float,
        default=4.0,
        metavar="F",
        help="bytes of training state per byte of parameters, for --memory-per-member "
        "(default 4: parameter, gradient, two Adam moments)",
    )
    ap.add_argument("--lease", type=float, default=5.0)
    ap.add_argument("--suspect", type=float, default=1.0)
    ap.add_argument(
        "--hang-silence",
        type=float,
        default=0.5,
        metavar="S",
        help="a member whose collective is overdue asks whether a peer is hung: peers "
        "silent for longer than this are (default 0.5 s, two heartbeats)",
    )
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
    ap.add_argument("--ready-timeout", type=float, default=15.0)
    ap.add_argument(
        "--max-connections",
        type=int,
        default=0,
        help="most open client connections (default: what the open-file limit allows)",
    )
    args = ap.parse_args(argv)
    try:
        cfg = CoordinatorConfig(
            target=args.target,
            min_members=args.min_members,
            max_members=args.max_members,
            lease_s=args.lease,
            suspect_s=args.suspect,
            hang_silence_s=args.hang_silence,
            start_grace_s=args.start_grace,
            ready_timeout_s=args.ready_timeout,
            shard_size=args.shard_size,
            reshard_after_s=args.reshard_after,
            memory_per_member=(
                None if args.memory_per_member is None else parse_bytes(args.memory_per_member)
            ),
            state_factor=args.state_factor,
        )
    except ValueError as e:
        ap.error(str(e))
    return ap, args, cfg


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    ap, args, cfg = parse_args(argv)
    host, _, port = args.bind.rpartition(":")
    token = env.read_token()
    if token is None:
        ap.error(f"no job token: set {env.TOKEN} or {env.TOKEN_FILE}")
    srv = CoordinatorServer(
        cfg,
        token,
        host=host or "127.0.0.1",
        port=int(port or 0),
        store_port=args.store_port,
        run_dir=args.run_dir,
        job_id=args.job_id,
        max_connections=args.max_connections or None,
    )
    if args.gen_floor < 0:
        ap.error("--gen-floor must be >= 0")
    srv.coord.state.restarted(args.gen_floor, time.monotonic())
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
    end_process(main())

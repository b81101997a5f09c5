"""The coordinator's wire API, version 1: typed JSON messages over HTTP.

Every request is `POST /v1/<op>` (or `GET /v1/status`) with the header
`Authorization: Bearer <job token>` and a JSON object body. Responses are JSON
objects; errors are `{"error": code, "message": text}` with HTTP status 400
(malformed), 401 (no or wrong token), 404 (unknown op), 409 (refused: e.g. the
joiner's model does not match the job's). Unknown fields are rejected so that a
client of another version fails loudly instead of being half-understood.

Ops (who calls; blocking?):
- `register`   a worker, once per incarnation, and again after a coordinator
               restart (answers "unknown"); returns its incarnation and the store.
- `heartbeat`  every worker, in a background thread; long-polls up to `wait_s`
               and returns early when the worker's generation changes or breaks.
- `rendezvous` a worker that needs a (new) generation; long-polls up to `wait_s`
               until a generation containing it is ready everywhere.
- `quorum`     every member, once per step, before its all-reduce: proceed or regroup.
- `leave`      a worker leaving on purpose (graceful leave or done).
- `exit`       the launcher/agent, when a child process has exited.
- `preempt`    the launcher, when the whole job got SIGTERM: every member takes
               an emergency checkpoint after the next step it gets a verdict for.
- `status`     anyone with the token (launcher progress, tests, `elastrain top`).
See docs/wire-api.md for examples.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_type_hints

API_VERSION = 1
PREFIX = f"/v{API_VERSION}/"


class ProtocolError(ValueError):
    """A request or response body does not match the schema (HTTP 400)."""


T = TypeVar("T")


def _check(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            try:
                return _check(value, arm, where)
            except ProtocolError:
                continue
        raise ProtocolError(f"{where}: {value!r} is not of type {tp}")
    if tp is type(None):
        if value is not None:
            raise ProtocolError(f"{where}: expected null")
        return None
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (arg,) = typing.get_args(tp)
        return [_check(v, arg, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {type(value).__name__}")
        _, varg = typing.get_args(tp)
        return {str(k): _check(v, varg, f"{where}.{k}") for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp}")


def decode(cls: type[T], body: Any) -> T:
    """Validate a JSON object against message dataclass `cls` (strict: unknown
    or missing fields and wrong types raise ProtocolError naming the field)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: body must be a JSON object")
    hints, fields = _schema(cls)
    if not body.keys() <= fields.keys():
        unknown = set(body) - set(fields)
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in body:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        value, tp = body[name], hints[name]
        # The common cases first (the per-request cost of a heartbeat).
        if type(value) is tp and tp in (str, int, float, bool):
            kwargs[name] = value
        else:
            kwargs[name] = _check(value, tp, f"{cls.__name__}.{name}")
    return cls(**kwargs)


_Schema = tuple[dict[str, Any], dict[str, "dataclasses.Field[Any]"]]
_schemas: dict[type, _Schema] = {}


def _schema(cls: type) -> _Schema:
    """A message class's field types and fields, resolved once (resolving the
    string annotations costs more than the rest of a request)."""
    out = _schemas.get(cls)
    if out is None:
        fields = {f.name: f for f in dataclasses.fields(cls)}
        out = _schemas[cls] = (get_type_hints(cls), fields)
    return out


def encode(msg: Any) -> dict[str, Any]:
    """A message as a JSON-ready dict (messages are flat: no nested dataclasses)."""
    return {name: getattr(msg, name) for name in _schema(type(msg))[1]}


# ---- requests -------------------------------------------------------------


@dataclass(frozen=True)
class RegisterRequest:
    member: str
    pid: int
    host: str
    signature: list[Any]
    """The model signature: [[name, shape, dtype], ...]; all members must match."""
    gen: int = 0
    """The newest generation this worker has run in (0: none). A restarted
    coordinator numbers its generations after the highest one reported."""
    gen_members: list[str] = field(default_factory=list)
    """The members of `gen` if the worker is still running it, else empty. A
    restarted coordinator adopts a running generation so training goes on."""
    committed: int = 0
    """The worker's committed step count."""
    prev_incarnation: int = 0
    """The incarnation it had (0: none); the new one is higher."""


@dataclass(frozen=True)
class HeartbeatRequest:
    member: str
    incarnation: int
    gen: int
    wait_s: float = 0.0


@dataclass(frozen=True)
class RendezvousRequest:
    member: str
    incarnation: int
    known_gen: int
    """The generation the caller last ran in (0: none); it wants a newer one."""
    committed: int
    """The caller's committed step count."""
    wait_s: float = 10.0


@dataclass(frozen=True)
class QuorumRequest:
    member: str
    incarnation: int
    gen: int
    step: int
    leaving: bool = False
    last_loss: float | None = None
    global_batch: int = 0
    """Samples per step (for throughput in status; 0 if unknown)."""


@dataclass(frozen=True)
class LeaveRequest:
    member: str
    incarnation: int
    reason: str
    """"left" (graceful leave, wants a replacement) or "done" (finished the job)."""
    committed: int = 0


@dataclass(frozen=True)
class PreemptRequest:
    grace_s: float
    """Seconds the job has left (Kubernetes' termination grace period, --grace)."""


@dataclass(frozen=True)
class ExitRequest:
    member: str
    pid: int
    returncode: int


# ---- responses ------------------------------------------------------------


@dataclass(frozen=True)
class RegisterResponse:
    incarnation: int
    store_host: str
    store_port: int
    job_id: str
    heartbeat_s: float


@dataclass(frozen=True)
class HeartbeatResponse:
    status: str
    """"ok", "changed" (a newer generation exists or the caller's broke),
    "expelled", or "unknown" (this coordinator never saw the caller: it was
    restarted; register again, reporting the generation you run)."""
    gen: int


@dataclass(frozen=True)
class RendezvousResponse:
    status: str
    """"ready", "pending" (call again), "expelled" or "unknown" (register
    again), "finished"."""
    gen: int = 0
    members: list[str] = field(default_factory=list)
    committed: dict[str, int] = field(default_factory=dict)
    start_step: int = 0
    message: str = ""


@dataclass(frozen=True)
class QuorumResponse:
    verdict: str
    """"proceed" (run the step in this generation), "regroup", "expelled", or
    "unknown" (register again, then ask again)."""
    gen: int
    preempt_s: float = 0.0
    """> 0: the job is being preempted. After committing this step, take one
    emergency checkpoint within this many seconds, then exit. Decided once per
    (gen, step) like the verdict, so every member gets the same answer."""


@dataclass(frozen=True)
class OkResponse:
    ok: bool = True

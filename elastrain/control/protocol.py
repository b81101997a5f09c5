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
See docs/design/wire-api.md for examples.
"""

from __future__ import annotations

import dataclasses
import math
import reprlib
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar, get_type_hints

from elastrain.observe.scalars import MAX_METRIC_SCALARS, NAME_RE
from elastrain.observe.tally import MAX_PENDING, Observed

API_VERSION = 1
PREFIX = f"/v{API_VERSION}/"
INT_MIN, INT_MAX = -(2**63), 2**63 - 1
"""Wire integers are signed 64-bit, whatever the client's language."""


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
        raise ProtocolError(f"{where}: {_short(value)} is not of type {tp}")
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
            raise ProtocolError(f"{where}: expected true/false, got {_short(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected an integer, got {_short(value)}")
        if not INT_MIN <= value <= INT_MAX:
            raise ProtocolError(f"{where}: integer {_short(value)} does not fit in 64 bits")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {_short(value)}")
        try:
            number = float(value)
        except OverflowError:
            raise ProtocolError(f"{where}: number {_short(value)} is out of range") from None
        if where.endswith("_s") and not (math.isfinite(number) and number >= 0):
            raise ProtocolError(
                f"{where}: a duration must be a finite number of seconds >= 0, got {number!r}"
            )
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a string, got {_short(value)}")
        return value
    raise TypeError(f"unsupported schema type {tp}")


class _ShortRepr(reprlib.Repr):
    def repr_int(self, x: int, level: int) -> str:
        return super().repr_int(x, level) if abs(x) < 10**30 else "<huge int>"


def _short(value: Any) -> str:
    """A bounded repr of ``value`` (length and depth): errors echo hostile input, not all of it."""
    return _ShortRepr().repr(value)


MAX_STRING = 256
"""Longest string in a message (a member id, a host, a reason), in characters;
`STRING_LIMITS` names the fields allowed more. A longer one is a 400 naming
the field: names are echoed into answers and every event, so an unbounded one
grows the event log by its length per event."""
STRING_LIMITS: dict[str, int] = {
    "RendezvousResponse.message": 4096,
    "ExitRequest.error_message": 512,
    "ExitRequest.error_where": 1024,
    "signature": 1024,
    "signature.dtype": 64,
}


def _check_strings(value: Any, where: str, limit: int) -> None:
    """Every string in `value` (and every key of an object) is at most `limit` long."""
    if isinstance(value, str):
        if len(value) > limit:
            raise ProtocolError(
                f"{where}: a string of {len(value)} characters is longer than {limit}"
            )
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_strings(v, f"{where}[{i}]", limit)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_strings(k, f"{where} key", limit)
            _check_strings(v, f"{where}.{k}", limit)


def _check_signature(value: Any, where: str) -> None:
    name_limit, dtype_limit = STRING_LIMITS["signature"], STRING_LIMITS["signature.dtype"]
    for i, e in enumerate(value):
        if not (
            isinstance(e, list)
            and len(e) == 3
            and isinstance(e[0], str)
            and isinstance(e[1], list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in e[1])
            and isinstance(e[2], str)
        ):
            raise ProtocolError(
                f"{where}[{i}]: expected [name, [dim, ...], dtype] with dims >= 0, got {_short(e)}"
            )
        _check_strings(e[0], f"{where}[{i}] name", name_limit)
        _check_strings(e[2], f"{where}[{i}] dtype", dtype_limit)


def _check_leave_reason(value: Any, where: str) -> None:
    if value not in ("left", "done"):
        raise ProtocolError(f'{where}: expected "left" or "done", got {_short(value)}')


def _check_slots(value: Any, where: str) -> None:
    """member -> [replica, shard], both >= 0 (a sharded layout's slots)."""
    for m, v in value.items():
        if len(v) != 2 or v[0] < 0 or v[1] < 0:
            raise ProtocolError(f"{where}.{m}: expected [replica, shard] >= 0, got {_short(v)}")


def _check_held(value: Any, where: str) -> None:
    """member -> [shard_size, shard] with shard_size >= 1 and 0 <= shard < shard_size."""
    for m, v in value.items():
        if len(v) != 2 or not 0 <= v[1] < v[0]:
            raise ProtocolError(
                f"{where}.{m}: expected [shard_size, shard] with 0 <= shard < shard_size, "
                f"got {_short(v)}"
            )


def _check_shard_size(value: Any, where: str) -> None:
    if value < 0:
        raise ProtocolError(f"{where}: expected a shard size >= 1, or 0 (not said), got {value}")


_OBSERVED = frozenset(map(str, Observed))
MAX_OBSERVED = MAX_PENDING
"""Values per kind in `QuorumRequest.observed` (`elastrain.observe.tally.MAX_PENDING`)."""


def _check_observed(value: Any, where: str) -> None:
    """Known kinds only; each a list of at most MAX_OBSERVED finite values >= 0."""
    for kind, values in value.items():
        if kind not in _OBSERVED:
            known = ", ".join(map(str, Observed))
            raise ProtocolError(f"{where}: unknown kind {_short(kind)} (known: {known})")
        if len(values) > MAX_OBSERVED:
            raise ProtocolError(f"{where}.{kind}: more than {MAX_OBSERVED} values")
        for i, v in enumerate(values):
            if not (math.isfinite(v) and v >= 0):
                raise ProtocolError(
                    f"{where}.{kind}[{i}]: expected a finite number >= 0, got {v!r}"
                )


def _check_scalars(value: Any, where: str) -> None:
    """At most MAX_METRIC_SCALARS names, each as `NAME_RE`, each value finite."""
    if len(value) > MAX_METRIC_SCALARS:
        raise ProtocolError(f"{where}: more than {MAX_METRIC_SCALARS} names")
    for name, v in value.items():
        if not NAME_RE.fullmatch(name):
            raise ProtocolError(f"{where}: name {_short(name)} is not [A-Za-z0-9_./-]{{1,64}}")
        if not math.isfinite(v):
            raise ProtocolError(f"{where}.{name}: expected a finite number, got {v!r}")


FIELD_CHECKS: dict[tuple[str, str], Callable[[Any, str], None]] = {
    ("QuorumRequest", "observed"): _check_observed,
    ("QuorumRequest", "scalars"): _check_scalars,
    ("RegisterRequest", "signature"): _check_signature,
    ("RegisterRequest", "gen_slots"): _check_slots,
    ("RegisterRequest", "gen_shard_size"): _check_shard_size,
    ("LeaveRequest", "reason"): _check_leave_reason,
    ("RendezvousResponse", "slots"): _check_slots,
    ("RendezvousResponse", "held"): _check_held,
}
"""Checks beyond the field's type, run by `decode` after the type check. Every
field also gets the generic rules of `_check`: integers fit in int64, and a
float named ``*_s`` is a duration (finite, >= 0); other floats (a loss) may be
NaN or infinite, as a diverged run reports them."""


def decode(cls: type[T], body: Any) -> T:
    """Validate a JSON object against message dataclass `cls` (strict: unknown
    or missing fields and wrong types raise ProtocolError naming the field)."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: body must be a JSON object")
    plan, names = _plan(cls)
    if not body.keys() <= names:
        unknown = sorted(str(k)[:40] for k in set(body) - set(names))
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {unknown[:5]}")
    kwargs: dict[str, Any] = {}
    for name, tp, required, where, fast, extra, limit, fast_tp in plan:
        if name not in body:
            if required:
                raise ProtocolError(f"{cls.__name__}: missing field {name!r}")
            continue
        value = body[name]
        # The common cases inline (the per-request cost of a heartbeat or a
        # verdict); the same rules as `_check`, which answers everything else and
        # raises the errors. NaN fails every comparison, so it falls through too.
        if type(value) is fast_tp and (
            (fast == _EXACT and (fast_tp is not str or len(value) <= limit))
            or (fast == _INT and INT_MIN <= value <= INT_MAX)
            or (fast == _DURATION and 0.0 <= value < math.inf)
            or (fast == _EMPTY and not value)
            or (fast == _NULL)
        ):
            kwargs[name] = value
        else:
            kwargs[name] = _check(value, tp, where)
            if fast != _INT and fast != _DURATION and extra is None:
                _check_strings(kwargs[name], where, limit)
        if extra is not None:
            extra(kwargs[name], where)
    return cls(**kwargs)


_GENERIC, _EXACT, _INT, _DURATION, _EMPTY, _NULL = range(6)
_FieldPlan = tuple[str, Any, bool, str, int, "Callable[[Any, str], None] | None", int, Any]
_plans: dict[type, tuple[tuple[_FieldPlan, ...], Any]] = {}


def _plan(cls: type) -> tuple[tuple[_FieldPlan, ...], Any]:
    """Per field of `cls`, resolved once: (name, type, required, where, fast
    path, extra check, longest string, the value's type the fast path takes);
    and the set of field names."""
    out = _plans.get(cls)
    if out is None:
        hints, fields = _schema(cls)
        plan = []
        for name, f in fields.items():
            tp = fast_tp = hints[name]
            fast = _GENERIC
            if tp in (str, bool) or (tp is float and not name.endswith("_s")):
                fast = _EXACT
            elif tp is int:
                fast = _INT
            elif tp is float:
                fast = _DURATION
            elif typing.get_origin(tp) in (list, dict):
                fast, fast_tp = _EMPTY, typing.get_origin(tp)  # an empty one needs no look inside
            elif typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in (
                typing.get_args(tp)
            ):
                fast, fast_tp = _NULL, type(None)  # null; a value takes `_check`
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            where = f"{cls.__name__}.{name}"
            extra = FIELD_CHECKS.get((cls.__name__, name))
            limit = STRING_LIMITS.get(where, MAX_STRING)
            plan.append((name, tp, required, where, fast, extra, limit, fast_tp))
        out = _plans[cls] = (tuple(plan), fields.keys())
    return out


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
    gen_slots: dict[str, list[int]] = field(default_factory=dict)
    """With `gen_members`, in a sharded job: the slots of `gen` (member ->
    [replica, shard]) as its ready answer gave them. A restarted coordinator
    adopts them with the generation; without them it assumes rank order."""
    gen_shard_size: int = 0
    """With `gen_slots`: the shard size of `gen` (its ready answer's
    `shard_size`), which differs from the job's after a reshard. 0: not said
    (a worker that predates resharding): the coordinator's configured one."""


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
    commit_gen: int = 0
    """The generation whose commits the caller's state carries (the one it last
    committed in, or its healers'; 0: none, or fresh from a checkpoint)."""
    pending_gen: int = 0
    """Sharded: the generation in which the caller reduced the step at its
    committed count over its shard's twins but did not learn the commit vote's
    outcome (its own wait for the vote failed); it kept that reduced gradient.
    0: none (always 0 unsharded, and from a worker that predates it)."""


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
    observed: dict[str, list[float]] = field(default_factory=dict)
    """What this member measured since its last quorum request, for the
    coordinator's /metrics: kind (`elastrain.observe.tally.Observed`) -> values,
    seconds or bytes, each finite and >= 0, at most `MAX_OBSERVED` per kind."""
    scalars: dict[str, float] = field(default_factory=dict)
    """The script's own scalars (`trainer.log`) since the last quorum request,
    the last value per name, for /metrics (`elastrain_user_scalar{name}`): names
    as `elastrain.observe.scalars.NAME_RE`, finite values, at most
    `MAX_METRIC_SCALARS` names. Only rank 0 sends any."""


@dataclass(frozen=True)
class HangRequest:
    """The caller's collective of (`gen`, `step`) has waited `waited_s`, past
    its soft watchdog deadline: is a peer hung (`Membership.confirm_hang`)?"""

    member: str
    incarnation: int
    gen: int
    step: int
    waited_s: float = 0.0


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
    """A worker process exited (the launcher saw it). The `error_*` fields, empty
    unless the script raised an exception it did not catch, are its exit record
    (`elastrain.exitrecord.ScriptError`); optional, so the body of a launcher that
    predates them still decodes, and one that has no error to report sends the
    same body as before."""

    member: str
    pid: int
    returncode: int
    error_type: str = ""
    """The exception's class name (`ValueError`)."""
    error_message: str = ""
    """Its message, at most 500 characters."""
    error_where: str = ""
    """The script line that raised it, ``file:line``."""


# ---- vocabulary -----------------------------------------------------------
# The wire carries these as their plain string values (StrEnum members compare
# equal to them), so the format is unchanged; code names them, never retypes them.


class HeartbeatStatus(StrEnum):
    OK = "ok"
    CHANGED = "changed"
    """The caller's generation broke, or was superseded in a way that aborts its
    collectives: give it up now."""
    SUPERSEDED = "superseded"
    """A newer generation exists, formed at a step boundary (a join or a leave): the
    caller's collectives go on and its next quorum call says so; a member waiting for
    the next generation (one that can compute no step in its own) goes to it now."""
    EXPELLED = "expelled"
    UNKNOWN = "unknown"
    """This coordinator never saw the caller (it was restarted): register again."""


class RendezvousStatus(StrEnum):
    READY = "ready"
    PENDING = "pending"
    """Call again."""
    EXPELLED = "expelled"
    UNKNOWN = "unknown"
    FINISHED = "finished"


class Verdict(StrEnum):
    PROCEED = "proceed"
    """Run the step in this generation."""
    REGROUP = "regroup"
    EXPELLED = "expelled"
    UNKNOWN = "unknown"
    """Register again, then ask again."""


class HangStatus(StrEnum):
    """The coordinator's answer to an overdue collective (`HangRequest`)."""

    CONFIRMED = "confirmed"
    """Peers of the generation were silent: expelled, the generation re-forms."""
    ALIVE = "alive"
    """Every peer is heartbeating: the step is slow, not hung; keep waiting."""
    STALE = "stale"
    """The generation is no longer current (or the caller was expelled)."""


class GenerationReason(StrEnum):
    """Why a generation was formed."""

    START = "start"
    FAILURE = "failure"
    JOIN = "join"
    LEAVE = "leave"
    ADOPTED = "adopted"
    RESHARD = "reshard"
    """The same members regrouped to another shard size, in memory: a vacancy
    lasted longer than `CoordinatorConfig.reshard_after_s`."""


# ---- responses ------------------------------------------------------------


@dataclass(frozen=True)
class RegisterResponse:
    incarnation: int
    store_host: str
    store_port: int
    job_id: str
    heartbeat_s: float
    progress_step: int = 0
    """The most steps the job has voted to proceed past (0: none yet, or a
    coordinator restarted since): a registrant that has committed fewer will be
    healed when admitted, and prepares its landing while it waits."""


@dataclass(frozen=True)
class HeartbeatResponse:
    status: str
    """"ok", "changed" (the caller's generation broke or was superseded: abort),
    "superseded" (a newer generation formed at a step boundary: nothing to abort),
    "expelled", or "unknown" (this coordinator never saw the caller: it was
    restarted; register again, reporting the generation you run)
    (`HeartbeatStatus`)."""
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
    reason: str = ""
    """Why the generation was formed: "start", "failure", "join", "leave",
    "adopted", "reshard" (`GenerationReason`)."""
    commit_gens: dict[str, int] = field(default_factory=dict)
    """member -> its `commit_gen`. Among the members at `start_step`, those with
    the highest one are the heal senders: a member that completed a step its
    peers abandoned (and re-ran without it) holds the same step count but not
    the job's state."""
    group_key: str = ""
    """With "ready": the generation's secret, part of its gloo group's store
    prefix (`elastrain.control.store.group_prefix`), so that only the members
    told it can name the group's keys. "" from a coordinator that predates it."""
    slots: dict[str, list[int]] = field(default_factory=dict)
    """With "ready", in a sharded job: member -> [replica, shard], its slot
    (`elastrain.control.layout.Layout.from_wire`). Empty when unsharded, and
    from a coordinator that predates sharding."""
    shard_size: int = 1
    """With "ready": this generation's shard size (members per replica group; 1:
    unsharded), which `slots` are in. It is the job's configured one
    (`--shard-size`) unless the coordinator resharded (reason "reshard"), and
    back at it once members return. Other answers: the current generation's
    (the configured one before the first). A coordinator that predates
    resharding always sends its configured one."""
    rolls_forward: list[str] = field(default_factory=list)
    """With "ready", in a sharded job: the members that apply the step they kept
    (`RendezvousRequest.pending_gen`) before the heal, because a member of this
    generation committed that step in that generation (so every member of it had
    reduced its shard, and the vote passed). `committed` and `commit_gens`
    already count them one step further, in that generation. [] from a
    coordinator that predates it."""
    held: dict[str, list[int]] = field(default_factory=dict)
    """With "ready", in a sharded job: member -> [shard_size, shard], what that
    member's state holds as the generation starts, i.e. its slot in the last
    generation it was part of that became ready: the rows [shard/shard_size,
    (shard+1)/shard_size) of every parameter (`elastrain.control.layout.Holding`).
    Absent for a member that never held anything (a fresh joiner). Where it
    differs from the member's new slot (after a reshard), its rows move. It is
    what the coordinator knows: a member whose heal or move in that generation
    was cut short by a failure may hold less, which a worker must check (the
    per-shard state hash) rather than trust. {} from a coordinator that
    predates resharding."""


@dataclass(frozen=True)
class HangResponse:
    status: str
    """"confirmed", "alive" or "stale" (`HangStatus`)."""
    silent: list[str] = field(default_factory=list)
    """With "confirmed": the members found silent, now expelled."""


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

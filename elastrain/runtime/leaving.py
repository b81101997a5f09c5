"""A worker that must end for good tells the job before it goes.

Shared by the exits that no retry inside the process can mend (a torn heal,
`EXIT_STATE_TORN`; a poisoned device, `EXIT_DEVICE_POISONED`): the coordinator
hears the exit status first, so the peers regroup at once and the failure is
recorded as what it is, not suspected as a hang; then the `worker_exit` event is
written. How the process then ends (an orderly shutdown, or at once) is the
caller's: it differs per cause.
"""

from __future__ import annotations

import contextlib
import logging
import os

from elastrain.control import protocol as p
from elastrain.control.client import CoordinatorClient, CoordinatorError
from elastrain.exitcodes import ExitReason
from elastrain.observe.events import EventKind, EventLog

log = logging.getLogger("elastrain.engine")


def announce_exit(
    client: CoordinatorClient,
    events: EventLog,
    member: str,
    code: int,
    reason: ExitReason,
    committed: int,
    why: str,
) -> None:
    """Tell the coordinator `member` exits with `code` (an unreachable coordinator
    is no reason to stay: the launcher reports the same exit when the process
    ends), then write the `worker_exit` event with `why` (cut to 300 characters)."""
    log.error("%s: %s; leaving for a fresh process", member, why)
    with contextlib.suppress(CoordinatorError):
        client.exit(p.ExitRequest(member, os.getpid(), code))
    events.emit(EventKind.WORKER_EXIT, reason=reason, committed=committed, error=why[:300])

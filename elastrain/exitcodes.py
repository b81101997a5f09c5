"""Exit statuses of a worker process (shared by the trainer and the launcher) and of
`elastrain run` itself (RUN_*; docs/guide/events.md, "Worker output and exit statuses").

The launcher (or a Kubernetes pod policy) reads them to decide whether to
replace the worker; this module imports nothing, so the launcher does not pay
for torch.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from elastrain.exitrecord import ScriptError

EXIT_LEFT = 75
"""Left gracefully (SIGTERM): replace it, the job goes on."""

EXIT_REFUSED = 3
"""Refused by the coordinator (its model does not match the job's): do not replace."""

EXIT_PREEMPTED = 76
"""Stopped by a whole-job preemption notice after the emergency checkpoint."""

EXIT_NO_COORDINATOR = 1
"""Could not reach the coordinator within the register timeout: a crash."""


EXIT_SCRIPT_ERROR = 1
"""The script raised an exception it did not catch (Python's own status for that).
The worker entry point leaves an exit record naming it (`elastrain.exitrecord`); the
launcher replaces the worker unless the same exception at the same script line
ended another worker recently (`elastrain.launch.failwatch`)."""

EXIT_MISCONFIGURED = 78
"""The script is set up in a way elastrain cannot run (it initialises its own process
group, wraps the model in DistributedDataParallel, or its batch sizes do not fit):
replacing the worker cannot help. The worker prints what to change on stderr and the
launcher stops the job at once, showing it. (78 is sysexits' EX_CONFIG.)"""

EXIT_STATE_LOST = 79
"""Part of the job's training state is gone from every member's memory (a sharded
job with one replica group lost a rank: no twin holds its shard), so no replacement
can be healed. The worker's message names the newest committed checkpoint; the
launcher stops the job at once, and running the same command again resumes from
that checkpoint. (79: after sysexits' range, which 75-78 above borrow from.)"""

EXIT_DEVICE_POISONED = 74
"""This worker's device failed in a way no retry in the same process survives (a
sticky CUDA error, or a failed device health check; `elastrain.runtime.device`):
replace the process, never reuse it. The survivors go on and heal the replacement.
(74: sysexits' EX_IOERR.)"""

EXIT_STATE_TORN = 73
"""A heal into this worker failed after it began writing the worker's live state
(the heal lands the model straight in its tensors, `elastrain.transfer.TornHeal`):
the process holds no valid state, so it must never train on it or be picked to
send it. It leaves; the launcher replaces it without counting it against the
job's startup checks (a peer's failure tore it), and the fresh process is healed
again from members that hold the state. A heal torn by the member's own failure
(its install refused the state) leaves its cause as the exit record, and the
same-error rule stops repeats of it. (73: sysexits' EX_CANTCREAT, unused here.)"""

# ---- `elastrain run` (the launcher's own exit status) ----------------------------

RUN_DONE = 0
"""The job finished."""

RUN_FAILED = 1
"""The job failed (or was stopped) and did not leave a checkpoint of its end."""

RUN_USAGE = 2
"""Bad arguments, or a mistake in the script found before any process started."""

RUN_PREEMPTED = 76
"""The job was preempted (SIGTERM) and its emergency checkpoint is committed: run
the same command again (same --run-dir) to resume. Same value as EXIT_PREEMPTED."""

RUN_INTERRUPTED = 130
"""Stopped by Ctrl-C (128 + SIGINT, the shell's convention)."""


class ExitReason(StrEnum):
    """Why a worker exits; the `reason` of its `worker_exit` event."""

    DONE = "done"
    LEFT = "left"
    PREEMPTED = "preempted"
    REFUSED = "refused"
    NO_COORDINATOR = "no_coordinator"
    MISCONFIGURED = "misconfigured"
    STATE_LOST = "state_lost"
    DEVICE_POISONED = "device_poisoned"
    STATE_TORN = "state_torn"


class WorkerExit(Exception):
    """The library's request to end this worker process with exit status `code`.

    Raised from `steps()` (never `SystemExit`: a user's script may catch it to
    clean up, and code that embeds a trainer is not killed by a library). The
    worker entry point (`python -m elastrain.worker`, what `elastrain run`
    starts) maps it to the process exit status; `reason` is the `worker_exit`
    event's reason and `message` is printed on stderr when not empty.
    `immediate`: the entry point ends the process at once (`os._exit`), running no
    destructor, atexit hook or thread: a device with a sticky error makes torch
    abort the process when a CUDA tensor is freed, which would turn `code` into
    SIGABRT.
    `record`: the exit record the entry point writes (`elastrain.exitrecord`), for
    an exit whose cause would end a fresh process the same way (a torn heal of
    this member's own, `EXIT_STATE_TORN`); None for every other exit.
    """

    def __init__(
        self,
        code: int,
        reason: ExitReason,
        message: str = "",
        *,
        immediate: bool = False,
        record: ScriptError | None = None,
    ) -> None:
        super().__init__(message or f"worker exit: {reason} (status {code})")
        self.code = code
        self.reason = reason
        self.message = message
        self.immediate = immediate
        self.record = record

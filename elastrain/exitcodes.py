"""Exit statuses of a worker process, shared by the trainer and the launcher.

The launcher (or a Kubernetes pod policy) reads them to decide whether to
replace the worker; this module imports nothing, so the launcher does not pay
for torch.
"""

EXIT_LEFT = 75
"""Left gracefully (SIGTERM): replace it, the job goes on."""

EXIT_REFUSED = 3
"""Refused by the coordinator (its model does not match the job's): do not replace."""

EXIT_PREEMPTED = 76
"""Stopped by a whole-job preemption notice after the emergency checkpoint."""

"""Well-known mistakes in a training script, said in words that tell what to change.

Torch-free (torch is imported only to look at a model), so the launcher uses the
same messages for what it can check before starting anything
(`elastrain.launch.preflight`), and a worker uses `preflight` before its first
rendezvous for what only it can see. A worker that finds one raises
`WorkerExit(EXIT_MISCONFIGURED)`; the worker entry point prints the message; the launcher recognises the
status, stops the job at once and shows the message.
"""

from __future__ import annotations

import sys
from typing import Any, NoReturn

from elastrain.checkpoint.config import CheckpointFormat
from elastrain.exitcodes import EXIT_MISCONFIGURED, ExitReason, WorkerExit

OWN_PROCESS_GROUP = (
    "the script initialises its own process group (torch.distributed.init_process_group): "
    "elastrain builds the process group itself and rebuilds it whenever members come and "
    "go. Remove the init_process_group call (and destroy_process_group), and use "
    "elastrain's trainer for the all-reduce."
)
DDP_WRAPPED = (
    "the model is wrapped in DistributedDataParallel: elastrain averages the gradients "
    "itself, over whoever is alive. Pass the bare model (drop the DDP(...) wrapper)."
)
NO_DEFAULT_GROUP_TEXT = "Default process group has not been initialized"
"""torch's error when a script uses torch.distributed collectives (or DDP) directly."""


class Misconfigured(Exception):
    """The script cannot run under elastrain as written; the message says what to change."""


def batch_problems(global_batch: int, micro_batch: int, members: int | None = None) -> list[str]:
    """What is wrong with these batch sizes for `members` workers (empty: nothing)."""
    if global_batch < 1 or micro_batch < 1:
        return [f"batch sizes must be positive (global {global_batch}, micro {micro_batch})"]
    if global_batch % micro_batch:
        fits = [d for d in range(1, micro_batch + 1) if global_batch % d == 0][-1]
        return [
            f"the micro-batch ({micro_batch}) does not divide the global batch ({global_batch}): "
            f"use micro_batch_size={fits}, or a global batch that is a multiple of {micro_batch}"
        ]
    n = global_batch // micro_batch
    if members is not None and members > n:
        return [
            f"{members} workers but only {n} micro-batches per step ({global_batch} / "
            f"{micro_batch}): {members - n} worker(s) would get no micro-batch and add nothing. "
            f"Use -n {n} (or fewer), or micro_batch_size={max(1, global_batch // members)} "
            "if that fits in memory"
        ]
    return []


def explain(error: BaseException | str) -> str | None:
    """The message for an error torch raised because of a well-known mistake, else None."""
    text = str(error)
    if NO_DEFAULT_GROUP_TEXT in text:
        return (
            "the script calls torch.distributed (a collective, or DistributedDataParallel) "
            "directly; under elastrain there is no default process group. " + DDP_WRAPPED
        )
    return None


def model_problems(model: Any) -> list[str]:
    """The model is wrapped in DDP, or the script already made a process group."""
    out = []
    # torch.compile(DDP(model)) is DDP too: look inside the compile wrapper.
    inner = getattr(model, "_orig_mod", model)
    if any(c.__name__ == "DistributedDataParallel" for c in type(inner).__mro__):
        out.append(DDP_WRAPPED)
    if "torch.distributed" in sys.modules:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            out.append(OWN_PROCESS_GROUP)
    return out


def format_problem(fmt: CheckpointFormat, framework: str, sharded: bool) -> str | None:
    """Why a job of ``framework`` cannot write its checkpoints in format ``fmt``
    (`TrainerConfig.checkpoint_format`, --ckpt-format), or None. DCP holds torch
    tensors by a torch model's parameter names: a JAX job's state has neither,
    so it writes flat checkpoints. A sharded job writes DCP whatever ``fmt``
    says (its only format). Pure."""
    if fmt == CheckpointFormat.DCP and not sharded and framework != "torch":
        return (
            f"--ckpt-format dcp (checkpoint_format) is for torch jobs: a {framework} job's "
            "checkpoints are written in the flat format; drop the flag or pass "
            "--ckpt-format flat"
        )
    return None


def preflight(model: Any, global_batch: int, micro_batch: int, members: int | None = None) -> None:
    """Raise `Misconfigured` naming every well-known mistake found (the worker's check)."""
    problems = model_problems(model) + batch_problems(global_batch, micro_batch, members)
    if problems:
        raise Misconfigured("; ".join(problems))


def exit_misconfigured(message: str) -> NoReturn:
    """End the worker with EXIT_MISCONFIGURED; the worker entry point prints the
    message on stderr, where the launcher finds it and shows it."""
    raise WorkerExit(
        EXIT_MISCONFIGURED, ExitReason.MISCONFIGURED, f"elastrain: misconfigured: {message}"
    )

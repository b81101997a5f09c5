"""Which transport carries a generation's gradient all-reduce: gloo, or NCCL on CUDA.

Every generation has a gloo group (`elastrain.runtime.group`): the heal, the
extras of evaluation, the sharded commit vote and everything else a generation
does run on it. On a CUDA model the step's gradient all-reduce (the bulk of
the bytes) moves to a `ProcessGroupNCCL` built for that generation only:

- **Built per generation, non-blocking.** Its communicator is created with
  NCCL's non-blocking configuration (``blocking = 0``) and connected eagerly
  when the generation forms, so a member missing at the start fails the
  connect (the generation is abandoned like any other that cannot connect),
  not the first step.
- **Aborted, not parked.** A gloo group whose all-reduce may still be in
  flight is parked until that work ends (`Graveyard`). An NCCL kernel waiting
  for a dead peer never ends by itself, so a broken generation's NCCL group is
  aborted (`ProcessGroupNCCL.abort()`, which ends its kernels) on the
  graveyard's thread and then dropped; the training thread never blocks on it.
- **The host sees the device finish.** NCCL's `work.wait()` only orders the
  caller's CUDA stream after the collective; the step's waiter needs to know
  when the sum is really there, so each work is wrapped to also synchronise
  the device's current stream (`DeviceWork`). That wait runs on the waiter's
  helper thread, so the watchdog and a coordinator notice still interrupt it.
- **Heal stays on gloo.** NCCL point-to-point needs every communicator healthy,
  which a heal (run right after a failure) cannot assume; the healed bytes go
  over gloo through pinned host copies (`elastrain.transfer.dtypes.cpu_bytes`).

`torch.distributed.shrink_group` is not used: it shrinks groups registered
with the default process group (elastrain's are standalone, one per
generation), it cannot add a joiner (every replacement is one), and it hangs on
some NCCL versions; a fresh communicator per generation costs what
`benchmarks/gpu_check.py` measures at world size 1.

The choice (`choose_transport`) is pure and CPU-tested; the NCCL calls need a
CUDA build and run only in `benchmarks/gpu_check.py` on a GPU.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

COLLECTIVES = ("auto", "gloo", "nccl")
"""`TrainerConfig.collectives`' values."""

NCCL_MIN = (2, 14, 3)
"""The oldest NCCL elastrain builds generations on: the first release whose
communicators can be created non-blocking (`ncclCommInitRankConfig` with
``blocking = 0``) and aborted while an operation is in flight; with an older one
an abort can itself wait for the dead peer."""


ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""torch's switch for what its NCCL watchdog does with a failed or timed-out
collective, read when a group is built. torch's default (3) ends the process;
elastrain survives a peer's death in the same process, so it sets 2 (abort the
communicators, keep the process) when the variable is unset, and warns when a
value that ends the process was chosen (1, 3): the member then dies with its
peer and is replaced, which costs a restart, not the job."""

_PROCESS_ENDING = ("1", "3")

log = logging.getLogger("elastrain.collectives")


class Transport(StrEnum):
    """What carries a generation's gradient all-reduce."""

    GLOO = "gloo"
    NCCL = "nccl"


@dataclass(frozen=True)
class TransportChoice:
    transport: Transport
    why: str
    """One line for the `worker_start` event and the log: why this transport."""


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(v) for v in version)


def parse_nccl_version(raw: Any) -> tuple[int, int, int]:
    """(major, minor, patch) from what ``torch.cuda.nccl.version()`` returns: a
    tuple (newer torch; a suffix string after the numbers is dropped) or NCCL's
    integer code (2.8 and older: 2708 for 2.7.8; newer: 21805 for 2.18.5)."""
    if isinstance(raw, tuple | list):
        nums = [int(v) for v in raw if isinstance(v, int)]
        if len(nums) < 3:
            raise ValueError(f"cannot read an NCCL version from {raw!r}")
        return nums[0], nums[1], nums[2]
    code = int(raw)
    if code >= 10000:  # NCCL_VERSION(X, Y, Z) = X * 10000 + Y * 100 + Z since 2.9
        return code // 10000, code // 100 % 100, code % 100
    return code // 1000, code // 100 % 10, code % 100


def choose_transport(
    setting: str,
    device_type: str,
    *,
    sharded: bool,
    nccl_version: tuple[int, int, int] | None,
) -> TransportChoice:
    """The transport for `TrainerConfig.collectives` ``setting`` on a member whose
    model is on a ``device_type`` device; ``nccl_version``: the NCCL torch runs
    with (None: torch was built without NCCL).

    "gloo" is always possible. "nccl" needs a CUDA model, a replicated one (the
    sharded backend's FSDP2 runs over gloo), and NCCL >= `NCCL_MIN`: when asked
    for explicitly and one is missing, ValueError says which and what to do.
    "auto" takes NCCL where all three hold and gloo otherwise, saying why.
    Every member of a job must choose alike (they do: same config, same kind of
    device, same software image)."""
    if setting not in COLLECTIVES:
        raise ValueError(
            f"collectives must be 'auto' (NCCL for a CUDA model, else gloo), 'gloo' or "
            f"'nccl', got {setting!r}"
        )
    if setting == "gloo":
        return TransportChoice(Transport.GLOO, "collectives='gloo'")
    problem = None
    if device_type != "cuda":
        problem = f"the model is on a {device_type} device; NCCL needs CUDA"
    elif sharded:
        problem = "a sharded model's FSDP2 collectives run over gloo (shard_size > 1)"
    elif nccl_version is None:
        problem = "this torch was built without NCCL"
    elif nccl_version < NCCL_MIN:
        problem = (
            f"NCCL {version_text(nccl_version)} is older than {version_text(NCCL_MIN)}, the "
            "first whose communicators can be created non-blocking and aborted while a "
            "collective waits for a dead peer; install a torch built with a newer NCCL "
            "(or the nvidia-nccl wheel it names)"
        )
    if problem is None:
        assert nccl_version is not None
        return TransportChoice(Transport.NCCL, f"NCCL {version_text(nccl_version)} on CUDA")
    if setting == "nccl":
        raise ValueError(f"collectives='nccl' is not possible here: {problem}; or use 'gloo'")
    return TransportChoice(Transport.GLOO, f"gloo: {problem}")


def runtime_nccl_version() -> tuple[int, int, int] | None:
    """The NCCL this process's torch runs with; None without one (a CPU build)."""
    if not dist.is_nccl_available():
        return None
    return parse_nccl_version(torch.cuda.nccl.version())


def settle_error_handling(environ: MutableMapping[str, str]) -> str | None:
    """Set `ERROR_HANDLING` to 2 in ``environ`` unless it is set; returns a warning
    when its value ends the process on a collective's failure, else None."""
    value = environ.setdefault(ERROR_HANDLING, "2")
    if value not in _PROCESS_ENDING:
        return None
    return (
        f"{ERROR_HANDLING}={value}: a peer's death in an NCCL collective will end this "
        "process too (2 would let it survive and abort the communicator instead)"
    )


class DeviceWork:
    """A collective's work whose `wait()` returns once the device has finished it
    (NCCL's own `wait()` only makes the current stream wait for it)."""

    def __init__(self, work: Any, device: torch.device) -> None:
        self.work = work
        self.device = device

    def wait(self) -> None:
        self.work.wait()
        torch.cuda.current_stream(self.device).synchronize()


class NcclGroup:
    """One generation's NCCL communicator for the gradient all-reduce.

    Offers what the engine asks of a gradient group: ``allreduce([tensor])``,
    whose work `Waiter` waits for, and `abort()`, which `Graveyard` calls for a
    generation that ended (see the module docstring)."""

    def __init__(self, pg: Any, device: torch.device) -> None:
        self.pg = pg
        self.device = device

    def allreduce(self, tensors: list[torch.Tensor]) -> DeviceWork:
        return DeviceWork(self.pg.allreduce(tensors), self.device)

    def abort(self) -> None:
        self.pg.abort()


def build_nccl_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    device: torch.device,
    *,
    op_timeout_s: float,
) -> NcclGroup:
    """Build and connect this member's NCCL group for one generation (every member
    of it calls this with the same prefix, after its gloo group is up). Needs a
    CUDA build with NCCL >= `NCCL_MIN` (`choose_transport` checked it).
    ``op_timeout_s``: NCCL's own per-collective timeout, a backstop set beyond
    elastrain's step watchdog (which aborts the group first)."""
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds

    if (warning := settle_error_handling(os.environ)) is not None:
        log.warning("%s", warning)
    opts = ProcessGroupNCCL.Options()
    opts.config.blocking = 0
    opts._timeout = datetime.timedelta(seconds=op_timeout_s)
    pg = ProcessGroupNCCL(dist.PrefixStore(prefix, store), rank, size, opts)
    # Create the communicator now: a member that never arrives fails the
    # generation's connect, not its first step.
    pg.eager_connect_single_device(device)
    return NcclGroup(pg, device)

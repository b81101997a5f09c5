"""A JAX replica made of K processes: its runtime, its mesh and its layout (pure parts).

Inside a replica (as inside a MaxText slice) the K processes run one
`jax.distributed` runtime; the mesh has one axis, ``fsdp``, over their
devices. A parameter is sharded along its first dimension over ``fsdp`` where
K divides it (else replicated: every process holds all of it), unless the
script gives its own `PartitionSpec` per leaf. Process k holds the same rows
of every parameter as process k of every other replica: its *twins*.

`init_distributed` must run before anything initialises JAX's backend: the
worker entry point (`python -m elastrain.worker`) calls it before the script
when the launcher placed the process in a multi-process replica. The runtime
cannot be re-initialised in the same process (jax 0.10: `initialize` after a
`shutdown` raises "must be called before any JAX calls that might initialise
the XLA backend"), so a replica whose process dies is rebuilt as K fresh
processes (docs/guide/jax.md).

`ReplicaLayout` is the generation's view (pure): which replicas are complete,
who are this process's twins, which micro-batches it computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from elastrain.data import assign_rounds
from elastrain.runtime.replica_place import ReplicaPlace

AXIS = "fsdp"
"""The replica mesh's one axis: parameters are sharded over it, and so are a round's
micro-batches (one per process)."""

Runtime = tuple[int, int]
"""(replica slot, incarnation): one JAX runtime of K processes."""


def init_distributed(place: ReplicaPlace) -> None:
    """Join this process's replica runtime (blocks until its K processes are in).

    CPU collectives go over gloo (measured in ENGINE-NOTES: jax 0.10 on CPU);
    GPUs and TPUs use their platform's own."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=place.coordinator,
        num_processes=place.procs,
        process_id=place.proc,
    )
    # Nothing here may create the XLA backend: the script's own settings (its
    # XLA_FLAGS, set before its first JAX call) must still apply.


def replica_place(procs: int) -> ReplicaPlace:
    """This process's place, read from the environment; `procs` is the config's K.
    Raises ValueError where the launcher did not start it as a process of a
    K-process replica (the JAX runtime must be up before the script's first JAX
    call: only the worker entry point can do that)."""
    import os

    import jax

    place = ReplicaPlace.from_environ(os.environ)
    if place is None or place.procs != procs:
        got = "none" if place is None else f"{place.procs} processes"
        raise ValueError(
            f"replica_procs {procs}: this worker was not started as a process of a "
            f"{procs}-process replica (its place: {got}); start the job with "
            f"`elastrain run -n R*{procs} --replica-procs {procs}`"
        )
    if not jax.distributed.is_initialized():
        raise ValueError(
            "the replica's JAX runtime is not initialised: run the script through "
            "`elastrain run --replica-procs K` (its worker entry point initialises it)"
        )
    if jax.local_device_count() != 1:
        raise ValueError(
            f"a process of a multi-process replica drives one device here; this one sees "
            f"{jax.local_device_count()} (one device per process: set CUDA_VISIBLE_DEVICES "
            "or --devices)"
        )
    return place


def default_spec(shape: Sequence[int], procs: int) -> tuple[str | None, ...]:
    """The partition of a leaf of `shape` over `procs` processes: rows split over
    ``fsdp`` where `procs` divides the first dimension, else replicated (``()``)."""
    if len(shape) >= 1 and shape[0] % procs == 0 and shape[0] >= procs:
        return (AXIS,)
    return ()


def local_rows(shape: Sequence[int], spec: Sequence[str | None], procs: int, proc: int) -> Any:
    """The index (a tuple of slices) of process `proc`'s part of a leaf of `shape`
    partitioned by `spec` (only ``fsdp`` on one dimension, or nothing)."""
    index: list[slice] = [slice(None)] * len(shape)
    for d, axis in enumerate(spec):
        if axis == AXIS:
            if shape[d] % procs:
                raise ValueError(f"dimension {d} of {list(shape)} is not divisible by {procs}")
            n = shape[d] // procs
            index[d] = slice(proc * n, (proc + 1) * n)
        elif axis is not None:
            raise ValueError(f"unknown mesh axis {axis!r}: the replica's mesh has {AXIS!r} only")
    return tuple(index)


@dataclass(frozen=True)
class ReplicaLayout:
    """A generation's members as replicas (pure).

    members  the generation in rank order
    places   member -> (runtime, process id) as each published it
    procs    K
    """

    members: tuple[str, ...]
    places: Mapping[str, tuple[Runtime, int]]
    procs: int

    def runtime_of(self, member: str) -> Runtime:
        return self.places[member][0]

    def complete(self) -> list[Runtime]:
        """The runtimes with all K processes in this generation, in the order of
        their first member's rank (the order micro-batch blocks go in)."""
        seen: dict[Runtime, set[int]] = {}
        for w in self.members:
            rt, k = self.places[w]
            seen.setdefault(rt, set()).add(k)
        return [rt for rt, ks in seen.items() if len(ks) == self.procs]

    def twins(self, proc: int) -> list[str]:
        """The members holding shard `proc`, in rank order (this process included)."""
        return [w for w in self.members if self.places[w][1] == proc]

    def turns(self, member: str, num_microbatches: int) -> list[int | None]:
        """`member`'s micro-batches, one per round of its replica (None: a padding
        round, weight 0); [] where its replica is incomplete (it computes nothing
        and applies its twins' sum). Raises LookupError with no complete replica."""
        full = self.complete()
        if not full:
            raise LookupError("no replica has all its processes in this generation")
        rt, k = self.places[member]
        if rt not in full:
            return []
        return assign_rounds(num_microbatches, len(full), full.index(rt), self.procs, k)

"""Which local accelerator each worker of a launcher (or an agent's node) uses.

`elastrain run --devices 0,1,2,3` (and `elastrain agent --devices ...`) gives each
worker one device of the list: its environment gets ``CUDA_VISIBLE_DEVICES`` =
that device (so the script's ``cuda`` / ``cuda:0`` is it), ``LOCAL_RANK`` = its
index in the list and ``LOCAL_WORLD_SIZE`` = the list's length, as torchrun's
workers see them. No torch import: the launcher never pays for it.

The policy (`DevicePool.take`, pure bookkeeping, no I/O):

- a fresh worker takes the first device nobody uses;
- a replacement takes the device of the worker it replaces when that one left
  it healthy (a killed or crashed process does not make its GPU suspect; the
  slot is kept as a rescheduled pod keeps its node);
- a worker that ended with EXIT_DEVICE_POISONED (a sticky device error, see
  `elastrain.runtime.device`) marks its device failed: nobody is placed there
  again in this run, and its replacement takes a free healthy device (a spare
  GPU of the node) when there is one;
- with no healthy device free, nothing is placed (`take` returns None): the
  launcher says so and the job goes on with the members it has.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from elastrain import env

AUTO = "auto"
"""`--devices auto`, the default: the node's GPUs as `detect_devices` finds them,
placed when there is one for every worker (`auto_devices`)."""

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")
"""One directory per GPU the NVIDIA driver exposes to this machine or container."""


def parse_devices(text: str) -> tuple[str, ...] | str:
    """`--devices`: "auto", or comma-separated device indices or UUIDs ("0,1,2,3",
    "GPU-8a1f..."), at least one, no duplicates. ValueError says what is wrong."""
    if text.strip() == AUTO:
        return AUTO
    devices = tuple(d.strip() for d in text.split(","))
    if not devices or any(not d or any(c.isspace() for c in d) for d in devices):
        raise ValueError(f"--devices takes comma-separated device indices or UUIDs, got {text!r}")
    dup = sorted({d for d in devices if devices.count(d) > 1})
    if dup:
        raise ValueError(f"--devices lists {', '.join(dup)} more than once")
    return devices


def detect_devices(
    environ: Mapping[str, str] | None = None, gpus_dir: Path = NVIDIA_GPUS
) -> tuple[str, ...]:
    """The GPUs this node gives its workers, found without importing torch or CUDA:
    the entries of ``CUDA_VISIBLE_DEVICES`` when it is set (a scheduler's choice:
    Slurm's, a device plugin's, the user's; empty: none), else one index per GPU
    the NVIDIA driver lists, else none (a CPU machine)."""
    environ = os.environ if environ is None else environ
    visible = environ.get(env.VISIBLE_DEVICES)
    if visible is not None:
        return tuple(d.strip() for d in visible.split(",") if d.strip())
    try:
        n = sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        return ()
    return tuple(str(i) for i in range(n))


def auto_devices(found: tuple[str, ...], workers: int) -> tuple[tuple[str, ...] | None, str]:
    """What `--devices auto` places for `workers` processes (-n + --spares) given the
    detected GPUs: all of them when there is one per worker (the extra ones serve
    replacements of a poisoned device), else nothing. Returns (devices or None, a
    note for the user, "" when there is nothing to say)."""
    if not found:
        return None, ""
    if len(found) >= workers:
        return found, ""
    return None, (
        f"found {len(found)} GPU(s) ({','.join(found)}) for {workers} workers: not placing "
        "them one per GPU (every worker sees all of them); --devices LIST places them"
    )


@dataclass
class DevicePool:
    """The devices of one launcher and who holds each (see the module docstring)."""

    devices: tuple[str, ...]
    held: dict[str, str] = field(default_factory=dict)
    """member -> its device, for members whose process is running."""
    failed: set[str] = field(default_factory=set)
    """Devices a poisoned exit marked: never used again in this run."""
    _left: dict[str, str] = field(default_factory=dict)
    """member -> the device it held when its process ended healthy-device-wise."""

    def take(self, member: str, replaces: str | None = None) -> str | None:
        """The device for `member` (a replacement of `replaces`, or a fresh worker);
        None when no healthy device is free."""
        busy = set(self.held.values())
        prev = self._left.pop(replaces, None) if replaces is not None else None
        if prev is not None and prev not in busy and prev not in self.failed:
            choice: str | None = prev
        else:
            choice = next((d for d in self.devices if d not in busy and d not in self.failed), None)
        if choice is not None:
            self.held[member] = choice
        return choice

    def release(self, member: str, *, poisoned: bool) -> None:
        """`member`'s process ended; `poisoned`: it exited EXIT_DEVICE_POISONED."""
        device = self.held.pop(member, None)
        if device is None:
            return
        if poisoned:
            self.failed.add(device)
        else:
            self._left[member] = device

    def env(self, member: str) -> dict[str, str]:
        """The environment that places `member` on its device."""
        device = self.held[member]
        return {
            env.VISIBLE_DEVICES: device,
            env.LOCAL_RANK: str(self.devices.index(device)),
            env.LOCAL_WORLD_SIZE: str(len(self.devices)),
        }

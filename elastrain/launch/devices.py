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

from dataclasses import dataclass, field

from elastrain import env


def parse_devices(text: str) -> tuple[str, ...]:
    """`--devices`: comma-separated device indices or UUIDs ("0,1,2,3", "GPU-8a1f..."),
    at least one, no duplicates. ValueError says what is wrong."""
    devices = tuple(d.strip() for d in text.split(","))
    if not devices or any(not d or any(c.isspace() for c in d) for d in devices):
        raise ValueError(f"--devices takes comma-separated device indices or UUIDs, got {text!r}")
    dup = sorted({d for d in devices if devices.count(d) > 1})
    if dup:
        raise ValueError(f"--devices lists {', '.join(dup)} more than once")
    return devices


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

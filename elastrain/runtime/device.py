"""Where a member's training runs: its device, the reduction dtype it implies, and
whether the device can still be trusted.

Pure decisions on `torch.device` values and exceptions (a CPU-only build can
name ``cuda:0`` without one), so the CPU tests cover them; the backends
allocate what these functions decide. The distributed contract: every member
of a job trains on the same kind of device, so every member picks the same
reduction dtype (a mix would sum different bytes in one all-reduce; the
coordinator does not check it, the model signature does not carry devices).

A *poisoned* device is one whose errors are sticky: after a CUDA illegal memory
access, a device-side assert, an uncorrectable ECC error or a lost device (the
Xid family), every later call in that process fails or, worse, runs on corrupt
state. Retrying in the same process cannot help, so the worker leaves with
`elastrain.exitcodes.EXIT_DEVICE_POISONED` and its launcher or agent starts a
fresh process in its place, which the survivors heal as any replacement.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

REDUCE_DTYPES = ("auto", "float64", "native")
"""`TrainerConfig.reduce_dtype`'s values; "auto" resolves per device (`resolve_reduce_dtype`)."""

_POISON_MARKS = (
    "illegal memory access",
    "device-side assert",
    "unspecified launch failure",
    "uncorrectable ecc error",
    "ecc error encountered",
    "an illegal instruction was encountered",
    "misaligned address",
    "hardware stack error",
    "device has fallen off the bus",
    "gpu has fallen off the bus",
    "cuda error: launch failed",
    "cudaerrorlaunchfailure",
    "unhandled cuda error",
    "cuda driver error",
    "cuda error: unknown error",
)
"""Lower-case fragments of the messages of errors after which a device is not to be
used again by this process (CUDA's sticky errors, as torch and NCCL report them)."""


def model_device(params: Iterable[torch.Tensor]) -> torch.device:
    """The one device of a model's parameters (CPU for a model without any).

    ValueError naming two of them if they differ: a model split across devices
    (pipeline stages, manual placement) has no single place for its gradient
    buffers; elastrain trains one device per member."""
    seen: dict[torch.device, int] = {}
    for i, p in enumerate(params):
        seen.setdefault(p.device, i)
        if len(seen) > 1:
            (a, ia), (b, ib) = list(seen.items())[:2]
            raise ValueError(
                f"the model's parameters are on several devices ({a} for parameter #{ia}, {b} "
                f"for #{ib}): elastrain trains each member on one device; move the whole "
                "model with model.to(device) before building the trainer"
            )
    return next(iter(seen), torch.device("cpu"))


def resolve_reduce_dtype(setting: str, device_type: str) -> str:
    """ "float64" or "native" for `TrainerConfig.reduce_dtype` ``setting`` on a device
    of type ``device_type`` (torch's "cpu", "cuda", ...; JAX's platform names).

    "auto" is "float64" on the CPU (the exact sum: the loss curve does not depend
    on who computed which micro-batch, at twice the all-reduce bytes, which CPU
    jobs can afford) and "native" on an accelerator, where float64 arithmetic
    and twice the bytes on the interconnect would cost real step time, and whose
    users accept the last-bit differences data-parallel training has anyway
    (docs/design/devices.md). An explicit "float64" or "native" is kept."""
    if setting not in REDUCE_DTYPES:
        raise ValueError(f"reduce_dtype must be one of {', '.join(REDUCE_DTYPES)}, got {setting!r}")
    if setting != "auto":
        return setting
    return "float64" if device_type in ("cpu", "meta") else "native"


def is_poisoned(error: BaseException) -> bool:
    """True if ``error`` (or what it was raised from) says the device is broken for
    this process: a sticky CUDA error (see the module docstring). Collective
    errors from a peer's death ("connection closed", timeouts) are not."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).lower()
        if any(mark in text for mark in _POISON_MARKS):
            return True
        e = e.__cause__ or e.__context__
    return False


def check_device(device: torch.device) -> str | None:
    """None if ``device`` answers (a tiny computation there, waited for), else why not.

    CPU and meta devices always answer. For CUDA this surfaces a sticky error
    that an asynchronous kernel left behind."""
    if device.type != "cuda":
        return None
    try:
        x = torch.ones(16, device=device)
        got = float((x * 2).sum())
        torch.cuda.synchronize(device)
    except Exception as e:  # noqa: BLE001 - any failure to answer is the answer
        lines = str(e).strip().splitlines()
        return f"{device}: {type(e).__name__}: {lines[0] if lines else ''}"
    if got != 32.0:
        return f"{device}: computed {got} for 32 (the device returns wrong results)"
    return None

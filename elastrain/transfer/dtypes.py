"""Dtype names on the wire (``str(dtype)``, e.g. ``"torch.bfloat16"``) and raw byte views."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _table() -> dict[str, torch.dtype]:
    found = (getattr(torch, n, None) for n in dir(torch))
    return {str(d): d for d in found if isinstance(d, torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``: ``str(dtype)``."""
    return str(dtype)


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of `dtype_name`; raises KeyError for a name this torch does not know."""
    return _table()[name]


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` tensor over ``t``'s bytes, without a copy when ``t`` is contiguous.

    Works for 0-dim tensors and every dtype that supports ``view(torch.uint8)``.
    A non-contiguous tensor is copied first (the view is then read-only in effect:
    writing to it does not change ``t``).
    """
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def cpu_bytes(t: torch.Tensor) -> torch.Tensor:
    """Like `byte_view`, but always on the CPU: a tensor on an accelerator is copied
    into pinned (page-locked) host memory, which the device's DMA engine writes
    directly, instead of through a pageable bounce buffer. The copy is complete
    when this returns."""
    b = byte_view(t)
    if b.device.type == "cpu":
        return b
    host = torch.empty(b.numel(), dtype=torch.uint8, pin_memory=b.device.type == "cuda")
    host.copy_(b)
    return host

"""What keeps a sharded member's resident memory near its share of the training state.

A member of S shards holds its rows of the parameters (P/S bytes), of the
optimizer's state (AdamW: 2 P/S) and, with float64 reductions, the step's
float64 gradient sum (2 P/S for float32 parameters): five times its share of
the parameters against the full training state's 3 P, so at S = 2 it holds
5/6 of the full state, at S = 4 5/12. Four things used to come on top, each
as large as a whole share or more; three are removed here:

- the allocator: glibc raises its mmap threshold (up to 32 MB) each time a
  large block is freed, after which every tensor below that size (a block's
  weights and gradients, FSDP2's per-unit buffers) comes from the heap and
  its freed space is rarely returned: a run's resident size grew by about a
  full training state over a few steps (measured at GPT dim 768 x 10 layers).
  Not changed here: pinning the threshold (``MALLOC_MMAP_THRESHOLD_=1048576``
  in the workers' environment) returns what a step frees at once, but maps
  and faults in every large tensor again each step: +25-35% step time for the
  demo GPT dim 256 x 8 at 2 x 2 on a 2-core CPU (1.35-1.40 s against
  1.01-1.11 s, A/B of the same job). It is the user's choice, for a model
  that would not fit otherwise (docs/guide/sharded.md);
- FSDP2's own sharded ``.grad``, which this backend never reads (its hook adds
  each reduce-scatter's output into the float64 sum): `drop_fsdp_grads`
  drops it the moment FSDP2 sets it (P/S);
- the mean gradient beside the float64 sum at the optimizer step: `mean_in_place`
  writes the mean, rounded to each parameter's dtype, over the sum's own
  storage, and returns the bytes it no longer needs to the system (P/S);
- the mean gradient after the step: the shard's ``.grad`` is cleared once the
  optimizer stepped (`ShardedBackend._apply`), or it lived on beside the
  next step's float64 sum (P/S).

Local to a member; no communication, no change to any value: the mean's bits
are the same rounding of the same float64 quotient.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import sys
from collections.abc import Iterable, Mapping

import torch

log = logging.getLogger("elastrain.sharded")

_MADV_DONTNEED = 4
_CHUNK = 1 << 20
"""Elements converted at a time by `mean_in_place` (its only scratch: 8 MiB)."""


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


def drop_fsdp_grads(params: Iterable[torch.nn.Parameter]) -> None:
    """Drop FSDP2's sharded ``.grad`` of ``params`` as soon as FSDP2 sets it (FSDP2
    calls a parameter's post-accumulate-grad hooks right after): the wrapper's
    reduce-scatter hook has already taken the values it needs."""

    def drop(p: torch.Tensor) -> None:
        p.grad = None

    for p in params:
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(drop)


def mean_in_place(
    buf: torch.Tensor,
    spans: Mapping[str, tuple[int, int]],
    shapes: Mapping[str, torch.Size],
    dtypes: Mapping[str, torch.dtype],
    divisor: int,
) -> dict[str, torch.Tensor]:
    """Each parameter's mean gradient, ``buf[lo:hi] / divisor`` rounded to its dtype
    (the same kernels as ``buf[lo:hi].div_(divisor).to(dtype)``, so the same bits),
    written over ``buf``'s own storage, and returned as views of it. ``buf``: the
    float64 sum, 1-D; ``spans``: name -> its elements, in ascending order; the
    mean of a parameter is packed at byte ``o`` <= ``8 * lo``, so every write
    lands on bytes already read. The bytes past the last mean are then garbage
    and are handed back to the system (a page-aligned ``madvise``; they read as
    zeros after): ``buf`` is unusable as a sum until zeroed again."""
    assert buf.dtype == torch.float64 and buf.dim() == 1 and buf.is_contiguous()
    raw = buf.view(torch.uint8)
    out: dict[str, torch.Tensor] = {}
    at = 0
    for name, (lo, hi) in spans.items():
        dtype = dtypes[name]
        assert at <= 8 * lo, "spans out of order"
        n = hi - lo
        dst = raw[at : at + n * dtype.itemsize].view(dtype)
        for k in range(0, n, _CHUNK):
            # The quotient is taken whole into a scratch before the copy writes: the
            # write may cover this chunk's own bytes, never a later one's.
            dst[k : k + _CHUNK].copy_(buf[lo + k : min(hi, lo + k + _CHUNK)].div(divisor))
        out[name] = dst.view(shapes[name])
        at = -(-(at + n * dtype.itemsize) // 8) * 8
    _release(buf, at)
    return out


def _release(buf: torch.Tensor, keep: int) -> None:
    """Return the whole pages of ``buf`` past its first ``keep`` bytes to the system."""
    madvise = getattr(_LIBC, "madvise", None)
    if madvise is None:
        return
    page = mmap.PAGESIZE
    start = -(-(buf.data_ptr() + keep) // page) * page
    end = (buf.data_ptr() + buf.numel() * buf.element_size()) // page * page
    if end > start:
        madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)

"""FLOPs per training step, counted once with `torch.utils.flop_counter`.

`measure_step_flops` runs one micro-batch forward and backward under
`FlopCounterMode` (matrix multiplies, convolutions, attention: the operations
that dominate; element-wise work is not counted, as in the usual MFU
definition) and scales it to the global batch: a step is
`global_batch / micro_batch` micro-batches of the same shape. The model's
state is left as it was: gradients, buffers (e.g. BatchNorm statistics) and
the RNG are restored afterwards, so measuring never changes training.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

METHOD = "torch.utils.flop_counter (forward+backward of one micro-batch, scaled)"


@dataclass(frozen=True)
class FlopCount:
    """flops_per_microbatch: forward + backward of one micro-batch.
    flops_per_step: scaled to the global batch. flops_per_sample: per sample.
    tokens_per_sample: sequence length when the batch looks like token ids
    (an integer tensor of shape [batch, T]), else None. seconds: measuring time."""

    flops_per_microbatch: int
    flops_per_step: int
    flops_per_sample: float
    tokens_per_sample: int | None
    seconds: float
    method: str = METHOD


def _extra_formulas() -> dict[Any, Any]:
    """Formulas torch's counter lacks: the CPU flash-attention kernels that
    `scaled_dot_product_attention` (and so nn.MultiheadAttention, nn.Transformer*)
    dispatches to on CPU; counted like the CUDA ones (full T x T, no causal discount)."""
    from torch.utils import flop_counter as fcm

    out: dict[Any, Any] = {}
    aten = torch.ops.aten
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and hasattr(fcm, "sdpa_flop_count"):

        def flash_cpu(q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any) -> int:
            return int(fcm.sdpa_flop_count(q, k, v))

        out[fwd] = flash_cpu
    if bwd is not None and hasattr(fcm, "sdpa_backward_flop_count"):

        def flash_cpu_bwd(
            g: Any, q: Any, k: Any, v: Any, *args: Any, out_shape: Any = None, **kw: Any
        ) -> int:
            return int(fcm.sdpa_backward_flop_count(g, q, k, v))

        out[bwd] = flash_cpu_bwd
    return out


def count_flops(fn: Callable[[], torch.Tensor]) -> int:
    """FLOPs of `fn()` (returning a scalar loss) plus its backward."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False, custom_mapping=_extra_formulas()) as fc:
        loss = fn()
        loss.backward()
    return int(fc.get_total_flops())


def tokens_per_sample(batch: Any) -> int | None:
    """T when the first integer tensor found in `batch` has shape [batch, T]."""
    items = batch if isinstance(batch, list | tuple) else [batch]
    if isinstance(batch, dict):
        items = list(batch.values())
    for x in items:
        if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 2:
            return int(x.shape[1])
    return None


def measure_step_flops(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    micro_batch_size: int,
    global_batch_size: int,
) -> FlopCount:
    """Count one micro-batch's forward+backward FLOPs and scale them to the step.

    Who calls it: every worker once, from its training thread, before its first
    step (`WorkerMetering`). Blocks for about one micro-batch's compute. The
    model's grads, buffers and mode and the RNG are restored afterwards.
    """
    t0 = time.monotonic()
    params = list(model.parameters())
    grads = [q.grad for q in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    training = model.training
    try:
        for q in params:
            q.grad = None
        model.train()
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
            per_mb = count_flops(lambda: loss_fn(model, batch))
    finally:
        for q, g in zip(params, grads, strict=True):
            q.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        model.train(training)
    per_step = per_mb * (global_batch_size // micro_batch_size)
    return FlopCount(
        per_mb,
        per_step,
        per_step / global_batch_size,
        tokens_per_sample(batch),
        time.monotonic() - t0,
    )

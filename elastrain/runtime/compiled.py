"""torch.compile in an elastic job: finding a compiled model, compiling it before the first step.

A compiled model compiles on its first forward and its first backward, which
takes seconds (inductor took ~100 s for a small MLP with a cold cache on a
busy 2-core machine; docs/design/compile.md). A replacement that did this
inside its first step would keep its peers waiting in the all-reduce long
enough for their watchdog to call it a hang; so the torch backend runs one
micro-batch through a compiled model before the member registers
(`TorchBackend.warm_up`) and leaves no trace of it: the gradients, the
buffers (batch-norm statistics), the train/eval mode and the RNG are as before.
The names a compiled model gives its tensors are handled in
`elastrain.transfer.names`. Local; no communication.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastrain.transfer.names import COMPILE_WRAPPER


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` or one of its submodules is compiled: wrapped by
    ``torch.compile`` (an ``OptimizedModule``) or compiled in place with
    ``Module.compile()``. A compiled copy held elsewhere (a loss function's
    closure) is not seen: pass the module the loss function calls."""
    return any(
        COMPILE_WRAPPER in m._modules or getattr(m, "_compiled_call_impl", None) is not None
        for m in model.modules()
    )


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """Run a forward and backward of ``model`` that leaves no trace: its params'
    ``.grad`` (set to None inside), its buffers, its train/eval mode (train inside)
    and the CPU RNG are restored afterwards."""
    params = list(model.parameters())
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    training = model.training
    try:
        for p in params:
            p.grad = None
        model.train()
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), buffers, strict=True):
                b.copy_(saved)
        model.train(training)


def compile_now(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
) -> None:
    """Compile ``model``'s training forward and backward on ``batch`` (one
    micro-batch) now, leaving no trace (`untouched`). Who calls: the training
    thread, before the member registers."""
    with untouched(model):
        loss_fn(model, batch).backward()


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Compiled code runs eagerly inside (``torch.compiler.set_stance("force_eager")``),
    e.g. while FLOPs are counted op by op; the compiled code is kept for afterwards."""
    with torch.compiler.set_stance("force_eager"):
        yield

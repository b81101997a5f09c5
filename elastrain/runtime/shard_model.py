"""What a sharded member does with the script's model besides taking its rows.

Two things a replicated member does on its whole model, done here without
anyone holding it whole: compiling (`torch.compile(model)` passed to the
trainer: its settings are applied to each replica group's FSDP2 wrapper) and
counting the step's FLOPs (on a meta-device copy: shapes only). Local; no
communication.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

log = logging.getLogger("elastrain.sharded")

_IN_PLACE = (
    "a model compiled in place (Module.compile()) cannot be sharded (TrainerConfig.shard_size "
    "> 1): pass torch.compile(model) instead; each replica group's FSDP2 wrapper is then "
    "compiled with its settings"
)


def uncompiled(model: nn.Module) -> tuple[nn.Module, Any]:
    """The model to shard and how the script compiled it: ``torch.compile(model)``
    gives its original module and its compile settings (its dynamo context, for
    `compiled_as`); an uncompiled model, itself and None. A model compiled in
    place (``Module.compile()``, on it or a submodule) is refused: its compiled
    call is bound to the module it compiled, which the shards replace."""
    from torch._dynamo.eval_frame import OptimizedModule

    from elastrain.runtime.compiled import is_compiled

    if isinstance(model, OptimizedModule):
        inner, ctx = model._orig_mod, model.dynamo_ctx
        if is_compiled(inner):
            raise ValueError(_IN_PLACE)
        return inner, ctx
    if is_compiled(model):
        raise ValueError(_IN_PLACE)
    return model, None


def compiled_as(wrapper: nn.Module, ctx: Any) -> nn.Module:
    """``wrapper`` (a replica group's FSDP2 module) compiled with the settings
    `uncompiled` found: what ``torch.compile`` would have returned for it.
    FSDP2's hooks run eagerly between the compiled graphs; the graphs are built
    at the wrapper's first forward and backward."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule(wrapper, ctx)


def meta_flops(
    template: nn.Module,
    loss_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    micro_batch: int,
    global_batch: int,
) -> dict[str, Any] | None:
    """The `flops_measured` fields a replicated member reports (the whole model's
    forward and backward of one micro-batch, scaled to the global batch),
    counted on a copy of ``template`` (a meta-device model) with ``batch`` moved
    to the meta device: no memory, no collective, no member holding the full
    model. Every member reports the same figure, as replicated members do; the
    MFU divides it by the devices the job ran on. None (and a log line) where
    the loss function cannot run on meta tensors (it reads a value, ``.item()``)."""
    from torch.utils._pytree import tree_map

    from elastrain.observe.efficiency import device_info
    from elastrain.observe.flops import measure_step_flops

    model = copy.deepcopy(template)
    on_meta = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch)
    try:
        fc = measure_step_flops(model, loss_fn, on_meta, micro_batch, global_batch)
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        log.warning("FLOPs not counted: the loss does not run on the meta device (%s)", e)
        return None
    return {
        "flops_per_step": fc.flops_per_step,
        "flops_per_microbatch": fc.flops_per_microbatch,
        "flops_per_sample": fc.flops_per_sample,
        "tokens_per_sample": fc.tokens_per_sample,
        "seconds": fc.seconds,
        "method": f"{fc.method}, on the meta device",
        **device_info(model),
    }

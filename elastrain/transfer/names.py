"""A model's state names: what every member calls each tensor, compiled or not.

``torch.compile(model)`` returns an ``OptimizedModule`` that holds the model as
its child ``_orig_mod``, so its ``state_dict()`` and ``named_parameters()`` say
``_orig_mod.0.weight`` where the model itself says ``0.weight`` (a compiled
submodule put back into its parent gives ``blocks.0._orig_mod.weight``).
``Module.compile()`` compiles in place and renames nothing. Elastrain names the
tensors without the wrapper's segments everywhere a name leaves the process
(the model signature, heal manifests, checkpoints, the state hash), so a
compiled and an uncompiled member agree, a replacement heals into a compiled
model, and a checkpoint written by one resumes into the other. Pure, local.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

COMPILE_WRAPPER = "_orig_mod"
"""The attribute (and name segment) under which torch.compile's wrapper holds the module."""


def state_name(key: str) -> str:
    """``key`` (a state_dict or parameter name) without torch.compile's wrapper segments."""
    return ".".join(part for part in key.split(".") if part != COMPILE_WRAPPER)


def _renamed(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        name = state_name(key)
        if name in out:
            raise ValueError(
                f"two tensors of the model are both named {name!r} once torch.compile's "
                f"{COMPILE_WRAPPER!r} segments are dropped (one is {key!r}): rename the submodule"
            )
        out[name] = value
    return out


def model_state(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` in its order, keyed by `state_name` (values as torch
    gives them: live tensors, or whatever ``get_extra_state`` returns)."""
    return _renamed(model.state_dict().items())


def named_parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.named_parameters()`` in its order, keyed by `state_name`."""
    return _renamed(model.named_parameters())

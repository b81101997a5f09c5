"""The JAX backend of the step engine: a jitted value-and-grad and a jitted optax update.

The state that moves between members (heal, checkpoints) is one pytree,
``{"params", "opt_state", "key"}`` (`elastrain.jax.state`). A step's gradients
(of the loss *sums*) are added into one fresh, writable numpy buffer, float64
by default (reduce_dtype: exact sums, so the rounded result does not depend on
who computed what), with the engine's extra slots at its end; the all-reduce
sums it in place as a torch tensor sharing its memory. Micro-batch `i` of step
`s` gets the PRNG key ``fold_in(fold_in(key, s), i)``, so neither the data nor
the randomness depends on membership.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch

from elastrain.jax.state import (
    GradLayout,
    JaxState,
    LossFn,
    Tree,
    is_typed_key,
    key_data,
    make_apply_fn,
    make_grad_fn,
    signature,
)
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.device import resolve_reduce_dtype
from elastrain.transfer import NamedState, state_digest


def _platform(tree: Any) -> str:
    """The platform ("cpu", "gpu", "tpu") of the first array of ``tree``, else JAX's default."""
    for leaf in jax.tree_util.tree_leaves(tree):
        devices = getattr(leaf, "devices", None)
        if callable(devices):
            return str(next(iter(devices())).platform)
    return str(jax.default_backend())


class JaxBackend:
    """`Backend` for a params pytree and an optax optimizer on this process.

    Who calls: the engine's training thread; the state-hash thread reads the
    (immutable) arrays of the state it was handed.
    """

    framework = "jax"
    device = torch.device("cpu")
    """The torch device of the step's wire buffers (CPU tensors, reduced over gloo):
    jax places and checks its own arrays, so the engine has no device to check and
    the gradient's transport is gloo."""

    def __init__(
        self,
        params: Tree,
        optimizer: Any,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        key: Any,
    ) -> None:
        self.params: Tree = jax.tree_util.tree_map(jax.numpy.asarray, params)
        self.optimizer = optimizer
        self.opt_state: Tree = optimizer.init(self.params)
        self._typed_key = key is not None and is_typed_key(key)
        self._key_impl = jax.random.key_impl(key) if self._typed_key else None
        self.key: jax.Array = key_data(jax.random.PRNGKey(config.seed) if key is None else key)
        self._layout = GradLayout.of(self.params)
        self._grad = make_grad_fn(loss_fn, self._layout, config.micro_batch_size)
        self._apply = make_apply_fn(optimizer, self._layout, config.global_batch_size)
        self._wide = resolve_reduce_dtype(config.reduce_dtype, _platform(self.params)) == "float64"
        self._extra_slots = 0
        self._buf: np.ndarray[Any, Any] | None = None
        self._wire: torch.Tensor | None = None

    # ---- state -------------------------------------------------------------------

    def state_tree(self) -> Tree:
        """Everything a member holds that must be identical across members."""
        return {"params": self.params, "opt_state": self.opt_state, "key": self.key}

    def signature(self) -> list[list[Any]]:
        return signature(self.params)

    def state(self) -> JaxState:
        return JaxState(self.state_tree())

    def adopt(self, state: NamedState) -> None:
        """Take params, opt_state and key from the tree a heal or resume rebuilt."""
        assert isinstance(state, JaxState)
        tree = state.healed
        if tree is not None:
            self.params, self.opt_state, self.key = tree["params"], tree["opt_state"], tree["key"]

    def state_hash(self) -> str:
        return state_digest(self.state())

    def meta(self) -> dict[str, Any]:
        return {}  # the PRNG key is part of the state tree

    def load_meta(self, meta: dict[str, Any]) -> None:
        pass

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> None:
        return None  # not measured for JAX yet (docs/guide/jax.md)

    def step_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key micro-batch `microbatch` of step `step` gets (membership-free)."""
        base = (
            jax.random.wrap_key_data(self.key, impl=self._key_impl) if self._typed_key else self.key
        )
        return jax.random.fold_in(jax.random.fold_in(base, step), microbatch)

    def problems(self) -> list[str]:
        return []

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Compile the gradient and update functions before registering, so that a
        replacement's compile time does not stall its peers' first step with it."""
        _, flat = self._grad(self.params, batch, self.step_key(0, 0))
        jax.block_until_ready(self._apply(self.params, self.opt_state, flat))

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, extra_slots: int) -> None:
        # A fresh buffer every step: an abandoned all-reduce may still write into
        # the old one. JAX hands numpy read-only views, so sum into our own array.
        self._extra_slots = extra_slots
        self._buf = np.zeros(
            self._layout.numel + extra_slots, dtype=np.float64 if self._wide else np.float32
        )
        self._wire = torch.from_numpy(self._buf)  # shares the memory: summed in place

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        assert self._buf is not None
        loss, flat = self._grad(self.params, batch, self.step_key(step, microbatch))
        self._buf[: self._layout.numel] += np.asarray(flat)
        return float(loss) * samples

    def reduce_buffers(self) -> list[torch.Tensor]:
        assert self._wire is not None
        return [self._wire]

    def extras(self) -> torch.Tensor:
        assert self._wire is not None
        return self._wire[-self._extra_slots :]

    def apply(self) -> None:
        assert self._buf is not None
        grad = self._buf[: self._layout.numel]
        summed = jax.numpy.asarray(grad.astype(np.float32) if self._wide else grad)
        params, opt_state = self._apply(self.params, self.opt_state, summed)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state

    def discard(self) -> None:
        self._buf, self._wire = None, None

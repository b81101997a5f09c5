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

from elastrain.jax.backend_base import JaxBackendBase
from elastrain.jax.state import LossFn, Tree, make_grad_fn, signature
from elastrain.runtime.config import TrainerConfig


class JaxBackend(JaxBackendBase):
    """`Backend` for a params pytree and an optax optimizer on this process (the
    state and the step's buffer: `JaxBackendBase`).

    Who calls: the engine's training thread; the state-hash thread reads the
    (immutable) arrays of the state it was handed.
    """

    def __init__(
        self,
        params: Tree,
        optimizer: Any,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        key: Any,
    ) -> None:
        self.params = jax.tree_util.tree_map(jax.numpy.asarray, params)
        self._hold(optimizer, config, key)
        self._grad = make_grad_fn(loss_fn, self._layout, config.micro_batch_size)

    def signature(self) -> list[list[Any]]:
        return signature(self.params)

    def step_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key micro-batch `microbatch` of step `step` gets (membership-free)."""
        return self.folded_key(step, microbatch)

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Compile the gradient and update functions before registering, so that a
        replacement's compile time does not stall its peers' first step with it."""
        _, flat = self._grad(self.params, batch, self.step_key(0, 0))
        jax.block_until_ready(self._apply(self.params, self.opt_state, flat, np.float32(1.0)))

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        assert self._buf is not None
        loss, flat = self._grad(self.params, batch, self.step_key(step, microbatch))
        self._buf[: self._layout.numel] += np.asarray(flat)
        return float(loss) * samples

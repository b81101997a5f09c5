"""What every JAX backend shares: the state tree it holds and the step's wire buffer.

`JaxBackend` (one process, the whole model) and `JaxReplicaBackend` (one process
of a K-process replica, its part of each leaf) hold the same kind of state,
``{"params", "opt_state", "key"}`` (`elastrain.jax.state`), and sum a step's
gradients the same way: into one fresh numpy buffer, float64 by default
(reduce_dtype: exact sums, so the rounded result does not depend on who
computed what), with the engine's extra slots at its end, all-reduced in place
as a torch tensor sharing its memory; `apply` runs the jitted optax update on
the summed gradient. Each subclass builds its own gradient function and says
what its state is (the whole model, or this process's part); this class owns
everything after that. Who calls: the engine's training thread; the state-hash
thread reads the (immutable) arrays of the state it was handed.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import torch

from elastrain.jax.state import (
    GradLayout,
    JaxState,
    Tree,
    clip_scale,
    is_typed_key,
    key_data,
    make_apply_fn,
)
from elastrain.runtime.backend import Update
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.device import resolve_reduce_dtype
from elastrain.transfer import NamedState, state_digest


def platform_of(tree: Any) -> str:
    """The platform ("cpu", "gpu", "tpu") of the first array of ``tree``, else JAX's default."""
    for leaf in jax.tree_util.tree_leaves(tree):
        devices = getattr(leaf, "devices", None)
        if callable(devices):
            return str(next(iter(devices())).platform)
    return str(jax.default_backend())


SQ_BLOCK = 1 << 16
"""Elements per block of `sq_sum`: its order is fixed by the length alone."""


def sq_sum(g: np.ndarray[Any, Any]) -> float:
    """The sum of squares of ``g`` in float64, block by block in a fixed order (numpy's
    own reduction inside a block; no BLAS, whose threads could change the bits), so
    every process computing it from the same bytes gets the same bits."""
    total = 0.0
    for i in range(0, g.size, SQ_BLOCK):
        part = g[i : i + SQ_BLOCK].astype(np.float64)
        total += float(np.square(part).sum())
    return total


class JaxBackendBase:
    """The state and step buffer half of a JAX `Backend` (module docstring).

    A subclass sets ``params`` (its leaves as device arrays) and calls
    `_hold` before anything else runs."""

    framework = "jax"
    device = torch.device("cpu")
    """The torch device of the step's wire buffers (CPU tensors, reduced over gloo):
    jax places and checks its own arrays, so the engine has no device to check and
    the gradient's transport is gloo."""

    params: Tree
    norm_slots = 0
    """Slots between the gradient and the engine's extras (`JaxReplicaBackend`: the
    squared norm of the replica's parts, summed with the vote)."""

    def _hold(self, optimizer: Any, config: TrainerConfig, key: Any) -> None:
        """Build the optimizer state, the key, the gradient layout and the update
        over ``self.params`` (this process's leaves)."""
        self.optimizer = optimizer
        self.params = self._placed(self.params)
        self.opt_state: Tree = self._placed(optimizer.init(self.params))
        self._typed_key = key is not None and is_typed_key(key)
        self._key_impl = jax.random.key_impl(key) if self._typed_key else None
        self.key: jax.Array = self._placed(
            key_data(jax.random.PRNGKey(config.seed) if key is None else key)
        )
        self._layout = GradLayout.of(self.params)
        self._apply = make_apply_fn(optimizer, self._layout, config.global_batch_size)
        self._wide = (
            resolve_reduce_dtype(config.reduce_dtype, platform_of(self.params)) == "float64"
        )
        self._max_norm = config.max_grad_norm
        self._global_batch = config.global_batch_size
        self._extra_slots = 0
        self._buf: np.ndarray[Any, Any] | None = None
        self._wire: torch.Tensor | None = None

    def _placed(self, tree: Tree) -> Tree:
        """``tree`` as this backend keeps its state between steps (identity here:
        a single-process job's arrays stay where JAX or the script put them). A
        subclass whose update's outputs land elsewhere than its inputs came from
        overrides it, so that the jitted functions compiled in `warm_up` see the
        same argument placement at every step, after a heal or a resume too: jit
        compiles again for every new combination of committed devices and weak
        types, and a rebuilt worker's compile inside its first step stalls its
        peers (issue 44)."""
        return tree

    # ---- state -------------------------------------------------------------------

    def state_tree(self) -> Tree:
        """What this process holds that must be identical to its peers' (its twins')."""
        return {"params": self.params, "opt_state": self.opt_state, "key": self.key}

    def state(self) -> JaxState:
        return JaxState(self.state_tree())

    def adopt(self, state: NamedState) -> None:
        """Take params, opt_state and key from the tree a heal or resume rebuilt."""
        assert isinstance(state, JaxState)
        tree = state.healed
        if tree is not None:
            tree = self._placed(tree)  # as warm_up compiled for (`_placed`)
            self.params, self.opt_state, self.key = tree["params"], tree["opt_state"], tree["key"]

    def state_hash(self) -> str:
        return state_digest(self.state())

    def meta(self) -> dict[str, Any]:
        return {}  # the PRNG key is part of the state tree

    def load_meta(self, meta: dict[str, Any]) -> None:
        pass

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> None:
        return None  # not measured for JAX yet (docs/guide/jax.md)

    def problems(self) -> list[str]:
        return []

    def folded_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key micro-batch `microbatch` of step `step` gets (membership-free):
        ``fold_in(fold_in(key, step), microbatch)``."""
        base = (
            jax.random.wrap_key_data(self.key, impl=self._key_impl) if self._typed_key else self.key
        )
        return jax.random.fold_in(jax.random.fold_in(base, step), microbatch)

    # ---- one step ------------------------------------------------------------------

    def begin_step(self, extra_slots: int) -> None:
        # A fresh buffer every step: an abandoned all-reduce may still write into
        # the old one. JAX hands numpy read-only views, so sum into our own array.
        self._extra_slots = extra_slots
        self._buf = np.zeros(
            self._layout.numel + self.norm_slots + extra_slots,
            dtype=np.float64 if self._wide else np.float32,
        )
        self._wire = torch.from_numpy(self._buf)  # shares the memory: summed in place

    def reduce_buffers(self) -> list[torch.Tensor]:
        assert self._wire is not None
        return [self._wire]

    def extras(self) -> torch.Tensor:
        assert self._wire is not None
        return self._wire[-self._extra_slots :]

    def apply(self) -> Update:
        """The optax update of this process's leaves by the summed gradient (local),
        clipped to ``max_grad_norm`` by the global norm of the whole model's mean
        gradient (`grad_sq_sum`), which every process computes alike."""
        assert self._buf is not None
        grad = self._buf[: self._layout.numel]
        norm = math.sqrt(self.grad_sq_sum()) / self._global_batch
        scale = np.float32(clip_scale(norm, self._max_norm))
        params, opt_state = self._apply(self.params, self.opt_state, self._on_device(grad), scale)
        jax.block_until_ready((params, opt_state))
        self.params, self.opt_state = params, opt_state
        return Update(grad_norm=norm)

    def grad_sq_sum(self) -> float:
        """The squared L2 norm of the whole model's summed gradient, in float64 (here:
        this process holds the whole model, so its buffer)."""
        assert self._buf is not None
        g = self._buf[: self._layout.numel]
        return sq_sum(g)

    def _on_device(self, grad: np.ndarray[Any, Any]) -> jax.Array:
        """The summed gradient as the update's float32 input (the one path `warm_up`
        compiles the update with, too)."""
        flat = grad.astype(np.float32) if grad.dtype != np.float32 else grad
        return jax.device_put(flat)  # no staging compile (jnp.asarray has one per shape)

    def discard(self) -> None:
        self._buf, self._wire = None, None

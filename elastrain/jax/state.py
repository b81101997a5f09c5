"""A JAX training state as named host arrays: signature, hash, gradient packing.

The state that moves between members is one pytree, ``{"params": ...,
"opt_state": ..., "key": ...}``, flattened in JAX's canonical leaf order and
named by each leaf's key path (``jax.tree_util.keystr``), e.g.
``['params']['w1']`` or ``['opt_state'][0].mu['w1']``. Every member that built
the same params and the same optax optimizer gets the same names, shapes and
dtypes in the same order, which is what the coordinator's model signature, the
heal manifest and the state hash rely on.

Everything here is local (no communication) and never pickles: leaves are
read as raw bytes (``np.asarray`` of a CPU array is a zero-copy, read-only
view) and rebuilt from raw bytes plus the local leaf's dtype and shape.
`JaxState` is the tree as a `NamedState`, which the one heal protocol
(`elastrain.transfer.heal`) moves.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from elastrain.transfer.dtypes import byte_view, dtype_from_name
from elastrain.transfer.errors import HealError
from elastrain.transfer.manifest import Entry, Manifest, lay_out
from elastrain.transfer.state import FlatState, manifest_limit

Tree = Any
"""A JAX pytree (dicts, lists, tuples, NamedTuples of arrays)."""

NamedLeaves = list[tuple[str, np.ndarray]]


def is_typed_key(key: Any) -> bool:
    """True for a new-style typed PRNG key (``jax.random.key``), False for raw uint32 data."""
    return bool(jnp.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key))


def key_data(key: Any) -> jax.Array:
    """The raw uint32 data of a PRNG key (typed or legacy ``PRNGKey``)."""
    return jax.random.key_data(key) if is_typed_key(key) else jnp.asarray(key)


def named_leaves(tree: Tree) -> NamedLeaves:
    """``[(key path, host array), ...]`` in JAX's canonical order.

    The arrays are zero-copy views of the live leaves where JAX allows it
    (CPU), so they are read-only: copy before writing into one.
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return [(jax.tree_util.keystr(path), np.asarray(leaf)) for path, leaf in flat]


def signature(tree: Tree) -> list[list[Any]]:
    """``[[name, shape, dtype], ...]``: what the coordinator compares across members."""
    return [[n, [int(d) for d in a.shape], str(a.dtype)] for n, a in named_leaves(tree)]


def state_hash(leaves: NamedLeaves, committed: int) -> str:
    """SHA-256 of a flattened state: names, dtypes, shapes, raw bytes and the step count.

    Two members with bit-identical params, optimizer state and key at the same
    step get the same digest. Local, read-only.
    """
    header = {
        "committed": committed,
        "leaves": [[n, str(a.dtype), list(a.shape)] for n, a in leaves],
    }
    h = hashlib.sha256()
    h.update(json.dumps(header, sort_keys=True, separators=(",", ":")).encode())
    for _, a in leaves:
        if a.size:
            h.update(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def rebuild(tree: Tree, arrays: Sequence[np.ndarray]) -> Tree:
    """A tree with `tree`'s structure whose leaves are `arrays` (same order), as
    device arrays with each local leaf's dtype and shape. Raises ValueError if
    the count, a shape or a dtype differs."""
    old, treedef = jax.tree_util.tree_flatten(tree)
    if len(old) != len(arrays):
        raise ValueError(f"state has {len(old)} leaves, got {len(arrays)}")
    new = []
    for i, (o, a) in enumerate(zip(old, arrays, strict=True)):
        o_shape, o_dtype = np.shape(o), jnp.asarray(o).dtype
        if tuple(a.shape) != tuple(o_shape) or a.dtype != o_dtype:
            raise ValueError(
                f"leaf {i}: got {a.dtype}{list(a.shape)}, expected {o_dtype}{list(o_shape)}"
            )
        # device_put, not jnp.array: that one compiles a staging function per new
        # shape (0.3-0.5 s each on a busy CPU), inside a heal the peers wait for.
        new.append(jax.device_put(np.array(a, copy=True)))
    return jax.tree_util.tree_unflatten(treedef, new)


def _as_tensor(leaf: Any) -> torch.Tensor:
    """A CPU tensor with ``leaf``'s bytes, dtype and shape, for sending.

    A JAX array on the host is shared through DLPack, without a copy (JAX
    arrays are immutable and the capsule keeps the buffer alive; bfloat16 and
    uint32 keys included). Anything else is copied through numpy: its host
    views are read-only, and torch must not alias a buffer it may not write.
    """
    if isinstance(leaf, jax.Array):
        try:
            return torch.from_dlpack(leaf)
        except (BufferError, RuntimeError, TypeError, ValueError):
            pass  # e.g. not on the host: fall back to a copy
    a = np.array(leaf, order="C")
    raw = torch.from_numpy(a.reshape(-1).view(np.uint8))
    return raw.view(dtype_from_name(f"torch.{a.dtype}")).reshape(a.shape)


class JaxState:
    """A JAX state tree as a `NamedState`: one entry per leaf, named by key path.

    A receiver knows every leaf exactly (its own tree was built from the same
    params and optimizer), so it accepts exactly its own layout: `bound`
    refuses a payload or entry count larger than its own, `check` anything
    else that differs. `install` rebuilds the tree from the received bytes as
    fresh device arrays and stores it in `healed`, where the trainer takes
    params, opt_state and key from; the tree it was built on stays untouched.
    The section is ``{}``.
    """

    kind = "jax"

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.healed: Tree | None = None
        self._leaves = named_leaves(tree)

    def steady(self) -> contextlib.AbstractContextManager[None]:
        # Its structure (the named leaves) is read once, at construction.
        return contextlib.nullcontext()

    def flatten(self) -> FlatState:
        flat, _ = jax.tree_util.tree_flatten_with_path(self.tree)
        tensors = [(jax.tree_util.keystr(p), _as_tensor(x)) for p, x in flat]
        # JAX arrays are immutable (a step makes new ones): nothing writes these bytes.
        return FlatState(tensors, {}, frozenset(n for n, _ in tensors))

    def manifest_limit(self) -> int:
        return manifest_limit(len(self._leaves))

    def landing_estimate(self) -> list[tuple[str, int]]:
        # Exact: every leaf (the optimizer's state included) exists from the start.
        return [(name, int(a.nbytes)) for name, a in self._leaves]

    def _layout(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """``(name, dtype name, shape)`` of each leaf: what `check` demands of a manifest."""
        return [
            (name, f"torch.{a.dtype}", tuple(int(d) for d in a.shape)) for name, a in self._leaves
        ]

    def expected_layout(self) -> tuple[Entry, ...] | None:
        """Its own leaves (exact: they all exist from the start, as `check` demands);
        None for a leaf whose dtype torch does not name."""
        try:
            return lay_out(self._layout())
        except KeyError:
            return None

    def bound(self, m: Manifest) -> str | None:
        total = sum(int(a.nbytes) for _, a in self._leaves)
        if m.total_bytes > total or len(m.entries) > len(self._leaves):
            return (
                f"manifest claims {len(m.entries)} leaves of {m.total_bytes} bytes; this state "
                f"has {len(self._leaves)} leaves of {total} bytes"
            )
        return self.bound_section(m)

    def bound_section(self, m: Manifest) -> str | None:
        return None if m.section == {} else "a JAX state manifest carries an empty section"

    def check_section(self, m: Manifest) -> str | None:
        return None  # the section is empty (`bound_section`): nothing of it to fit

    def check(self, m: Manifest) -> str | None:
        if len(m.entries) != len(self._leaves):
            return f"manifest has {len(m.entries)} leaves, the local state {len(self._leaves)}"
        for e, (name, dtype, shape) in zip(m.entries, self._layout(), strict=True):
            want = [name, list(shape), dtype]
            got = [e.name, list(e.shape), e.dtype]
            if got != want:
                return f"cannot heal into this state: leaf {got} where the local state has {want}"
        return None

    def live_targets(self, m: Manifest) -> dict[str, torch.Tensor]:
        """None: JAX arrays are immutable, every leaf lands fresh and is rebuilt."""
        return {}

    def install(self, tensors: dict[str, torch.Tensor], section: dict[str, Any]) -> None:
        arrays = [
            byte_view(tensors[name]).numpy().view(a.dtype).reshape(a.shape)
            for name, a in self._leaves
        ]
        try:
            self.healed = rebuild(self.tree, arrays)
        except ValueError as e:
            raise HealError(f"cannot rebuild the JAX state from the healed leaves: {e}") from e


@dataclass(frozen=True)
class GradLayout:
    """Where each parameter's gradient lives in the flat float32 all-reduce buffer.

    The buffer is ``[grad leaf 0, grad leaf 1, ..., extra slots]``, every leaf
    cast to float32 and raveled, in the params tree's leaf order.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[Any, ...]
    sizes: tuple[int, ...]
    treedef: Any

    @classmethod
    def of(cls, params: Tree) -> GradLayout:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        arrs = [jnp.asarray(x) for x in leaves]
        return cls(
            tuple(tuple(int(d) for d in a.shape) for a in arrs),
            tuple(a.dtype for a in arrs),
            tuple(int(a.size) for a in arrs),
            treedef,
        )

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    def ravel(self, grads: Tree) -> jax.Array:
        """Traceable: the gradient pytree as one float32 vector."""
        leaves = jax.tree_util.tree_leaves(grads)
        return jnp.concatenate([jnp.ravel(g).astype(jnp.float32) for g in leaves])

    def unravel(self, flat: jax.Array) -> Tree:
        """Traceable: the inverse of `ravel` (each leaf cast back to its dtype)."""
        out, off = [], 0
        for shape, dtype, size in zip(self.shapes, self.dtypes, self.sizes, strict=True):
            out.append(flat[off : off + size].reshape(shape).astype(dtype))
            off += size
        return jax.tree_util.tree_unflatten(self.treedef, out)


LossFn = Callable[[Tree, Any, jax.Array], jax.Array]
"""``loss_fn(params, batch, key) -> scalar``: the mean loss over one micro-batch."""


def make_grad_fn(
    loss_fn: LossFn, layout: GradLayout, micro_batch: int
) -> Callable[[Tree, Any, jax.Array], tuple[jax.Array, jax.Array]]:
    """Jitted ``(params, batch, key) -> (mean loss, flat float32 gradient x micro_batch)``:
    the gradient of the micro-batch's loss *sum*, ready to be summed over the step."""

    def f(params: Tree, batch: Any, key: jax.Array) -> tuple[jax.Array, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, key)
        return loss, layout.ravel(grads) * micro_batch

    return jax.jit(f)


def make_apply_fn(
    optimizer: Any, layout: GradLayout, global_batch: int
) -> Callable[[Tree, Tree, jax.Array, Any], tuple[Tree, Tree]]:
    """Jitted ``(params, opt_state, summed flat gradient, clip scale) -> (params,
    opt_state)``: divide by the global batch, scale (`clip_scale`: 1 unless the
    mean gradient's global norm exceeds the limit; times 1 changes no bit),
    unflatten, one optax update."""
    import optax

    def f(params: Tree, opt_state: Tree, flat: jax.Array, scale: jax.Array) -> tuple[Tree, Tree]:
        grads = layout.unravel(flat / global_batch * scale)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(f)


CLIP_EPS = 1e-6
"""torch's `clip_grad_norm_` rule: scale by min(1, max_norm / (norm + 1e-6))."""


def clip_scale(norm: float, max_norm: float | None) -> float:
    """The factor the mean gradient is multiplied by before the optimizer (pure):
    ``min(1, max_norm / (norm + 1e-6))``, the PyTorch path's rule; 1 without a
    limit or where the norm is not finite (the update then sees the inf or nan,
    as it would unclipped)."""
    if max_norm is None or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + CLIP_EPS))


def stack_collate(samples: list[Any]) -> Any:
    """Default collate: stack each field of the samples (pytrees of arrays) with numpy."""
    return jax.tree_util.tree_map(lambda *xs: np.stack(xs), *samples)

"""The backend of one process of a K-process JAX replica (`--replica-procs K`).

This process's state is its part of every leaf (`elastrain.jax.replica`: its
rows of a sharded leaf, all of a replicated one), the optimizer state of that
part and the PRNG key: `JaxState` over that tree, so heal, the state hash and
checkpoints move this process's part only, and twins (the same process id in
another replica) hold bit-identical bytes.

A step's work, in rounds: in each round every process of the replica brings
one micro-batch (or a zero-weight one), the K micro-batches form one global
batch sharded over the mesh's ``fsdp`` axis, and one jitted, vmapped
value-and-grad over the sharded parameters gives each micro-batch's float32
gradient (of its loss *sum*) of this process's rows, computed jointly by the
replica's JAX runtime (its collectives run inside). Each micro-batch's part is
added into this process's float64 buffer on its own (`reduce_dtype`), so the
sum does not depend on which round or replica computed a micro-batch; the
twins then all-reduce the buffer over gloo. `apply` runs the optax update on
this process's part alone, with no collective: the optimizer must work leaf by
leaf, element by element (sgd, adam, adamw...); `optax.clip_by_global_norm` and
other transformations that read the whole model would see one part only. The
global norm is the trainer's instead (``max_grad_norm``): each part's squared
norm of the reduced gradient rides the commit vote (`put_norm_share`), so every
process clips by the whole model's norm, the same one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from elastrain.jax.backend_base import JaxBackendBase, sq_sum
from elastrain.jax.replica import AXIS, default_spec, local_rows
from elastrain.jax.state import LossFn, Tree, key_data
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.replica_place import ReplicaPlace


def _specs(params: Tree, specs: Tree | None, procs: int) -> list[tuple[str | None, ...]]:
    """One partition per leaf: the script's (a pytree of `PartitionSpec` or tuples
    matching `params`) or `default_spec`."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    if specs is None:
        return [default_spec(np.shape(x), procs) for x in leaves]
    # A PartitionSpec is a tuple: each one (or plain tuple) is a leaf of `specs`.
    given, spec_def = jax.tree_util.tree_flatten(specs, is_leaf=lambda x: isinstance(x, tuple))
    if len(given) != len(leaves):
        raise ValueError(
            f"specs= has {len(given)} partitions for {len(leaves)} parameter leaves: give one "
            "PartitionSpec per leaf, in a tree of the params' structure"
        )
    return [tuple(s) for s in given]


class JaxReplicaBackend(JaxBackendBase):
    """`Backend` of one process of a multi-process JAX replica (module docstring;
    the state and the step's buffer: `JaxBackendBase`).

    Contract: the K processes of a replica build it with the same full params
    (same init), specs, optimizer and config after `init_distributed`, and call
    `warm_up` and every `compute` of a step together, in the same rounds (the
    topology's turns); `apply` is local. Who calls: the engine's training thread.
    """

    def __init__(
        self,
        params: Tree,
        optimizer: Any,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        key: Any,
        place: ReplicaPlace,
        specs: Tree | None = None,
    ) -> None:
        self.place = place
        procs, proc = place.procs, place.proc
        self.mesh = Mesh(np.array(jax.devices()), (AXIS,))
        leaves, self._treedef = jax.tree_util.tree_flatten(params)
        full = [np.asarray(x) for x in leaves]
        self._specs = _specs(params, specs, procs)
        self._shapes = [tuple(int(d) for d in a.shape) for a in full]
        self._full_signature = [
            [jax.tree_util.keystr(p), list(s), str(a.dtype)]
            for (p, _), s, a in zip(
                jax.tree_util.tree_flatten_with_path(params)[0], self._shapes, full, strict=True
            )
        ]
        self._shardings = [NamedSharding(self.mesh, PartitionSpec(*s)) for s in self._specs]
        device = jax.local_devices()[0]
        local = [
            jax.device_put(np.ascontiguousarray(a[local_rows(a.shape, s, procs, proc)]), device)
            for a, s in zip(full, self._specs, strict=True)
        ]
        self.params = jax.tree_util.tree_unflatten(self._treedef, local)
        self._hold(optimizer, config, key)
        self._whole: Tree = {
            "params": jax.eval_shape(lambda: params),
            "opt_state": jax.eval_shape(optimizer.init, params),
            "key": jax.eval_shape(lambda: self.key),
        }
        self._grad = self._make_grad(loss_fn, config.micro_batch_size)
        self._rows = NamedSharding(self.mesh, PartitionSpec(AXIS))

    def _make_grad(self, loss_fn: LossFn, micro_batch: int) -> Any:
        """Jitted ``(params, batches, keys, weights) -> (losses, grads)`` over the
        replica's mesh: one micro-batch per process (leading axis, sharded over
        ``fsdp``), each micro-batch's gradient of its loss sum kept apart (leading
        axis, replicated) and laid out as its parameter (sharded rows)."""
        typed, impl = self._typed_key, self._key_impl

        def one(params: Tree, batch: Any, raw: jax.Array) -> tuple[jax.Array, Tree]:
            k = jax.random.wrap_key_data(raw, impl=impl) if typed else raw
            return jax.value_and_grad(loss_fn)(params, batch, k)

        def f(params: Tree, batches: Any, keys: jax.Array, weights: jax.Array) -> Any:
            losses, grads = jax.vmap(one, in_axes=(None, 0, 0))(params, batches, keys)
            scale = weights * micro_batch

            def weigh(g: jax.Array) -> jax.Array:
                return g * scale.reshape((-1,) + (1,) * (g.ndim - 1)).astype(g.dtype)

            return losses, jax.tree_util.tree_map(weigh, grads)

        per_mb = [NamedSharding(self.mesh, PartitionSpec(None, *s)) for s in self._specs]
        out = (
            NamedSharding(self.mesh, PartitionSpec()),
            jax.tree_util.tree_unflatten(self._treedef, per_mb),
        )
        return jax.jit(f, out_shardings=out)

    def _placed(self, tree: Tree) -> Tree:
        """Every leaf committed to this process's one device, none weak-typed: what
        the update's outputs are (its inputs, the params, are committed), so the
        update compiled in `warm_up` serves every step. Without it, Adam's count
        (uncommitted after ``init``) and a heal's rebuilt leaves (uncommitted)
        made the update compile again in the first step after the warm-up and
        after every heal: a rebuilt replica's first step took seconds more, and
        the other replica's watchdog fired while waiting for it (issue 44)."""
        device = jax.local_devices()[0]

        def place(x: Any) -> jax.Array:
            if getattr(x, "weak_type", False):
                x = np.asarray(x)  # numpy has no weak types (rare: not optax's, not a heal's)
            return jax.device_put(x, device)  # compiles nothing (jnp conversions would)

        return jax.tree_util.tree_map(place, tree)

    # ---- state -------------------------------------------------------------------

    def signature(self) -> list[list[Any]]:
        """The whole model's (the same on every process of the job)."""
        return self._full_signature

    def whole_state(self) -> Tree:
        """The whole replica's state tree as shapes and dtypes (`jax.ShapeDtypeStruct`
        leaves, `state_tree`'s structure): what a checkpoint declares."""
        return self._whole

    def step_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key data of micro-batch `microbatch` of step `step` (membership-free)."""
        return key_data(self.folded_key(step, microbatch))

    def global_params(self) -> Tree:
        """The replica's parameters as global arrays over its mesh (no copy: this
        process's part is its addressable shard). Collective use only."""
        arrays = [
            jax.make_array_from_single_device_arrays(shape, sh, [x])
            for shape, sh, x in zip(
                self._shapes, self._shardings, jax.tree_util.tree_leaves(self.params), strict=True
            )
        ]
        return jax.tree_util.tree_unflatten(self._treedef, arrays)

    def _round(self, step: int, microbatch: int, batch: Any, weight: float) -> Any:
        def rows(x: Any) -> jax.Array:
            return jax.make_array_from_process_local_data(self._rows, np.asarray(x)[None])

        batches = jax.tree_util.tree_map(rows, batch)
        keys = rows(np.asarray(self.step_key(step, max(microbatch, 0))))
        weights = rows(np.array(weight, dtype=np.float32))
        return self._grad(self.global_params(), batches, keys, weights)

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Compile the round (a collective: the replica's processes warm up together)
        and the local update."""
        losses, grads = self._round(0, 0, batch, 0.0)
        jax.block_until_ready((losses, grads))
        zeros = self._on_device(np.zeros(self._layout.numel, dtype=np.float32))
        jax.block_until_ready(self._apply(self.params, self.opt_state, zeros, np.float32(1.0)))

    # ---- one step ------------------------------------------------------------------

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float:
        """One round: this process's micro-batch (weight 0 where `samples` is 0) with
        its replica-mates'; every micro-batch's gradient of this process's rows is
        added on its own; returns this process's micro-batch's loss sum."""
        assert self._buf is not None
        losses, grads = self._round(step, microbatch, batch, 1.0 if samples else 0.0)
        off = 0
        for g, size in zip(jax.tree_util.tree_leaves(grads), self._layout.sizes, strict=True):
            part = np.asarray(g.addressable_shards[0].data).reshape(self.place.procs, size)
            for row in part:  # one micro-batch at a time: the sum's order is fixed
                self._buf[off : off + size] += row
            off += size
        loss = np.asarray(losses.addressable_shards[0].data)[self.place.proc]
        return float(loss) * samples

    norm_slots = 1
    """One slot after the gradient: this process's share of the replica's squared
    gradient norm, summed over the generation with the vote (`put_norm_share`)."""

    def put_norm_share(self, writes: bool) -> None:
        """After the twins' reduction, before the vote: put the squared norm of the
        parts this process counts into the norm slot (0 where `writes` is False).

        Contract: `writes` is True for exactly one holder of each part (its
        lowest-ranked twin), so the vote's sum over the generation is the squared
        norm of the whole model's summed gradient, each part once: a sharded
        leaf's rows by their holder, a replicated leaf by process 0 only. The
        vote's all-reduce hands every process the same sum."""
        assert self._buf is not None
        total = 0.0
        if writes:
            grad, off = self._buf[: self._layout.numel], 0
            for spec, size in zip(self._specs, self._layout.sizes, strict=True):
                if AXIS in spec or self.place.proc == 0:
                    total += sq_sum(grad[off : off + size])
                off += size
        self._buf[self._layout.numel] = total

    def vote_slots(self) -> torch.Tensor:
        """The norm slot and the engine's extras: what the vote all-reduces."""
        assert self._wire is not None
        return self._wire[self._layout.numel :]

    def grad_sq_sum(self) -> float:
        """The whole replica's squared gradient norm, as the vote summed it."""
        assert self._buf is not None
        return float(self._buf[self._layout.numel])

    def gradient(self) -> torch.Tensor:
        """The view of this process's rows' gradient (what its twins all-reduce)."""
        assert self._wire is not None
        return self._wire[: self._layout.numel]

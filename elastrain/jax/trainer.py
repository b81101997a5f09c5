"""JaxElasticTrainer: the elastic step protocol for a jitted JAX/optax training loop.

One per worker process, started by `elastrain run` exactly like the PyTorch
trainer (it reads the same environment):

    trainer = JaxElasticTrainer(params, optax.adam(1e-3), dataset, loss_fn,
                                TrainerConfig(global_batch_size=64, micro_batch_size=8,
                                              total_steps=100))
    for result in trainer.steps():
        ...
    trainer.params  # the trained parameters

`loss_fn(params, batch, key) -> scalar` is the mean loss of one micro-batch;
the backend jits its `value_and_grad`. The protocol is the one step engine
(`elastrain.runtime.engine`) that the PyTorch trainer runs too, over a
`JaxBackend`: the same coordinator, gloo groups, watchdog, heal, durable
checkpoints, whole-job resume, preemption and metering.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from elastrain.jax.backend import JaxBackend
from elastrain.jax.replica import replica_place
from elastrain.jax.replica_backend import JaxReplicaBackend
from elastrain.jax.replica_topology import replica_twins
from elastrain.jax.state import LossFn, Tree, stack_collate
from elastrain.runtime.config import TrainerConfig, worker_setup
from elastrain.runtime.engine import DataSource, MapDataset
from elastrain.runtime.engine_trainer import EngineTrainer
from elastrain.runtime.preflight import format_problem


class JaxElasticTrainer(EngineTrainer):
    """Elastic data-parallel training of one JAX replica per worker process.

    Contract: every worker constructs it with the same initial params (same
    init and seed), the same optax optimizer, dataset and config, then
    iterates `steps()`. Survivors keep their process and state across
    failures; a joiner is healed from its peers. `steps()` yields after each
    committed step and returns when `total_steps` are committed. SIGTERM makes
    the worker leave at the next step boundary (`WorkerExit`, exit EXIT_LEFT).

    With `TrainerConfig.replica_procs` K > 1 (`elastrain run --replica-procs K`)
    this process is one of a replica's K processes: it holds its part of each
    leaf (`specs=`: a `PartitionSpec` per leaf over the replica mesh's ``fsdp``
    axis; default: rows where K divides the first dimension), computes with its
    replica-mates and reduces with its twins (`elastrain.jax.replica_topology`).

    ``config.max_grad_norm`` clips the mean gradient by the whole model's global
    L2 norm (float64, the same on every process; in a multi-process replica over
    all its parts, after the twins' reduction), with the PyTorch path's rule; the
    norm is `StepResult.grad_norm` either way. In a multi-process replica use it
    rather than ``optax.clip_by_global_norm``, which would see one part only.
    """

    def __init__(
        self,
        params: Tree,
        optimizer: Any,
        dataset: DataSource,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        key: Any = None,
        collate_fn: Callable[[list[Any]], Any] = stack_collate,
        coordinator: str | None = None,
        token: str | None = None,
        member_id: str | None = None,
        run_dir: str | None = None,
        specs: Tree | None = None,
    ) -> None:
        where, config = worker_setup(config, coordinator, token, member_id, run_dir)
        if config.shard_size > 1:
            # Checked after the launcher's overrides: `elastrain run --shard-size` sets it too.
            raise ValueError(
                f"shard_size {config.shard_size}: sharded replica groups are built on "
                "PyTorch's FSDP2; a JAX job trains whole replicas (shard_size 1; drop "
                "--shard-size)"
            )
        why = format_problem(config.checkpoint.format, JaxBackend.framework, sharded=False)
        if why is not None:  # after the overrides too: `elastrain run --ckpt-format dcp`
            raise ValueError(why)
        if config.replica_procs > 1:
            # A replica of K processes (--replica-procs): this process holds its part.
            place = replica_place(config.replica_procs)
            multi = JaxReplicaBackend(
                params, optimizer, loss_fn, config, key=key, place=place, specs=specs
            )
            self.attach(
                multi, optimizer, dataset, loss_fn, collate_fn, config, where, replica_twins(multi)
            )
            self.backend: JaxBackend | JaxReplicaBackend = multi
            return
        if specs is not None:
            raise ValueError(
                "specs= partitions a multi-process replica: it needs replica_procs > 1"
            )
        backend = JaxBackend(params, optimizer, loss_fn, config, key=key)
        self.attach(backend, optimizer, dataset, loss_fn, collate_fn, config, where)
        self.backend = backend

    # ---- JAX state -------------------------------------------------------------

    def evaluate_every(self, every: int, eval_fn: Any, dataset: MapDataset, **_: Any) -> None:
        """Not built for JAX yet: raises NotImplementedError (see the message)."""
        raise NotImplementedError(
            "evaluate_every is not available for JAX yet (the evaluation phase is built for the "
            "replicated PyTorch trainer). Evaluate between steps inside `with trainer.pause():` "
            "(every member, after the same step) on `trainer.params`: the step watchdog will not "
            "see it, but a failure during it is not redone"
        )

    @property
    def params(self) -> Tree:
        """The parameters; in a multi-process replica, this process's part of each
        leaf (its rows of a sharded one); `global_params()` gives the global arrays."""
        return self.backend.params

    def global_params(self) -> Tree:
        """The replica's parameters as global arrays over its mesh (a multi-process
        replica; use them in a computation every process of the replica runs)."""
        if not isinstance(self.backend, JaxReplicaBackend):
            return self.backend.params
        return self.backend.global_params()

    @property
    def opt_state(self) -> Tree:
        return self.backend.opt_state

    @property
    def key(self) -> jax.Array:
        return self.backend.key

    def step_key(self, step: int, microbatch: int) -> jax.Array:
        """The PRNG key micro-batch `microbatch` of step `step` gets (membership-free)."""
        return self.backend.step_key(step, microbatch)

    def state_tree(self) -> Tree:
        """Everything a member holds that must be identical across members."""
        return self.backend.state_tree()

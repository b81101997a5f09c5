"""ElasticTrainer: data-parallel PyTorch training that survives dead, hung and leaving peers.

Run one per worker process (`elastrain run` starts them with the coordinator's
address, the job token and a member id in the environment):

    trainer = ElasticTrainer(model, optimizer, dataset, loss_fn,
                             TrainerConfig(global_batch_size=64, micro_batch_size=8, total_steps=100))
    for result in trainer.steps():
        ...

This is the PyTorch face of the step engine (`elastrain.runtime.engine`, the
protocol for every framework) over a `TorchBackend` (the model, its optimizer
and flat gradient buffers). docs/design.md has the protocol and its argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from elastrain.runtime.backend import Backend
from elastrain.runtime.config import TrainerConfig, worker_setup
from elastrain.runtime.engine import EngineTrainer, MapDataset, StepResult
from elastrain.runtime.sharded import ShardedBackend, ShardPolicy, default_shard_policy
from elastrain.runtime.torch_backend import LossFn, TorchBackend

__all__ = ["ElasticTrainer", "LossFn", "MapDataset", "StepResult", "TrainerConfig"]


class ElasticTrainer(EngineTrainer):
    """Elastic data-parallel training of one model replica per worker process.

    Contract: every worker of the job constructs it with the same model
    architecture, optimizer type, dataset and config, then iterates `steps()`.
    Survivors keep their process and state across failures; a joiner is healed
    from its peers. `steps()` yields after each committed step and returns when
    `total_steps` are committed. A SIGTERM makes this worker leave at the next
    step boundary: `steps()` raises `elastrain.WorkerExit` (exit status
    EXIT_LEFT under the worker entry point). With a checkpoint directory (the
    run directory's ``checkpoints/`` by default) it resumes from the
    checkpoint the launcher chose before its first rendezvous, takes the
    periodic checkpoints `TrainerConfig` asks for, and, on a preemption
    notice, one emergency checkpoint before exiting with EXIT_PREEMPTED.

    With `TrainerConfig.shard_size` S > 1 (or `elastrain run --shard-size S`)
    each member holds one shard of the model: the members form replica groups
    of S that run FSDP2 inside (`elastrain.runtime.sharded`); `shard_policy`
    picks the submodules wrapped as their own FSDP2 units (default: every
    element of an `nn.ModuleList`). The loss function then receives the FSDP2
    wrapper, not `model` (whose parameters are freed once the shard is taken),
    and the optimizer that steps is the trainer's (`trainer.optimizer`, same
    class and hyperparameters, over this member's shard).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: MapDataset,
        loss_fn: LossFn,
        config: TrainerConfig,
        *,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        coordinator: str | None = None,
        token: str | None = None,
        member_id: str | None = None,
        run_dir: str | None = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
        load_extra_state: Callable[[dict[str, Any]], None] | None = None,
        shard_policy: ShardPolicy = default_shard_policy,
    ) -> None:
        where, config = worker_setup(config, coordinator, token, member_id, run_dir)
        self._model = model
        backend: Backend
        if config.shard_size > 1:
            backend = ShardedBackend(
                model,
                optimizer,
                loss_fn,
                config,
                shard_policy=shard_policy,
                extra_state=extra_state,
                load_extra_state=load_extra_state,
            )
        else:
            backend = TorchBackend(
                model,
                optimizer,
                loss_fn,
                config,
                extra_state=extra_state,
                load_extra_state=load_extra_state,
            )
        self.attach(backend, optimizer, dataset, loss_fn, collate_fn, config, where)

    @property
    def model(self) -> torch.nn.Module | None:
        """The model: the one given, or, sharded, the current replica group's FSDP2
        wrapper (None while this member is a shadow; the given model's tensors are
        freed once the shard is taken)."""
        if isinstance(self.backend, ShardedBackend):
            return self.backend.model
        return self._model

    @property
    def optimizer(self) -> Any:
        """The optimizer that steps: the one given, or, sharded, the trainer's own
        over this member's shard (same class and hyperparameters; None before the
        first generation)."""
        if isinstance(self.backend, ShardedBackend):
            return self.backend.optimizer
        return self._optimizer

    @optimizer.setter
    def optimizer(self, value: Any) -> None:
        self._optimizer = value

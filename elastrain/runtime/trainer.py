"""ElasticTrainer: data-parallel PyTorch training that survives dead, hung and leaving peers.

Run one per worker process (`elastrain run` starts them with the coordinator's
address, the job token and a member id in the environment):

    trainer = ElasticTrainer(model, optimizer, dataset, loss_fn,
                             TrainerConfig(global_batch_size=64, micro_batch_size=8, total_steps=100,
                                           max_grad_norm=1.0))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    trainer.register("sched", sched)       # heal, checkpoints and the state hash carry it
    trainer.evaluate_every(100, eval_fn, val_set, batch_size=64)   # eval_fn(model, batch) -> sums
    for result in trainer.steps():
        sched.step()                       # after each committed step, as in any loop
        if result.evaluation is not None:  # the model after 100, 200, ... steps, on every member
            print(result.evaluation.step, result.evaluation.means)
    print(trainer.last_evaluation)         # the model after the last step

This is the PyTorch face of the step engine (`elastrain.runtime.engine`, the
protocol for every framework) over a `TorchBackend` (the model, its optimizer
and flat gradient buffers). docs/design/step-protocol.md has the protocol and its argument.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import default_collate

from elastrain.runtime.backend import Backend, SkipReason
from elastrain.runtime.config import TrainerConfig, worker_setup
from elastrain.runtime.engine import DataSource, MapDataset, StepResult
from elastrain.runtime.engine_trainer import EngineTrainer
from elastrain.runtime.evaluate import EvalFn, EvalResult, Evaluation, eval_seed
from elastrain.runtime.meta_init import InitFn
from elastrain.runtime.replicas import Replicated
from elastrain.runtime.shard_groups import sharded_groups
from elastrain.runtime.sharded import ShardedBackend, ShardPolicy, default_shard_policy
from elastrain.runtime.topology import TopologyFactory
from elastrain.runtime.torch_backend import LossFn, TorchBackend
from elastrain.runtime.update import BeforeStep, Decision, StepGrads
from elastrain.transfer.flatten import Stateful

__all__ = [
    "BeforeStep",
    "Decision",
    "ElasticTrainer",
    "EvalFn",
    "EvalResult",
    "LossFn",
    "MapDataset",
    "SkipReason",
    "StepGrads",
    "StepResult",
    "TrainerConfig",
]


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
    class and hyperparameters, over this member's shard). A sharded model may be
    built on the meta device (``with torch.device("meta"): model = GPT(cfg)``):
    a fresh job's members then initialise only their rows, module by module,
    with each module's ``reset_parameters()`` and then ``init_fn(module, name)``
    if given, the RNG seeded by (``config.seed``, module name), so the start is
    the same whatever the layout (`elastrain.runtime.meta_init` has the
    contract); a resume reads its rows from the checkpoint, a replacement
    takes them from its twins.

    The step, on every member alike: the mean gradient (unscaled by
    ``grad_scaler``, a `torch.amp.GradScaler` for fp16 autocast), its global
    norm, clipping to `TrainerConfig.max_grad_norm`, the script's
    ``before_step`` hook, then the optimizer step; a non-finite gradient is
    never applied (the step commits as skipped). Anything stateful the loop
    keeps besides the model and optimizer (an LR scheduler, a counter) must be
    registered (`register`); an LR scheduler over the optimizer that is not
    registered stops the job at start with what to do. Step it after each
    result `steps()` yields: that is the state a heal, a checkpoint and the
    state hash see as "after the step". Unsharded only for now.

    ``model`` may be compiled: ``torch.compile(model)`` passed in, or
    ``model.compile()`` (in place, before or after the trainer is built). Its state
    keeps the uncompiled model's names, so compiled and uncompiled members agree
    and a replacement heals into a compiled model; it is compiled before the
    member joins (`TorchBackend.warm_up`). Sharded, pass ``torch.compile(model)``: each
    replica group's FSDP2 wrapper is compiled with its settings, at the group's
    first step (`elastrain.runtime.sharded`).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: DataSource,
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
        grad_scaler: torch.amp.GradScaler | None = None,
        before_step: BeforeStep | None = None,
        init_fn: InitFn | None = None,
    ) -> None:
        where, config = worker_setup(config, coordinator, token, member_id, run_dir)
        if config.replica_procs > 1:
            raise ValueError(
                f"replica_procs {config.replica_procs}: replicas of several processes are built "
                "for JAX (JaxElasticTrainer); a PyTorch model is sharded over members with "
                "--shard-size"
            )
        self._model = model
        backend: Backend
        topology: TopologyFactory = Replicated
        if config.shard_size > 1:
            sharded = ShardedBackend(
                model,
                optimizer,
                loss_fn,
                config,
                shard_policy=shard_policy,
                extra_state=extra_state,
                load_extra_state=load_extra_state,
                init_fn=init_fn,
                grad_scaler=grad_scaler,
                before_step=before_step,
                # While a step is applied the committed count is its index.
                step_index=lambda: self.engine.committed,
            )
            backend, topology = sharded, sharded_groups(sharded)
        else:
            if init_fn is not None:
                raise ValueError(
                    "init_fn initialises a sharded model built on the meta device "
                    "(TrainerConfig.shard_size > 1); a replicated member holds the whole model: "
                    "materialise it with elastrain.runtime.meta_init.materialize_whole(model, "
                    "seed, init_fn) before building its optimizer"
                )
            backend = TorchBackend(
                model,
                optimizer,
                loss_fn,
                config,
                extra_state=extra_state,
                load_extra_state=load_extra_state,
                grad_scaler=grad_scaler,
                before_step=before_step,
                # While a step is applied the committed count is its index.
                step_index=lambda: self.engine.committed,
            )
        self.attach(backend, optimizer, dataset, loss_fn, collate_fn, config, where, topology)

    def register(self, name: str, obj: Stateful) -> None:
        """Carry ``obj`` (anything with ``state_dict``/``load_state_dict``: an LR
        scheduler, a user's counter) with the model and optimizer.

        Contract: every member registers the same objects under the same names
        before iterating `steps()`; the object's state changes only as a function
        of the committed steps (e.g. ``sched.step()`` after each result). Heal,
        checkpoints and the state hash then carry it: a replacement gets its
        peers' state, so its learning rate equals theirs. Its state dict's
        tensors travel as tensors, everything else as JSON (str keys; no pickle).

        Sharded (`TrainerConfig.shard_size` > 1): the same contract and the same
        carrying (in each member's meta: heal, reshard, checkpoints; and in the
        state hash). An LR scheduler built over the optimizer given to the
        trainer is moved onto the optimizer that steps (`trainer.optimizer`, over
        this member's shard) whenever that one is built, so ``sched.step()`` sets
        the rate the shard is stepped with.
        """
        if self.engine.started:
            raise RuntimeError(
                f"register({name!r}) after steps() began: register every object before the loop"
            )
        if not isinstance(self.backend, TorchBackend | ShardedBackend):
            raise TypeError(f"register: not available with a {type(self.backend).__name__}")
        self.backend.register(name, obj)

    def evaluate_every(
        self,
        every: int,
        eval_fn: EvalFn,
        dataset: MapDataset,
        *,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        """Evaluate the model on ``dataset`` after every ``every`` committed steps and
        after the last one. The evaluation runs once the loop's code for the step
        that reached the count is done (the state a heal or checkpoint sees as
        "after the step"), before the next step; its result comes with the next
        step's result (`StepResult.evaluation`, whose ``step`` equals that
        result's ``step``: the count of steps the model had) and is
        `last_evaluation` (the one after the last step: only there).

        ``eval_fn(model, batch) -> {name: sum over the batch}`` (`EvalFn`) runs under
        ``torch.no_grad()`` with the model in eval mode and the RNG seeded by
        (seed, step, batch). Contract: every member sets up the same evaluation
        before `steps()`. The evaluation is a phase of the step protocol, not code
        between steps: every member of the generation runs it after the same step,
        each on its block of the fixed batches (``batch_size`` samples, the
        dataset's order), and the per-batch sums are reduced exactly (float64,
        `math.fsum`), so the result is the same with any number of members. If a
        member dies or hangs during it, the survivors (and any replacement) evaluate
        again in the next generation; the step watchdog never times it.

        Sharded (`TrainerConfig.shard_size` > 1): ``eval_fn`` gets the replica
        group's FSDP2 wrapper (as the loss function does). The batches are spread
        over the complete replica groups; all members of a group run the same
        batches together (their forward needs each other) and one of them reports
        the sums; a shadow computes nothing. The sums are reduced the same exact
        way, so the result is the same whatever the layout, and equal to the
        replicated job's. The model is left ready for the next step.
        """
        if self.engine.started:
            raise RuntimeError("evaluate_every() after steps() began: set it up before the loop")
        if not callable(eval_fn):
            raise TypeError(f"eval_fn must be callable, got {type(eval_fn).__name__}")
        backend, seed = self.backend, self.config.seed
        given = self._model
        collate = collate_fn or self.collate_fn

        def compute(committed: int, batch_index: int, batch: Any) -> Any:
            # Sharded: the wrapper of the current replica group (kept or rebuilt per generation).
            sharded = backend if isinstance(backend, ShardedBackend) else None
            model = given if sharded is None else sharded.model
            assert model is not None, "a shadow evaluates nothing"
            was = model.training
            model.eval()
            try:
                if sharded is not None:  # its group's collectives may stop midway
                    sharded.group_clean = False
                with torch.no_grad(), torch.random.fork_rng(devices=[]):
                    torch.manual_seed(eval_seed(seed, committed, batch_index))
                    out = eval_fn(model, batch)
                if sharded is not None:
                    sharded.group_clean = True
                return out
            finally:
                model.train(was)

        self.engine.set_evaluation(
            Evaluation(
                every=every,
                batch_size=batch_size,
                size=len(dataset),
                load=lambda r: collate([dataset[i] for i in r]),
                compute=compute,
            )
        )

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

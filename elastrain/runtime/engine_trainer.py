"""What the public trainers share: a face over one `StepEngine`.

`ElasticTrainer` (`elastrain.runtime.trainer`) and `JaxElasticTrainer`
(`elastrain.jax.trainer`) build a backend (and, for a sharded model, its
topology) and hand them to `EngineTrainer.attach`; everything a script calls
on a trainer besides its constructor is here and forwards to the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

from elastrain.runtime.backend import Backend
from elastrain.runtime.config import TrainerConfig, WorkerEnv
from elastrain.runtime.engine import StepEngine, StepResult
from elastrain.runtime.evaluate import EvalResult
from elastrain.runtime.feed import DataSource
from elastrain.runtime.replicas import Replicated
from elastrain.runtime.topology import TopologyFactory


class EngineTrainer:
    """What the public trainers (`ElasticTrainer`, `JaxElasticTrainer`) share: a
    face over one `StepEngine`. Subclasses build the backend and the engine."""

    engine: StepEngine
    backend: Backend

    def attach(
        self,
        backend: Backend,
        optimizer: Any,
        dataset: DataSource,
        loss_fn: Any,
        collate_fn: Callable[[list[Any]], Any],
        config: TrainerConfig,
        where: WorkerEnv,
        topology: TopologyFactory = Replicated,
    ) -> None:
        """Keep the user's objects and build the engine over `backend`, its layout
        chosen once by `topology` (`elastrain.runtime.topology`)."""
        self.backend = backend
        self.optimizer = optimizer
        self.dataset = dataset
        self.loss_fn = loss_fn
        self.collate_fn = collate_fn
        self.engine = StepEngine(backend, dataset, collate_fn, config, where, topology=topology)

    @property
    def config(self) -> TrainerConfig:
        """The config in force (the launcher's --steps, --ckpt-* applied)."""
        return self.engine.config

    @property
    def member(self) -> str:
        return self.engine.member

    @property
    def committed(self) -> int:
        """Steps committed so far (this member's count)."""
        return self.engine.committed

    @property
    def gen(self) -> int:
        return self.engine.gen

    @property
    def members(self) -> list[str]:
        return self.engine.members

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def skipped_steps(self) -> int:
        """Committed steps that did not update the state (non-finite gradient, or the
        `before_step` hook said so); the job's count, carried with the state."""
        return self.engine.skipped_steps

    @property
    def is_leader(self) -> bool:
        """True on rank 0 of the current generation (for logging, not for correctness)."""
        return self.engine.rank == 0

    @property
    def holds_final_state(self) -> bool:
        """True once this member holds the state after the last step (False on a
        joiner that arrived after the job had finished: its model is untrained)."""
        return self.engine.committed >= self.engine.config.total_steps

    @property
    def last_evaluation(self) -> EvalResult | None:
        """The newest evaluation's result (`evaluate_every`), on every member alike:
        also on a member that joined after it (it travels with the state)."""
        return self.engine.eval_result

    def request_leave(self) -> None:
        """Leave the job at the next step boundary (what SIGTERM does)."""
        self.engine.request_leave()

    def log(self, name: str, value: float) -> None:
        """Log a scalar of the script's own (``trainer.log("lr", sched.get_last_lr()[0])``)
        at the step of the last result ``steps()`` yielded (0 before the first).

        Contract: call it on every member, or at least on rank 0: **only rank 0's
        value is reported** (rank 0 of the current generation, at the time of the
        call), so a value that differs between members is rank 0's; the other
        members only check the call, and so does every member before its first
        generation (a call before ``steps()`` reports nothing). Where it goes: a ``user_scalar`` event
        (name, value, step), the live view and ``elastrain report`` (the last value
        per name), the coordinator's ``/metrics`` as
        ``elastrain_user_scalar{name="lr"}`` (the last value per name, sent with
        the next quorum request; at most
        `elastrain.observe.scalars.MAX_METRIC_SCALARS` names, later ones are
        left out of ``/metrics`` only) and, with ``elastrain run --tensorboard
        DIR``, TensorBoard under ``user/<name>``. ``name``: 1-64 characters of
        letters, digits and ``_ . / -`` (ValueError otherwise); ``value``: a finite
        number, or a one-element tensor or array (ValueError or TypeError
        otherwise). Cheap: one event line on rank 0, nothing on the others."""
        self.engine.log(name, value)

    @contextlib.contextmanager
    def pause(self, timeout_s: float | None = None) -> Iterator[None]:
        """Work of the script's own between two steps, which every member does.

        Contract: inside ``for r in trainer.steps():``, every member enters it
        after the same step, deciding from the step alone (``if r.step % 100 ==
        99:``), never from the rank; work only one member should do goes inside
        (``if trainer.is_leader: save_samples()``). On leaving it, each member
        waits for the others (one small all-reduce), so nobody starts the next
        step's all-reduce while a peer is still in its pause, and the step
        watchdog never sees the pause. The wait is bounded by ``timeout_s``, or
        by default by ``hang_timeout_ceiling_s`` (60 s) or, if longer, this
        member's own time in the pause times ``hang_timeout_multiplier`` (pass
        ``timeout_s`` for work that one member does for minutes). A peer that dies or hangs
        meanwhile (the coordinator's lease, or that bound) makes the generation
        regroup at the next step; the code in the pause is not run again. An
        exception inside skips the wait and ends the loop as usual.

            for r in trainer.steps():
                if r.step % 500 == 499:
                    with trainer.pause():
                        if trainer.is_leader:
                            write_samples(trainer.model)
        """
        began = time.monotonic()
        yield
        self.engine.pause_barrier(began, timeout_s)

    def steps(self) -> Iterator[StepResult]:
        """Train until `total_steps` are committed, yielding after each commit.
        Raises `elastrain.WorkerExit` when this worker must end (leave,
        preemption, refusal, no coordinator)."""
        return self.engine.steps()

    def run(self) -> list[StepResult]:
        """`steps()` to completion; returns every result."""
        return list(self.steps())

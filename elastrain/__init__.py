"""elastrain: elastic, fault-tolerant distributed training for PyTorch.

Survivors keep their PIDs and their in-memory state when a peer dies, hangs or
leaves; a replacement joins at a step boundary and heals from its peers over the
network. See DESIGN in the docs for the step protocol and its invariants.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = [
    "Decision",
    "ElasticTrainer",
    "EvalResult",
    "SkipReason",
    "StepGrads",
    "StepResult",
    "TrainerConfig",
    "WorkerExit",
    "__version__",
]

from elastrain.exitcodes import WorkerExit

if TYPE_CHECKING:
    from elastrain.runtime.trainer import (
        Decision,
        ElasticTrainer,
        EvalResult,
        SkipReason,
        StepGrads,
        StepResult,
        TrainerConfig,
    )


def __getattr__(name: str) -> Any:
    # Lazy so that `import elastrain` (the CLI, the coordinator) does not pay for torch.
    if name in (
        "ElasticTrainer",
        "TrainerConfig",
        "StepResult",
        "StepGrads",
        "Decision",
        "SkipReason",
        "EvalResult",
    ):
        from elastrain.runtime import trainer

        return getattr(trainer, name)
    raise AttributeError(name)

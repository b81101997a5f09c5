"""elastrain for JAX: the same elastic runtime for a jitted JAX/optax training loop.

    pip install 'elastrain[jax]'

    from elastrain.jax import JaxElasticTrainer, TrainerConfig

See docs/guide/jax.md. The coordinator, launcher, process groups, data order and
observability are the PyTorch path's; this package adds the backend of
the shared step engine (`backend.py`), the trainer's face (`trainer.py`) and
the pytree state helpers (`state.py`, including the `JaxState`
that the shared heal in `elastrain.transfer` moves).
"""

from __future__ import annotations

try:
    import jax as _jax  # noqa: F401
    import optax as _optax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "elastrain.jax needs JAX and optax: pip install 'elastrain[jax]' (or: pip install jax optax)"
    ) from e

from elastrain.jax.trainer import JaxElasticTrainer
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.engine import StepResult

__all__ = ["JaxElasticTrainer", "StepResult", "TrainerConfig"]

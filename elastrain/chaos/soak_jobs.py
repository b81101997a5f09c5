"""The soak's jobs: which script each framework runs, and what they share.

`elastrain chaos soak --job torch|jax` picks one `SoakJob`; the soak itself is
the same for both. The two scripts (`soak_job.py`, PyTorch; `soak_job_jax.py`,
JAX) train the same small MLP regression under the same contract, defined here
once:

- data: `Regression`, a fixed set (numpy, so both frameworks read it);
- data order: `expected_ids(step)`, the sample ids every committed step must
  consume exactly once (the soak's exactly-once check);
- shape of the run: `trainer_config()` (batch, micro-batch, seed, a checkpoint
  every `CHECKPOINT_EVERY` steps, an open-ended step count: the soak ends the
  job with a preemption notice) and the model's `DIM`, `HIDDEN`, `DROPOUT`, `LR`;
- output: `save_final` writes a member's final parameters, flat, to
  <run_dir>/final/<member>.npy (numpy, no pickle).

This module imports no framework itself: the soak's own process reads it.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from elastrain.data import GlobalOrder
from elastrain.runtime.config import TrainerConfig

BATCH, MICRO, SEED, DATASET, DIM, HIDDEN = 24, 4, 11, 6000, 16, 128
CHECKPOINT_EVERY = 20
TOTAL_STEPS = 100_000
"""More than any soak reaches: the soak ends the job with a preemption notice."""
LR = 3e-3
DROPOUT = 0.1

_HERE = Path(__file__).resolve().parent


class SoakJob(StrEnum):
    """The job the soak trains under faults (`--job`)."""

    TORCH = "torch"
    JAX = "jax"

    @property
    def script(self) -> str:
        """The training script `elastrain run` starts for this job."""
        return str(_HERE / ("soak_job.py" if self is SoakJob.TORCH else "soak_job_jax.py"))


def trainer_config() -> TrainerConfig:
    """The configuration both jobs train with."""
    return TrainerConfig(
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        total_steps=TOTAL_STEPS,
        seed=SEED,
        checkpoint_every=CHECKPOINT_EVERY,
    )


def expected_ids(step: int) -> list[int]:
    """The sample ids of `step` in the jobs' global order."""
    return GlobalOrder(DATASET, SEED).ids(step * BATCH, (step + 1) * BATCH)


class Regression:
    """`y = tanh(x @ w) + noise`: `n` samples of `d` features, float32 numpy pairs
    drawn from `seed` (the soak's set by default; tests/scripts/train_jax_mlp.py
    draws a smaller one)."""

    def __init__(self, n: int = DATASET, d: int = DIM, seed: int = 99) -> None:
        g = np.random.default_rng(seed)
        self.x = g.standard_normal((n, d), dtype=np.float32)
        w = g.standard_normal((d, 1), dtype=np.float32)
        noise = 0.05 * g.standard_normal((n, 1), dtype=np.float32)
        self.y = (np.tanh(self.x @ w) + noise).astype(np.float32)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        return self.x[i], self.y[i]


def save_final(member: str, flat: np.ndarray[Any, Any]) -> None:
    """Write `member`'s final parameters to <run_dir>/final/<member>.npy (no pickle).

    A no-op outside `elastrain run` (no $ELASTRAIN_RUN_DIR)."""
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    if not run_dir:
        return
    out = Path(run_dir) / "final"
    out.mkdir(exist_ok=True)
    np.save(out / f"{member}.npy", flat, allow_pickle=False)

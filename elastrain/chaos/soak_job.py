"""The soak's training job: a small MLP regression, checkpointed every few steps.

    elastrain run -n 3 --ckpt-every 20 elastrain/chaos/soak_job.py

Started by `elastrain chaos soak` (see elastrain.chaos.soak), once under
faults and once as the failure-free reference. Its data order is the one the
soak's exactly-once check expects (`expected_ids`). On completion each member
holding the final state writes its parameters to <run_dir>/final/<member>.npy.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig
from elastrain.data import GlobalOrder

BATCH, MICRO, SEED, DATASET, DIM = 24, 4, 11, 6000, 16


def expected_ids(step: int) -> list[int]:
    """The sample ids of `step` in the job's global order."""
    return GlobalOrder(DATASET, SEED).ids(step * BATCH, (step + 1) * BATCH)


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(99)
        self.x = torch.randn(DATASET, DIM, generator=g)
        w = torch.randn(DIM, 1, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.05 * torch.randn(DATASET, 1, generator=g)

    def __len__(self) -> int:
        return DATASET

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(DIM, 128), nn.Tanh(), nn.Dropout(0.1), nn.Linear(128, 1))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    cfg = TrainerConfig(
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        total_steps=100_000,
        seed=SEED,
        checkpoint_every=20,
    )
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, cfg)
    for _ in trainer.steps():
        pass
    run_dir = os.environ.get("ELASTRAIN_RUN_DIR")
    if run_dir and trainer.holds_final_state:
        out = Path(run_dir) / "final"
        out.mkdir(exist_ok=True)
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        np.save(out / f"{trainer.member}.npy", flat, allow_pickle=False)


if __name__ == "__main__":
    main()

"""The soak's PyTorch job: a small MLP regression, checkpointed every few steps.

    elastrain run -n 3 elastrain/chaos/soak_job.py

Started by `elastrain chaos soak --job torch` (see elastrain.chaos.soak), once
under faults and once as the failure-free reference. Its data, data order
(`expected_ids`) and final output are the soak jobs' shared contract
(`elastrain.chaos.soak_jobs`); `soak_job_jax.py` is the same job in JAX.
"""

from __future__ import annotations

import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig
from elastrain.chaos.soak_jobs import (
    BATCH,
    CHECKPOINT_EVERY,
    DIM,
    DROPOUT,
    HIDDEN,
    LR,
    MICRO,
    SEED,
    TOTAL_STEPS,
    Regression,
    expected_ids,
    save_final,
)

__all__ = ["expected_ids", "main"]


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Dropout(DROPOUT), nn.Linear(HIDDEN, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    cfg = TrainerConfig(
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        total_steps=TOTAL_STEPS,
        seed=SEED,
        checkpoint_every=CHECKPOINT_EVERY,
    )
    trainer = ElasticTrainer(model, opt, Regression(), loss_fn, cfg)
    for _ in trainer.steps():
        pass
    if trainer.holds_final_state:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        save_final(trainer.member, flat)


if __name__ == "__main__":
    main()

"""The soak's PyTorch job: a small MLP regression, checkpointed every few steps.

    elastrain run -n 3 elastrain/chaos/soak_job.py

Started by `elastrain chaos soak --job torch` (see elastrain.chaos.soak), once
under faults and once as the failure-free reference. Its data, data order
(`expected_ids`), configuration and final output are the soak jobs' shared
contract (`elastrain.chaos.soak_jobs`); `soak_job_jax.py` is the same job in JAX.
"""

from __future__ import annotations

import torch
from torch import nn

from elastrain import ElasticTrainer
from elastrain.chaos import soak_jobs

expected_ids = soak_jobs.expected_ids


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean squared error of one micro-batch."""
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    dim, hidden = soak_jobs.DIM, soak_jobs.HIDDEN
    model = nn.Sequential(
        nn.Linear(dim, hidden), nn.Tanh(), nn.Dropout(soak_jobs.DROPOUT), nn.Linear(hidden, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=soak_jobs.LR)
    trainer = ElasticTrainer(
        model, opt, soak_jobs.Regression(), loss_fn, soak_jobs.trainer_config()
    )
    for _ in trainer.steps():
        pass
    if trainer.holds_final_state:
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
        soak_jobs.save_final(trainer.member, flat)


if __name__ == "__main__":
    main()

"""The README's example: a plain PyTorch loop made elastic.

elastrain run -n 4 --min 2 --replace-delay 5 examples/minimal.py
"""

import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig


def loss_fn(
    model: nn.Module, batch: list[torch.Tensor]
) -> torch.Tensor:  # mean loss of one micro-batch
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


torch.manual_seed(0)  # same initial weights everywhere
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
data = torch.utils.data.TensorDataset(torch.randn(4096, 16), torch.randn(4096, 1))

trainer = ElasticTrainer(
    model,
    opt,
    data,
    loss_fn,
    TrainerConfig(
        global_batch_size=64,
        micro_batch_size=8,
        total_steps=500,
        seed=0,
        max_grad_norm=1.0,  # clip_grad_norm_, the same on every member
    ),
)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=500)
trainer.register("sched", sched)  # heals, checkpoints and the state hash carry it
for r in trainer.steps():  # yields after every committed step
    sched.step()
    if r.rank == 0 and r.step % 50 == 0:
        print(f"step {r.step} loss {r.loss:.4f} grad norm {r.grad_norm:.3f} on {r.members} members")

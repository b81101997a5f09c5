"""docs/guide/porting.md: ddp_train.py (torchrun + DDP) ported to elastrain is elastic_train.py."""

import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig

STEPS, BATCH, EVAL_EVERY = 60, 64, 20


def loss_fn(model, batch):  # mean loss of a batch
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def evaluate(model, data):  # mean loss over the held-out set
    model.eval()
    with torch.no_grad():
        loss = loss_fn(model, data.tensors).item()
    model.train()
    return loss


torch.manual_seed(0)  # same initial weights and data everywhere
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
x = torch.randn(STEPS * BATCH + 512, 16)
y = torch.tanh(x.sum(1, keepdim=True))
train = torch.utils.data.TensorDataset(x[:-512], y[:-512])
val = torch.utils.data.TensorDataset(x[-512:], y[-512:])
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
cfg = TrainerConfig(
    global_batch_size=BATCH, micro_batch_size=8, total_steps=STEPS, max_grad_norm=1.0
)
trainer = ElasticTrainer(model, opt, train, loss_fn, cfg)
trainer.register("sched", sched)  # a replacement gets the survivors' learning rate

for r in trainer.steps():  # yields after each committed step
    sched.step()
    if r.step % EVAL_EVERY == 0:
        with trainer.pause():  # every member waits here, the hang watchdog too
            if r.rank == 0:
                print(f"step {r.step} loss {r.loss:.4f} val loss {evaluate(model, val):.4f}")

"""docs/guide/porting.md: fsdp_train.py (torchrun + FSDP2 HSDP), ported: elastic_fsdp_train.py."""

import math

import torch
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig

STEPS, BATCH, EVAL_EVERY, WARMUP = 60, 64, 20, 6


def loss_fn(model, batch):  # mean loss of a batch
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def lr_at(step):  # linear warm-up, then cosine decay to zero
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def evaluate(model, batch):  # summed loss over a batch of the held-out set
    return {"loss": loss_fn(model, batch) * len(batch[0])}


torch.manual_seed(0)  # same initial weights and data everywhere
blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]
model = nn.Sequential(*blocks, nn.Linear(32, 1))
x = torch.randn(STEPS * BATCH + 512, 32)
y = torch.tanh(x.sum(1, keepdim=True))
train = torch.utils.data.TensorDataset(x[:-512], y[:-512])
val = torch.utils.data.TensorDataset(x[-512:], y[-512:])
cfg = TrainerConfig(  # `elastrain run -n 4 --shard-size 2`: HSDP, each block a unit
    global_batch_size=BATCH, micro_batch_size=8, total_steps=STEPS, max_grad_norm=1.0
)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
trainer = ElasticTrainer(model, opt, train, loss_fn, cfg)
trainer.register("sched", sched)  # a replacement gets the survivors' learning rate
trainer.evaluate_every(EVAL_EVERY, evaluate, val, batch_size=128)  # redone if a member dies

for r in trainer.steps():  # yields after each committed step
    sched.step()
    if r.evaluation is not None and r.rank == 0:  # after 20, 40, ... steps
        print(f"step {r.step} loss {r.loss:.4f} val loss {r.evaluation.means['loss']:.4f}")

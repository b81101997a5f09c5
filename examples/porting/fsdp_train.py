"""docs/guide/porting.md: fsdp_train.py (torchrun + FSDP2 HSDP), ported: elastic_fsdp_train.py."""

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

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


dist.init_process_group("gloo")
torch.manual_seed(0)  # same initial weights and data everywhere
blocks = [nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(4)]
model = nn.Sequential(*blocks, nn.Linear(32, 1))
x = torch.randn(STEPS * BATCH + 512, 32)
y = torch.tanh(x.sum(1, keepdim=True))
train = torch.utils.data.TensorDataset(x[:-512], y[:-512])
val = torch.utils.data.TensorDataset(x[-512:], y[-512:])
mesh = dist.init_device_mesh("cpu", (dist.get_world_size() // 2, 2), mesh_dim_names=("dp", "fsdp"))
for module in [*model, model]:  # HSDP: each block, then the rest, sharded in a group of 2
    fully_shard(module, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
sampler = torch.utils.data.DistributedSampler(train)
loader = torch.utils.data.DataLoader(train, BATCH // dist.get_world_size(), sampler=sampler)

for step, batch in enumerate(loader):  # one pass over the training set: STEPS steps
    loss = loss_fn(model, batch)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % EVAL_EVERY == 0:  # every rank evaluates: the forward gathers the shards
        model.eval()
        with torch.no_grad():
            batches = torch.utils.data.DataLoader(val, 128)
            val_loss = sum(evaluate(model, b)["loss"] for b in batches) / len(val)
        model.train()
        if dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f} val loss {val_loss:.4f}")
dist.destroy_process_group()

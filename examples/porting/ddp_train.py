"""docs/guide/porting.md: ddp_train.py (torchrun + DDP) ported to elastrain is elastic_train.py."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

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


dist.init_process_group("gloo")
torch.manual_seed(0)  # same initial weights and data everywhere
model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
x = torch.randn(STEPS * BATCH + 512, 16)
y = torch.tanh(x.sum(1, keepdim=True))
train = torch.utils.data.TensorDataset(x[:-512], y[:-512])
val = torch.utils.data.TensorDataset(x[-512:], y[-512:])
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
loader = DataLoader(train, BATCH // dist.get_world_size(), sampler=DistributedSampler(train))

for step, batch in enumerate(loader):  # one pass over the training set: STEPS steps
    loss = loss_fn(ddp, batch)
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    if step % EVAL_EVERY == 0 and dist.get_rank() == 0:
        print(f"step {step} loss {loss.item():.4f} val loss {evaluate(model, val):.4f}")
dist.destroy_process_group()

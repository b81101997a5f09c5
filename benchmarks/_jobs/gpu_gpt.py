"""The job of benchmarks/gpu_check.py: the demo GPT on one device, under elastrain or plain.

Under elastrain (the default) it is a worker the launcher starts; with
``--plain`` it is the baseline: the same model, data order, micro-batches and
AdamW in an ordinary loop in one process, printing one JSON line with its step
times. Both move each micro-batch to ``--device`` inside the loss function, as
a user's script does.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import Shape, build  # noqa: E402
from torch.utils.data import default_collate  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402
from elastrain.data import GlobalOrder, step_microbatches  # noqa: E402
from elastrain.runtime.torch_backend import seed_micro_batch  # noqa: E402


def make_loss(device: torch.device):  # type: ignore[no-untyped-def]
    def loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (t.to(device, non_blocking=True) for t in batch)
        logits = model(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return loss_fn


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--steps", type=int, default=40, help="--plain only (elastrain: the launcher's)"
    )
    ap.add_argument("--plain", action="store_true", help="the baseline loop, no elastrain")
    ap.add_argument("--dim", type=int, default=Shape.dim)
    ap.add_argument("--layers", type=int, default=Shape.layers)
    ap.add_argument("--heads", type=int, default=Shape.heads)
    ap.add_argument("--batch", type=int, default=Shape.global_batch)
    ap.add_argument("--micro", type=int, default=Shape.micro_batch)
    ap.add_argument("--collectives", choices=("auto", "gloo", "nccl"), default="auto")
    a = ap.parse_args()
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # several workers share the machine's cores
    shape = Shape(a.dim, a.layers, a.heads, Shape.block, a.batch, a.micro)
    model, opt, data = build(shape)
    model.to(device)
    # AdamW's state is created lazily on the parameters' device: rebuild it there.
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)
    loss_fn = make_loss(device)
    if a.plain:
        # What one elastrain member computes at world size 1: every micro-batch of
        # the step from the seeded global order, each under its reseeded RNG, the
        # loss weighted by its samples over the global batch; then AdamW.
        order = GlobalOrder(len(data), shape.seed)
        times = []
        for step in range(a.steps):
            sync(device)
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for i, mb in enumerate(step_microbatches(step, shape.global_batch, shape.micro_batch)):
                ids = order.ids(mb.start, mb.stop)
                with torch.random.fork_rng(devices=[]):
                    seed_micro_batch(shape.seed, step, i)
                    loss = loss_fn(model, default_collate([data[j] for j in ids]))
                    (loss * (len(ids) / shape.global_batch)).backward()
            opt.step()
            sync(device)
            times.append(time.perf_counter() - t0)
        print(json.dumps({"step_s": times}), flush=True)
        return
    cfg = TrainerConfig(
        global_batch_size=shape.global_batch,
        micro_batch_size=shape.micro_batch,
        total_steps=a.steps,
        seed=shape.seed,
        collectives=a.collectives,
    )
    trainer = ElasticTrainer(model, opt, data, loss_fn, cfg)
    for r in trainer.steps():
        if r.rank == 0 and r.step % 10 == 0:
            print(f"step {r.step} loss {r.loss:.4f} members {r.members} gen {r.gen}", flush=True)


if __name__ == "__main__":
    main()

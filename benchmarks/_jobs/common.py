"""What the elastrain jobs and the baselines of benchmarks/recovery.py and sharded.py share.

One model (the demo GPT, sized to about 10M parameters), one dataset (the Python
stdlib's source as bytes), one loss, one optimizer and one data pipeline
(elastrain's seeded global order and micro-batch assignment), so that the
sides of a step-time comparison differ only in how gradients are reduced (and,
in sharded.py, how the model is sharded).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch.utils.data import default_collate

from elastrain.data import GlobalOrder
from elastrain.demo.gpt import GPT, ByteBlocks, loss_fn, stdlib_corpus
from elastrain.runtime.torch_backend import seed_micro_batch

__all__ = [
    "Shape",
    "accumulate",
    "add_shape_arguments",
    "build",
    "loss_fn",
    "param_count",
    "micro_rng_seed",
    "proc_status_kb",
    "shape_of",
]


@dataclass(frozen=True)
class Shape:
    """Model and batch shape of the benchmark (both sides use exactly this)."""

    dim: int = 320
    layers: int = 8
    heads: int = 5
    block: int = 64
    global_batch: int = 8
    micro_batch: int = 1
    lr: float = 3e-3
    seed: int = 0


def add_shape_arguments(ap: argparse.ArgumentParser, required: bool = False) -> None:
    """A job script's --dim --layers --heads --block --batch --micro (`shape_of`),
    defaulting to `Shape`'s unless ``required``."""
    for flag, field in (("--dim", "dim"), ("--layers", "layers"), ("--heads", "heads"),
                        ("--block", "block"), ("--batch", "global_batch"),
                        ("--micro", "micro_batch")):  # fmt: skip
        if required:
            ap.add_argument(flag, type=int, required=True)
        else:
            ap.add_argument(flag, type=int, default=getattr(Shape, field))


def shape_of(a: argparse.Namespace) -> Shape:
    """The `Shape` of a job script's `add_shape_arguments`."""
    return Shape(a.dim, a.layers, a.heads, a.block, a.batch, a.micro)


def build(shape: Shape) -> tuple[torch.nn.Module, torch.optim.Optimizer, ByteBlocks]:
    """Model (identical initial weights everywhere), AdamW, dataset."""
    torch.manual_seed(shape.seed)
    model = GPT(block=shape.block, d=shape.dim, layers=shape.layers, heads=shape.heads)
    opt = torch.optim.AdamW(model.parameters(), lr=shape.lr, weight_decay=0.01)
    data = ByteBlocks(stdlib_corpus(), shape.block)
    return model, opt, data


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def proc_status_kb(field: str, pid: int | str = "self") -> int:
    """A kB field of /proc/<pid>/status (VmRSS: resident now; VmHWM: the peak
    resident size since the process started); -1 where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def micro_rng_seed(seed: int, step: int, micro: int) -> int:
    """The per-micro-batch RNG seed ElasticTrainer uses (same cost on both sides)."""
    return (seed * 0x9E3779B1 + step * 1_000_003 + micro) & 0x7FFF_FFFF_FFFF


def accumulate(
    model: torch.nn.Module,
    data: ByteBlocks,
    order: GlobalOrder,
    shape: Shape,
    step: int,
    mbs: list[range],
    mine: list[int],
    world: int,
    sync: Callable[[bool], AbstractContextManager[object]],
) -> tuple[float, float]:
    """A baseline rank's forward and backward over its micro-batches `mine` (indices
    into `mbs`, the step's micro-batches) of `step`, as elastrain computes them: each
    micro-batch's samples from the seeded global `order`, under the RNG reseeded from
    (seed, step, micro-batch) the way ElasticTrainer does (`seed_micro_batch`: the same cost
    too), its loss scaled by `len(ids) * world / global batch` so that a mean over the
    `world` ranks gives elastrain's sum / global batch. `sync(last)` is entered around
    each micro-batch (`last`: the rank's final one, whose backward must reduce: DDP's
    `no_sync()` on the others, FSDP2's setters). Returns the sum of the micro-batches'
    loss x samples and the monotonic time the last micro-batch began."""
    loss_sum = 0.0
    t_last = time.monotonic()
    for k, i in enumerate(mine):
        ids = order.ids(mbs[i].start, mbs[i].stop)
        last = k == len(mine) - 1
        if last:
            t_last = time.monotonic()
        with sync(last), torch.random.fork_rng(devices=[]):
            seed_micro_batch(shape.seed, step, i)
            batch = default_collate([data[j] for j in ids])
            loss = loss_fn(model, batch)
            (loss * (len(ids) * world / shape.global_batch)).backward()
        loss_sum += float(loss.detach()) * len(ids)
    return loss_sum, t_last


class Gate:
    """Interleaves the two sides of the steady-state comparison in blocks of steps.

    Both sides' workers run at once but take turns: after `warmup` steps and after
    each block of `block` steps, every worker of a side reports to the benchmark's
    TCPStore (`<side>/ready/<k>`; the last of `world` also sets
    `<side>/ready_all/<k>` to its wall time) and then waits, idle, until the
    benchmark sets `<side>/go/<k>`. After the last block it reports and returns.
    Called on every worker between steps (after a commit), never inside one.
    """

    def __init__(
        self, address: str, side: str, world: int, warmup: int, block: int, blocks: int
    ) -> None:
        import datetime

        import torch.distributed as dist

        host, port = address.rsplit(":", 1)
        self.store = dist.TCPStore(
            host, int(port), is_master=False, timeout=datetime.timedelta(seconds=900)
        )
        self.side, self.world = side, world
        self.warmup, self.block, self.blocks = warmup, block, blocks

    @property
    def total_steps(self) -> int:
        return self.warmup + self.block * self.blocks

    def after_step(self, committed: int) -> None:
        """`committed`: steps done so far on this worker."""
        import time

        if committed < self.warmup or (committed - self.warmup) % self.block:
            return
        k = (committed - self.warmup) // self.block
        if self.store.add(f"{self.side}/ready/{k}", 1) == self.world:
            self.store.set(f"{self.side}/ready_all/{k}", repr(time.time()))
        if k < self.blocks:
            self.store.wait([f"{self.side}/go/{k}"])

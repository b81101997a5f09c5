"""A small GPT-style model trained elastically on the Python stdlib's source.

Run it under the launcher (this is what `elastrain demo` does, with faults):

    elastrain run -n 4 elastrain/demo/gpt.py -- --steps 60

The corpus is available offline on every machine that has Python: the
standard library's top-level `.py` files, concatenated in sorted order and
read as bytes (vocabulary 256).

It also runs sharded (`elastrain demo --sharded` runs it as 2 x 2 with
`--dim 192 --layers 4`): the loss function uses the model it is given (the
FSDP2 wrapper), and the blocks sit in an `nn.ModuleList`, one FSDP2 unit each.

The sharded demo also turns on what an LLM recipe has (`--clip 1.0 --warmup 5
--eval-every 25`): gradient clipping by the global norm, a warm-up + cosine
learning rate (`LambdaLR`, registered with the trainer so that heals, reshards
and checkpoints carry it), and an evaluation on held-out text that the
trainer runs and redoes if a member dies during it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from elastrain import ElasticTrainer, TrainerConfig
from elastrain.demo.pace import read_pace


def stdlib_corpus(max_bytes: int = 2_000_000) -> bytes:
    root = Path(os.__file__).parent
    out = bytearray()
    for path in sorted(root.glob("*.py")):
        out += path.read_bytes()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class ByteBlocks(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample i: the `block` bytes at offset i*block and the same shifted by one."""

    def __init__(self, data: bytes, block: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = i * self.block
        chunk = self.data[s : s + self.block + 1]
        return chunk[:-1], chunk[1:]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 256, block: int = 64, d: int = 128, layers: int = 2, heads: int = 4
    ) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(block, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def eval_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The summed loss of a held-out batch (the trainer adds the sums exactly)."""
    return {"loss": loss_fn(model, batch) * len(batch[0])}


def warmup_cosine(warmup: int, steps: int) -> Callable[[int], float]:
    """The LR factor: linear warm-up over `warmup` steps, then cosine decay to a tenth."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        done = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, done)))

    return factor


HELD_OUT = 16 * 1024
"""Bytes at the corpus's end kept out of training for `--eval-every`."""


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clip", type=float, default=None, help="clip gradients to this global norm")
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="warm-up steps of a warm-up + cosine LR schedule (registered with the trainer)",
    )
    ap.add_argument(
        "--eval-every",
        type=int,
        default=None,
        help="evaluate on held-out text every N steps (the corpus's last 16 KiB)",
    )
    ap.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help="pace: at least this long per step, so that a fast machine still shows the "
        "hung member rejoin before the job ends",
    )
    ap.add_argument(
        "--pace-file",
        default=None,
        help="a file holding a minimum step time in seconds, read every step; while it "
        "exists it replaces --min-step-s (a driver slows the job while it waits for a "
        "phase, as `elastrain demo --sharded` does)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)  # identical initial weights on every member
    model = GPT(block=args.block, d=args.dim, layers=args.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    corpus = stdlib_corpus()
    held_out = args.eval_every is not None
    data = ByteBlocks(corpus[:-HELD_OUT] if held_out else corpus, args.block)
    cfg = TrainerConfig(
        global_batch_size=args.batch,
        micro_batch_size=args.micro,
        total_steps=args.steps,
        seed=args.seed,
        max_grad_norm=args.clip,
    )
    trainer = ElasticTrainer(model, opt, data, loss_fn, cfg)
    sched = None
    if args.warmup is not None:
        total = trainer.config.total_steps  # the launcher's --steps wins
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, total))
        trainer.register("sched", sched)
    if held_out:
        val = ByteBlocks(corpus[-HELD_OUT:], args.block)
        trainer.evaluate_every(args.eval_every, eval_fn, val, batch_size=4 * args.micro)
    for r in trainer.steps():
        if sched is not None:
            sched.step()
        pace = read_pace(args.pace_file, args.min_step_s)
        if r.step_s < pace:
            time.sleep(pace - r.step_s)  # the pace, not a synchronisation
        last = r.step == trainer.config.total_steps - 1
        if r.rank == 0 and (r.step % 10 == 0 or last or r.evaluation is not None):
            extra = ""
            if r.grad_norm is not None:
                extra += f" |g| {r.grad_norm:.2f}"
            if sched is not None:
                extra += f" lr {sched.get_last_lr()[0]:.2e}"
            if r.evaluation is not None:
                extra += f" val loss {r.evaluation.means['loss']:.4f}"
            print(
                f"step {r.step} loss {r.loss:.4f} ppl {math.exp(r.loss):.1f} "
                f"members {r.members} gen {r.gen}{extra}",
                flush=True,
            )
    if trainer.last_evaluation is not None and trainer.rank == 0:
        print(f"val loss after the last step {trainer.last_evaluation.means['loss']:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

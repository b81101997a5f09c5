"""A Hugging Face Transformers causal LM, trained elastically.

    pip install -e '.[hf]'          # transformers (no weights are downloaded)
    elastrain run -n 2 --min 2 --fault kill@10 examples/hf_causal_lm.py

A tiny Llama built from a `LlamaConfig` (random init, byte vocabulary) learns
the Python standard library's own source: AdamW, a warmup + cosine schedule
from transformers registered with the trainer, gradient clipping. The model's
``forward(input_ids, labels=...)`` returns the mean loss, which is what the
trainer's loss function returns. With ``--fault kill@10`` one worker is
SIGKILLed at step 10, a replacement is started, healed from the survivor
(model, AdamW state, schedule) and the run ends as a failure-free run does:
the console's recovery table shows the kill and the joiner, and
`elastrain report runs/<id>` the rest. ``-- --compile`` passes
`torch.compile(model)` (inductor: about 30 s of compiling per worker on a
2-core machine, done before the worker joins, then faster steps).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

from elastrain import ElasticTrainer, TrainerConfig


class ByteBlocks(torch.utils.data.Dataset[torch.Tensor]):
    """Sample i: `block` bytes of the standard library's source (same on every machine)."""

    def __init__(self, block: int, max_bytes: int = 1_000_000) -> None:
        text = b"".join(p.read_bytes() for p in sorted(Path(os.__file__).parent.glob("*.py")))
        self.data = torch.frombuffer(bytearray(text[:max_bytes]), dtype=torch.uint8).long()
        self.block = block

    def __len__(self) -> int:
        return len(self.data) // self.block

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i * self.block : (i + 1) * self.block]


def loss_fn(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    # transformers shifts the labels itself; the loss is the mean over the micro-batch.
    return model(input_ids=input_ids, labels=input_ids).loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per worker; elastrain run -n 2 on a 2-core machine

    torch.manual_seed(0)  # same initial weights on every member
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    trainer = ElasticTrainer(
        torch.compile(model) if args.compile else model,
        opt,
        ByteBlocks(block=64),
        loss_fn,
        TrainerConfig(
            global_batch_size=16, micro_batch_size=4, total_steps=args.steps, max_grad_norm=1.0
        ),
    )
    steps = trainer.config.total_steps  # `elastrain run --steps N` overrides --steps
    sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=5, num_training_steps=steps)
    trainer.register("sched", sched)  # a replacement gets the survivors' learning rate
    for r in trainer.steps():
        sched.step()
        # The live view, `elastrain report`, /metrics and --tensorboard show it (rank 0's).
        trainer.log("lr", sched.get_last_lr()[0])
        if r.rank == 0 and r.step % 5 == 0:
            print(
                f"step {r.step} loss {r.loss:.3f} lr {sched.get_last_lr()[0]:.2e} "
                f"grad norm {r.grad_norm:.2f} on {r.members} members",
                flush=True,
            )


if __name__ == "__main__":
    main()

"""train_sharded.py's network built on the meta device: a fresh sharded job whose
members initialise only their rows (tests/test_sharded_meta.py).

    elastrain run -n 4 --shard-size 2 tests/scripts/train_meta.py -- --steps 20

--build meta: every member builds the model on the meta device and the trainer
initialises its rows module by module; --build whole: every member materialises
the same meta model whole with the same initialisation first
(`materialize_whole`), the reference a meta start must equal. --init picks the
initialisation: the modules' own reset_parameters, or an init_fn. --dump writes
each member's rows after the last step, to compare the states of two jobs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_sharded import Net, Regression, loss_fn  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402
from elastrain.runtime.meta_init import materialize_whole  # noqa: E402
from elastrain.runtime.sharded import ShardedBackend  # noqa: E402


class MetaNet(Net):
    """Net with a reset_parameters for the one tensor its root owns (the buffer
    ``scale``): what a model must give to be started on the meta device with
    the modules' own initialisers."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.scale.fill_(0.5)


def gpt_style_init(module: nn.Module, name: str) -> None:
    """An init_fn as nanoGPT writes one (normal(0, 0.02) weights, zero biases), per
    module; the down-projections scaled by depth, picked by name."""
    if isinstance(module, nn.Linear):
        std = 0.02 / (2 * 3) ** 0.5 if name.endswith(".down") else 0.02
        nn.init.normal_(module.weight, 0.0, std)
        nn.init.zeros_(module.bias)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--shard-size", type=int, default=1)
    ap.add_argument("--build", choices=["meta", "whole"], default="meta")
    ap.add_argument("--init", choices=["reset", "fn"], default="reset")
    ap.add_argument("--dump", default=None, help="directory for each member's rows at the end")
    args = ap.parse_args()
    torch.set_num_threads(1)
    init_fn = gpt_style_init if args.init == "fn" else None
    seed = 5
    with torch.device("meta"):
        model = MetaNet()
    if args.build == "whole":
        materialize_whole(model, seed, init_fn)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    cfg = TrainerConfig(
        global_batch_size=24,
        micro_batch_size=3,
        total_steps=args.steps,
        seed=seed,
        shard_size=args.shard_size,
        hang_timeout_floor_s=3.0,
    )
    trainer = ElasticTrainer(
        model,
        opt,
        Regression(),
        loss_fn,
        cfg,
        init_fn=init_fn if args.build == "meta" else None,
    )
    for _ in trainer.steps():
        pass
    if args.dump:
        backend = trainer.backend
        assert isinstance(backend, ShardedBackend)
        rows = {n: p.detach().clone() for n, p in backend.local.named_parameters()}
        out = Path(args.dump) / f"{os.environ['ELASTRAIN_MEMBER_ID']}.pt"
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"size": backend.shard_size, "shard": backend.shard, "rows": rows}, out)


if __name__ == "__main__":
    main()

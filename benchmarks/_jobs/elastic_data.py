"""The elastrain side of benchmarks/data.py: one ElasticTrainer worker on the
decode-heavy dataset (benchmarks/_jobs/decode.py), with or without data worker
processes and prefetch.

    elastrain run -n W --steps S elastic_data.py -- --num-workers K --prefetch-steps P [settings]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from decode import Settings, build, loss_fn  # noqa: E402

from elastrain import ElasticTrainer, TrainerConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--num-workers", type=int, default=0)
    ap.add_argument("--prefetch-steps", type=int, default=0)
    Settings.add_arguments(ap)
    a = ap.parse_args()
    torch.set_num_threads(1)
    s = Settings.of(a)
    model, opt, data = build(s)
    cfg = TrainerConfig(
        global_batch_size=s.batch,
        micro_batch_size=s.micro,
        total_steps=a.steps,
        seed=s.seed,
        num_workers=a.num_workers,
        prefetch_steps=a.prefetch_steps,
    )
    for _ in ElasticTrainer(model, opt, data, loss_fn, cfg).steps():
        pass


if __name__ == "__main__":
    main()

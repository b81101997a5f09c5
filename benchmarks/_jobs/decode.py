"""What both sides of benchmarks/data.py share: a dataset whose samples cost CPU
to decode, the model, the loss and the settings, so the sides differ only in
how the data is loaded (and how gradients are reduced).

A sample is "decoded" by a pure-Python loop (a linear congruential generator
producing its features): it holds the GIL, like most real Python decode and
augmentation code, so only worker processes take it off the training thread.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Settings:
    """One job's shape (both sides get exactly these)."""

    dim: int = 128
    hidden: int = 1024
    layers: int = 3
    decode_iters: int = 1000
    """Python loop iterations per sample (a few hundred microseconds on one core:
    decoding a step's samples costs about what computing them does)."""
    samples: int = 1 << 20
    batch: int = 256
    micro: int = 32
    seed: int = 0

    @staticmethod
    def add_arguments(ap: argparse.ArgumentParser) -> None:
        for f, default in Settings().__dict__.items():
            ap.add_argument("--" + f.replace("_", "-"), type=int, default=default)

    @staticmethod
    def of(a: argparse.Namespace) -> Settings:
        return Settings(**{f: getattr(a, f) for f in Settings().__dict__})

    def argv(self) -> list[str]:
        return [x for f, v in self.__dict__.items() for x in ("--" + f.replace("_", "-"), str(v))]


class Decoded(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Sample j: `dim` features from a per-sample LCG run for `iters` steps, and a
    target that depends on them (so the model has something to learn)."""

    def __init__(self, s: Settings) -> None:
        self.n, self.dim, self.iters = s.samples, s.dim, s.decode_iters

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = (j * 2654435761 + 1) & 0xFFFFFFFF
        feats = [0.0] * self.dim
        for k in range(self.iters):
            x = (x * 1103515245 + 12345) & 0x7FFFFFFF
            feats[k % self.dim] += x / 0x7FFFFFFF - 0.5
        t = torch.tensor(feats, dtype=torch.float32)
        return t, torch.tanh(t[:1] * 0.1)


def build(s: Settings) -> tuple[nn.Module, torch.optim.Optimizer, Decoded]:
    torch.manual_seed(s.seed)
    layers: list[nn.Module] = [nn.Linear(s.dim, s.hidden), nn.Tanh()]
    for _ in range(s.layers - 2):
        layers += [nn.Linear(s.hidden, s.hidden), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(s.hidden, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3), Decoded(s)


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

"""The sharded member's memory savings change no value (elastrain.runtime.shard_memory)."""

from __future__ import annotations

import sys

import pytest
import torch

from elastrain.runtime import shard_memory
from elastrain.runtime.shard_memory import drop_fsdp_grads, mean_in_place


def test_the_mean_written_over_the_sum_is_the_same_rounding_of_the_same_quotient(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Small chunks, so that a parameter spans several and the first writes over its own input.
    monkeypatch.setattr(shard_memory, "_CHUNK", 1000)
    g = torch.Generator().manual_seed(0)
    params = {
        "a": ((37, 64), torch.float32),
        "frozen": ((5, 3), torch.float32),  # no gradient: its span is skipped
        "b": ((2501,), torch.bfloat16),
        "c": ((9, 7), torch.float64),
        "d": ((1, 3333), torch.float32),
    }
    spans, at = {}, 0
    for n, (shape, _) in params.items():
        numel = torch.Size(shape).numel()
        spans[n] = (at, at + numel)
        at += numel
    # Exact float64 sums of float32 gradients, large and small, with a page's worth of tail.
    buf = torch.randn(at + 4096, generator=g, dtype=torch.float64).float().double() * 1e3
    buf[10:20] = torch.tensor([1e-30, -0.0, 3.0, 1e30, 7.0, 1.0 / 3, 2.5, -2.5, 1e-8, 5e8])
    trained = {n: spans[n] for n in params if n != "frozen"}
    want = {
        n: buf[lo:hi].clone().div_(12).to(params[n][1]).view(params[n][0])
        for n, (lo, hi) in trained.items()
    }
    got = mean_in_place(
        buf,
        trained,
        {n: torch.Size(params[n][0]) for n in trained},
        {n: params[n][1] for n in trained},
        12,
    )
    assert list(got) == list(want)
    for n in want:
        assert got[n].dtype == want[n].dtype and got[n].shape == want[n].shape
        assert got[n].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
        assert torch.equal(got[n].view(-1).view(torch.uint8), want[n].view(-1).view(torch.uint8)), n
    if sys.platform.startswith("linux"):
        # The tail past the means went back to the system: its whole pages read zero
        # (the means take at most 8 * `at` bytes; 8 KiB further on is a whole page).
        assert bool(buf[at + 1024 : at + 1280].eq(0).all())


def test_fsdp_grads_are_dropped_as_they_are_set_and_only_on_trainable_parameters() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    drop_fsdp_grads([p, frozen])
    p.grad = torch.ones(3)
    for hook in p._post_accumulate_grad_hooks.values():  # type: ignore[union-attr]
        hook(p)  # as FSDP2 calls them after setting the sharded gradient
    assert p.grad is None
    assert not getattr(frozen, "_post_accumulate_grad_hooks", None)

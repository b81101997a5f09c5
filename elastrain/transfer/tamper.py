"""Deliberate damage a heal sender does to what it sends: the seam for testing refusal.

`heal(..., tamper=Tamper(...))` on one rank makes that rank misbehave in a
seeded, repeatable way; production callers never pass it. What the rank *does*
(which stripes it sends, its checksums) is unchanged; only the bytes on the wire
are damaged, as a bad NIC, a bad DIMM or a buggy peer would damage them.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

LIES = ("more_bytes", "fewer_bytes", "dtype", "shape", "total_bytes", "truncated")
"""How `Tamper.manifest` makes a manifest lie: an entry claims 4 more or 1 fewer
bytes than its shape holds, claims another dtype (of another item size) or an
extra dimension, total_bytes is 8 too many, or the JSON is cut in half."""


@dataclass(frozen=True)
class Tamper:
    """What one sender damages; positions and entries are drawn from ``seed``.

    flip: as a sender, flip this many distinct bytes of every stripe it sends,
        after computing the stripe's CRC over the intact bytes (the receiver
        sees a checksum mismatch). The live tensors are never touched.
    manifest: as the manifest root, broadcast a manifest that lies (one of `LIES`).
    """

    flip: int = 0
    manifest: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.flip < 0:
            raise ValueError(f"flip must be >= 0, got {self.flip}")
        if self.manifest is not None and self.manifest not in LIES:
            raise ValueError(f"manifest lie must be one of {LIES}, got {self.manifest!r}")

    def stripe(self, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies of the outgoing uint8 message buffers with ``flip`` bytes flipped."""
        if not self.flip:
            return bufs
        out = [b.clone() for b in bufs]
        total = sum(b.numel() for b in out)
        for at in random.Random(self.seed).sample(range(total), min(self.flip, total)):
            for b in out:
                if at < b.numel():
                    b[at] = int(b[at]) ^ 0xFF
                    break
                at -= b.numel()
        return out

    def manifest_bytes(self, data: bytes) -> bytes:
        """The encoded manifest, made to lie as `manifest` says."""
        if self.manifest is None:
            return data
        if self.manifest == "truncated":
            return data[: len(data) // 2]
        doc = json.loads(data)
        if self.manifest == "total_bytes":
            doc["total_bytes"] += 8
            return json.dumps(doc).encode()
        entries = [e for e in doc["entries"] if e["nbytes"] > 0]
        e = random.Random(self.seed).choice(entries)
        if self.manifest == "more_bytes":
            e["nbytes"] += 4
        elif self.manifest == "fewer_bytes":
            e["nbytes"] -= 1
        elif self.manifest == "dtype":
            e["dtype"] = "torch.float64" if e["dtype"] != "torch.float64" else "torch.float32"
        else:  # shape
            e["shape"] = [*e["shape"], 2]
        return json.dumps(doc).encode()

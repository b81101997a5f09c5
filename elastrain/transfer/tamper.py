"""Deliberate damage a heal sender does to what it sends: the seam for testing refusal.

`heal(..., tamper=Tamper(...))` on one rank makes that rank misbehave in a
seeded, repeatable way; production callers never pass it. What the rank *does*
(which stripes it sends, how it judges what it receives) is unchanged; only
what it puts on the wire is damaged or forged, as a bad NIC, a buggy peer or a
process without the job token would.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import torch

from elastrain.transfer.manifest import plan_stripes

LIES = (
    "more_bytes",
    "fewer_bytes",
    "dtype",
    "shape",
    "total_bytes",
    "truncated",
    "huge_length",
    "huge_entry",
    "huge_optim",
    "section_ref",
)
"""How `Tamper` makes a manifest lie: an entry claims 4 more or 1 fewer bytes
than its shape holds, claims another dtype (of another item size) or an extra
dimension, total_bytes is 8 too many, the section refers to a tensor no entry
holds (``section_ref``: its entries untouched, so a receiver that expects them,
`PreparedReceive`, judges the rest), or the JSON is cut in half; or, with a
self-consistent layout, it claims to be a 1 TiB manifest (``huge_length``: the
announced length), an entry of 1 TiB (``huge_entry``) or an optimizer tensor
of 256 GiB (``huge_optim``; an ``optim/`` entry where there is one)."""

TIB = 1 << 40
"""What ``huge_length`` and ``huge_entry`` claim."""
HUGE_OPTIM_BYTES = 256 << 30
"""What ``huge_optim`` claims."""


def _encode(doc: dict) -> bytes:
    """A manifest document in the root's compact encoding: a lie that leaves the
    entries alone leaves their bytes as the root wrote them."""
    return json.dumps(doc, separators=(",", ":")).encode()


def _resize(doc: dict, index: int, nbytes: int) -> None:
    """Make entry ``index`` of the manifest ``doc`` claim ``nbytes`` (as float32 elements,
    or bytes for a 1-byte dtype), keeping the layout self-consistent: later offsets,
    total_bytes and the stripes move with it."""
    e = doc["entries"][index]
    if e["dtype"] not in ("torch.float32", "torch.uint8", "torch.int8", "torch.bool"):
        e["dtype"] = "torch.float32"
    item = 4 if e["dtype"] == "torch.float32" else 1
    e["shape"], e["nbytes"] = [nbytes // item], nbytes
    offset = 0
    for ent in doc["entries"]:
        ent["offset"] = offset
        offset += ent["nbytes"]
    doc["total_bytes"] = offset
    senders = [s["sender_rank"] for s in doc["stripes"]]
    doc["stripes"] = [
        {"sender_rank": s.sender_rank, "offset": s.offset, "nbytes": s.nbytes}
        for s in plan_stripes(offset, senders)
    ]


@dataclass(frozen=True)
class Tamper:
    """What one sender damages; positions and entries are drawn from ``seed``.

    flip: as a sender, flip this many distinct bytes of every stripe it sends,
        after sealing the intact bytes (the receiver sees a seal mismatch).
        The live tensors are never touched.
    manifest: as the manifest root, broadcast a manifest that lies (one of `LIES`),
        sealed with the key it holds.
    forge: seal the manifest and stripes it sends with a key it made up, as a
        process that does not hold the job token would.
    """

    flip: int = 0
    manifest: str | None = None
    forge: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.flip < 0:
            raise ValueError(f"flip must be >= 0, got {self.flip}")
        if self.manifest is not None and self.manifest not in LIES:
            raise ValueError(f"manifest lie must be one of {LIES}, got {self.manifest!r}")

    def sealing_key(self, key: bytes | None) -> bytes | None:
        """The key this rank seals what it sends with: ``key``, or a made-up one."""
        return f"forged-{self.seed}".encode() if self.forge else key

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

    def announced_length(self, length: int) -> int:
        """The manifest length the root announces: ``length``, or 1 TiB for ``huge_length``."""
        return TIB if self.manifest == "huge_length" else length

    def manifest_bytes(self, data: bytes) -> bytes:
        """The encoded manifest, made to lie as `manifest` says."""
        if self.manifest is None or self.manifest == "huge_length":
            return data
        if self.manifest == "truncated":
            return data[: len(data) // 2]
        doc = json.loads(data)
        if self.manifest == "total_bytes":
            doc["total_bytes"] += 8
            return _encode(doc)
        if self.manifest == "section_ref":
            doc["section"]["lie"] = {"$tensor": "optim/no-such-entry"}
            return _encode(doc)
        rng = random.Random(self.seed)
        if self.manifest in ("huge_entry", "huge_optim"):
            candidates = [i for i, e in enumerate(doc["entries"]) if e["nbytes"] > 0]
            optim = [i for i in candidates if doc["entries"][i]["name"].startswith("optim/")]
            if self.manifest == "huge_optim" and optim:
                _resize(doc, rng.choice(optim), HUGE_OPTIM_BYTES)
            else:
                _resize(doc, rng.choice(candidates), TIB)
            return _encode(doc)
        e = rng.choice([e for e in doc["entries"] if e["nbytes"] > 0])
        if self.manifest == "more_bytes":
            e["nbytes"] += 4
        elif self.manifest == "fewer_bytes":
            e["nbytes"] -= 1
        elif self.manifest == "dtype":
            e["dtype"] = "torch.float64" if e["dtype"] != "torch.float64" else "torch.float32"
        else:  # shape
            e["shape"] = [*e["shape"], 2]
        return _encode(doc)

"""Where a receiver puts incoming heal bytes before they are verified and installed.

Every entry lands in its own fresh tensor (allocated only after the manifest
passed the receiver's `NamedState.bound`); the tensors become live only through
`NamedState.install`, after every stripe's seal matched, so a failed heal
leaves the live state untouched. Local; no communication.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elastrain.transfer.dtypes import byte_view, dtype_from_name
from elastrain.transfer.manifest import Entry


@dataclass(frozen=True)
class Landing:
    """One fresh tensor per manifest entry, by entry name."""

    tensors: dict[str, torch.Tensor]

    @classmethod
    def allocate(cls, entries: Sequence[Entry]) -> Landing:
        return cls({e.name: torch.empty(e.shape, dtype=dtype_from_name(e.dtype)) for e in entries})

    def target(self, entry: Entry, offset: int, nbytes: int) -> torch.Tensor:
        """The writable uint8 view for payload bytes ``[offset, offset + nbytes)`` of ``entry``."""
        rel = offset - entry.offset
        return byte_view(self.tensors[entry.name])[rel : rel + nbytes]

"""The flattened state's byte layout, its striping over shards, and safetensors headers.

The *payload* is every tensor's raw bytes back to back, in the dict order the
caller passed (no padding). Shard ``k`` of ``n`` owns the payload byte range
``[bounds[k], bounds[k+1])``: the payload split into ``n`` near-equal parts,
each cut moved down to an element boundary of the tensor it falls in, so one
large tensor is shared by several shards and no replica writes the same bytes
twice. Every member computes the same layout from the same names, dtypes and
shapes; its sha256 lets `commit` check that all shards agree.

A shard file is a valid safetensors file: an 8-byte little-endian header
length, a JSON header (padded with spaces), then exactly the shard's payload
range. Each tensor slice in the shard appears under its own name when the
shard holds it whole, or as a flat 1-D slice named ``name[e0:e1]`` (element
range) when it holds part of it; dtypes safetensors does not know are stored
as ``U8`` bytes named ``name[bytes b0:b1]``.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from elastrain.transfer.dtypes import dtype_from_name, dtype_name

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
}
for _name, _st in (
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        _ST_DTYPES[getattr(torch, _name)] = _st


def safetensors_dtype(dtype: torch.dtype) -> str | None:
    """safetensors' name of ``dtype`` (``F32``, ``BF16``, ...), None if it has none."""
    return _ST_DTYPES.get(dtype)


@dataclass(frozen=True)
class Entry:
    """One tensor of the payload: ``nbytes`` raw bytes at payload ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @functools.cached_property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize


@dataclass(frozen=True)
class Piece:
    """The part ``[start, end)`` (payload offsets) of ``entry`` that one shard holds."""

    entry: Entry
    start: int
    end: int


@dataclass(frozen=True)
class Layout:
    """Names, dtypes, shapes and payload offsets of a flattened state (local, pure)."""

    entries: tuple[Entry, ...]
    total: int

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of ``tensors`` in dict order. TypeError for non-str keys or non-tensors."""
        entries, off = [], 0
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise TypeError(f"state must map str to torch.Tensor; got {name!r}: {type(t)}")
            if t.layout != torch.strided or t.is_quantized:
                raise TypeError(f"tensor {name!r} has layout {t.layout}; only dense tensors")
            nbytes = t.numel() * t.element_size()
            entries.append(Entry(name, dtype_name(t.dtype), tuple(t.shape), off, nbytes))
            off += nbytes
        return cls(tuple(entries), off)

    def to_json(self) -> list[list[Any]]:
        return [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]

    @classmethod
    def from_json(cls, rows: Any) -> Layout:
        """Rebuild and check a layout read from a manifest; ValueError if it is inconsistent."""
        if not isinstance(rows, list):
            raise ValueError("layout is not a list")
        entries, off = [], 0
        for row in rows:
            name, dt, shape, offset, nbytes = row
            e = Entry(str(name), str(dt), tuple(int(s) for s in shape), int(offset), int(nbytes))
            try:
                itemsize = e.itemsize
            except KeyError:
                raise ValueError(
                    f"tensor {e.name!r} has dtype {e.dtype!r} this torch lacks"
                ) from None
            if e.offset != off or e.nbytes != math.prod(e.shape) * itemsize:
                raise ValueError(f"tensor {e.name!r} has inconsistent offset or size")
            entries.append(e)
            off += e.nbytes
        return cls(tuple(entries), off)

    @functools.cached_property
    def sha256(self) -> str:
        """Digest of the layout; equal on every member holding the same state structure."""
        raw = json.dumps(self.to_json(), separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()

    @functools.cached_property
    def _offsets(self) -> list[int]:
        return [e.offset for e in self.entries]

    def _entry_at(self, pos: int) -> Entry:
        """The non-empty entry whose bytes contain payload offset ``pos`` (< total)."""
        i = bisect.bisect_right(self._offsets, pos) - 1
        while self.entries[i].nbytes == 0 or self.entries[i].offset > pos:
            i -= 1
        return self.entries[i]

    def bounds(self, num_shards: int) -> list[int]:
        """The ``num_shards + 1`` stripe boundaries (payload offsets), on element boundaries."""
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        out = [0]
        for k in range(1, num_shards):
            target = k * self.total // num_shards
            if target >= self.total:
                out.append(self.total)
                continue
            e = self._entry_at(target)
            cut = e.offset + (target - e.offset) // e.itemsize * e.itemsize
            out.append(max(cut, out[-1]))
        out.append(self.total)
        return out

    def pieces(self, lo: int, hi: int) -> list[Piece]:
        """The non-empty tensor slices inside payload range ``[lo, hi)``, in payload order."""
        if lo >= hi:
            return []
        out = []
        i = max(bisect.bisect_right(self._offsets, lo) - 1, 0)
        for e in self.entries[i:]:
            if e.offset >= hi:
                break
            if e.nbytes and e.offset + e.nbytes > lo:
                out.append(Piece(e, max(lo, e.offset), min(hi, e.offset + e.nbytes)))
        return out


def safetensors_header(pieces: list[Piece], lo: int, metadata: dict[str, str]) -> bytes:
    """The 8-byte length prefix plus the padded JSON header of a shard file.

    The data section that follows is the payload range starting at ``lo``; the
    returned length is a multiple of 8 so the data starts aligned.
    """
    head: dict[str, Any] = {"__metadata__": metadata}
    for p in pieces:
        e = p.entry
        st = _ST_DTYPES.get(e.torch_dtype)
        whole = p.start == e.offset and p.end == e.offset + e.nbytes
        if st is None:
            b0, b1 = p.start - e.offset, p.end - e.offset
            name, st, shape = f"{e.name}[bytes {b0}:{b1}]", "U8", [b1 - b0]
        elif whole:
            name, shape = e.name, list(e.shape)
        else:
            e0, e1 = (p.start - e.offset) // e.itemsize, (p.end - e.offset) // e.itemsize
            name, shape = f"{e.name}[{e0}:{e1}]", [e1 - e0]
        if name in head:
            raise ValueError(f"two tensor slices would share the safetensors name {name!r}")
        head[name] = {"dtype": st, "shape": shape, "data_offsets": [p.start - lo, p.end - lo]}
    raw = json.dumps(head, separators=(",", ":")).encode()
    raw += b" " * (-(len(raw) + 8) % 8)
    return struct.pack("<Q", len(raw)) + raw

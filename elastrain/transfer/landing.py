"""Where a receiver puts incoming heal bytes before they are verified and installed.

Every entry lands in its own fresh tensor (allocated only after the manifest
passed the receiver's `NamedState.bound`); the tensors become live only through
`NamedState.install`, after every check passed, so a failed heal leaves the
live state untouched. Except in a heal run ``in_place`` (the trainers'): there
the entries the state names in `NamedState.live_targets` (torch: the model's
tensors) land straight in the live tensors, which saves the install's copy of
them, and a heal that fails once their receives are posted leaves the state
torn (`elastrain.transfer.errors.TornHeal`). Local; no communication.

Why not ``torch.empty``: a heal's receiver is usually a process that has just
started, so its landing memory has never been touched, and the kernel faults
it in one 4 KiB page at a time as gloo's receive thread writes it. That fault
storm cost the receiver about as much as the copy out of the socket (a plain
gloo broadcast into fresh memory ran at half the rate of one into memory
touched before). An entry of at least `HUGE_PAGE` bytes therefore gets its own
anonymous mapping, aligned to a huge page and advised ``MADV_HUGEPAGE``: the
kernel then faults it in 2 MiB at a time (where transparent huge pages are
``madvise`` or ``always``; elsewhere this is an ordinary mapping). Its tensor
is exactly the entry's bytes (its storage is no larger), and the mapping is
unmapped when the last tensor over it is freed.

A `LandingReserve` goes one step further for a member that knows it will be
healed (a joiner whose peers are ahead): it maps and touches its landing
while it waits to be admitted, off the recovery's critical path, and the heal
lands in memory that is already resident. First touch is not only page
faults: on a virtual machine whose host takes back the memory a guest freed,
touching 40 MB of it measured 100-320 ms here, against 7 ms once resident.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from elastrain.threads import LANDING, name_native_thread
from elastrain.transfer.chunks import Chunk
from elastrain.transfer.dtypes import byte_view, dtype_from_name
from elastrain.transfer.manifest import Entry

HUGE_PAGE = 2 * 1024 * 1024
"""Entries of at least this many bytes land in huge-page-advised memory."""
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)


_ALIGN = 64
"""Each entry in a shared mapping starts on this boundary (any dtype's alignment)."""


def _section(name: str) -> str:
    return name.split("/", 1)[0]


def _huge_region(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """A fresh anonymous mapping of at least ``nbytes`` advised huge pages, and the
    offset in it of its first huge-page boundary; None where huge pages cannot be
    advised (not Linux), ``nbytes`` is less than one huge page or the mapping
    cannot be made (the caller falls back to ``torch.empty``)."""
    if nbytes < HUGE_PAGE or _MADV_HUGEPAGE is None:
        return None
    # One huge page more than needed, so the bytes can start on a boundary; the
    # pages before it are never touched, so they never become resident.
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:
        return None  # torch.empty then fails (out of memory) with the RuntimeError callers expect
    try:
        region.madvise(_MADV_HUGEPAGE)
    except OSError:
        pass  # transparent huge pages are off here: an ordinary mapping still works
    base = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    return region, (-base) % HUGE_PAGE


def fresh_bytes(nbytes: int) -> torch.Tensor:
    """A new writable uint8 tensor of ``nbytes`` bytes (contents undefined), in
    huge-page-advised memory when it is at least `HUGE_PAGE` bytes."""
    got = _huge_region(nbytes)
    if got is None:
        return torch.empty(nbytes, dtype=torch.uint8)
    region, at = got
    # torch.frombuffer keeps the mapping alive as long as the tensor.
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=at)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def section_bytes(entries: Iterable[tuple[str, int]]) -> dict[str, int]:
    """Landing bytes per section for entries given as ``(name, nbytes)``: what
    `Landing.allocate` maps for them (each entry padded to its alignment)."""
    out: dict[str, int] = {}
    for name, nbytes in entries:
        out[_section(name)] = out.get(_section(name), 0) + _padded(nbytes)
    return out


@dataclass(frozen=True)
class _Region:
    """``nbytes`` usable bytes of ``mapping``, from the huge-page boundary ``base``."""

    mapping: mmap.mmap
    base: int
    nbytes: int


TOUCH_CHUNK = 64 * 1024 * 1024
"""The reserve's toucher checks between chunks of this many bytes whether the heal
has come (`LandingReserve.take`): the pages it has not reached by then are
faulted in by the payload itself, as without a reserve."""


def _touch_pages(chunk: torch.Tensor) -> None:
    """Write one byte of every page of ``chunk`` (page-aligned): a strided write
    faults each page in; torch drops the GIL for it."""
    chunk[:: mmap.PAGESIZE].fill_(0)


class LandingReserve:
    """Landing memory for one future heal, mapped and touched ahead of it.

    ``sizes`` are the bytes each section's entries are expected to need
    (`section_bytes` of `NamedState.landing_estimate`); a section under one huge
    page is not reserved (it lands in ordinary memory, cheaply). A background
    thread writes one byte of every page of each mapping, `TOUCH_CHUNK` at a
    time, so the pages are resident when the payload arrives. `Landing.allocate`
    takes a section's mapping when the manifest's entries of that section fit
    in it; a section that does not fit (the estimate was short) lands in fresh
    memory as without a reserve. Single use: a section's mapping is given away
    once, and its unused tail goes back to the kernel at that moment; `release`
    lets go of what no heal took. Local; no communication.
    """

    def __init__(self, sizes: Mapping[str, int]) -> None:
        self._regions: dict[str, _Region] = {}
        for section, nbytes in sizes.items():
            got = _huge_region(nbytes)
            if got is not None:
                self._regions[section] = _Region(got[0], got[1], nbytes)
        self.nbytes = sum(r.nbytes for r in self._regions.values())
        """Bytes reserved over every section."""
        self._stop = threading.Event()
        self._touched = threading.Thread(target=self._touch, name="elastrain-landing", daemon=True)
        self._touched.start()

    def _touch(self) -> None:
        name_native_thread(LANDING)
        for r in list(self._regions.values()):
            pages = torch.frombuffer(r.mapping, dtype=torch.uint8, count=r.nbytes, offset=r.base)
            for at in range(0, r.nbytes, TOUCH_CHUNK):
                if self._stop.is_set():
                    return
                _touch_pages(pages[at : at + TOUCH_CHUNK])

    def wait(self) -> None:
        """Block until every reserved page was touched."""
        self._touched.join()

    def _halt(self) -> None:
        """Stop the toucher after its current chunk, and wait for it: its writes
        must not race the payload's."""
        self._stop.set()
        self._touched.join()

    def take(self, section: str, nbytes: int) -> _Region | None:
        """The section's mapping if it holds ``nbytes``, else None; either way the
        section is no longer reserved. The toucher stops first: a heal does not
        wait for pages it has not reached (the payload faults them in)."""
        self._halt()
        r = self._regions.pop(section, None)
        if r is None or r.nbytes < nbytes:
            return None
        end = -(-(r.base + nbytes) // mmap.PAGESIZE) * mmap.PAGESIZE
        if end < len(r.mapping):
            try:  # the estimate's surplus goes back now, not when the state dies
                r.mapping.madvise(mmap.MADV_DONTNEED, end, len(r.mapping) - end)
            except (OSError, ValueError):
                pass  # only memory held longer
        return _Region(r.mapping, r.base, nbytes)

    def release(self) -> None:
        """Let go of every section no heal took (the member was not a receiver, or
        the manifest had no such section): the toucher stops, the mappings go."""
        self._halt()
        self._regions.clear()


def _allocate_section(
    entries: Sequence[Entry],
    out: dict[str, torch.Tensor],
    raw: dict[str, torch.Tensor],
    reserve: LandingReserve | None,
) -> None:
    """Fresh tensors for ``entries`` (one section) into ``out``, and a flat uint8 view
    of each into ``raw``; over one shared mapping if they add up to a huge page (the
    reserve's for the section, if it has one that fits): each tensor's storage is
    exactly its own bytes."""
    need = sum(_padded(e.nbytes) for e in entries)
    taken = (
        reserve.take(_section(entries[0].name), need) if reserve is not None and entries else None
    )
    got = (taken.mapping, taken.base) if taken is not None else _huge_region(need)
    at = 0
    for e in entries:
        dtype = dtype_from_name(e.dtype)
        if got is None or e.nbytes == 0:
            out[e.name] = torch.empty(tuple(e.shape), dtype=dtype)
            raw[e.name] = byte_view(out[e.name])
            continue
        mapping, base = got
        flat = torch.frombuffer(mapping, dtype=torch.uint8, count=e.nbytes, offset=base + at)
        out[e.name] = flat.view(dtype).reshape(tuple(e.shape))
        raw[e.name] = flat
        at += _padded(e.nbytes)


@dataclass(frozen=True)
class Landing:
    """One fresh tensor per manifest entry, by entry name (``tensors``), and a flat
    uint8 view of each over the same bytes (``raw``: what the payload is written
    through, made once rather than per message)."""

    tensors: dict[str, torch.Tensor]
    raw: dict[str, torch.Tensor]
    in_place: bool = False
    """Some entry lands in a live tensor of the receiver's state (`NamedState.live_targets`):
    once its receive is posted, a failed heal leaves that state torn."""
    planned: dict[tuple[int, int], list[tuple[Chunk, torch.Tensor]]] = field(default_factory=dict)
    """Receives laid out ahead, by payload range ``(offset, nbytes)``: each message of
    that range (`plan_chunks`) with the buffer it lands in (`PreparedReceive`). Each is
    taken by one receive of its range (`elastrain.transfer.payload.post_range`)."""

    @classmethod
    def allocate(
        cls,
        entries: Sequence[Entry],
        reserve: LandingReserve | None = None,
        live: Mapping[str, torch.Tensor] | None = None,
    ) -> Landing:
        """Tensors for ``entries``: ``live[name]`` itself where given (the receiver's own
        tensor, landed in place), else fresh; the fresh entries of one section (the
        first segment of their names: ``model``, ``optim``, ``obj`` for torch) share
        one huge-page-advised mapping (``reserve``'s for that section when it has
        one that fits), unmapped once none of its tensors is alive, so what
        `NamedState.install` copies and drops goes back as a whole when the heal
        ends."""
        live = live or {}
        tensors: dict[str, torch.Tensor] = {}
        raw: dict[str, torch.Tensor] = {}
        run: list[Entry] = []
        for e in entries:
            if e.name in live:
                tensors[e.name] = live[e.name]
                raw[e.name] = byte_view(live[e.name])
                continue
            if run and _section(run[0].name) != _section(e.name):
                _allocate_section(run, tensors, raw, reserve)
                run = []
            run.append(e)
        _allocate_section(run, tensors, raw, reserve)
        if reserve is not None:  # a section wholly in place takes nothing: let it go now
            reserve.release()
        return cls(tensors, raw, bool(live))

    def target(self, entry: Entry, offset: int, nbytes: int) -> torch.Tensor:
        """The writable uint8 view for payload bytes ``[offset, offset + nbytes)`` of ``entry``."""
        rel = offset - entry.offset
        return self.raw[entry.name][rel : rel + nbytes]

"""Tests for elastrain.transfer: signatures, manifests, seals, bounds, the striped heal.

Unit tests run in this process. Heal tests run every rank either as a thread of
this process (fast; for edge cases) or as its own process (the real thing: one
gloo group across 3 processes, the master TCPStore on port 0 in the test
process). The processes come from ``python tests/test_transfer.py WORLD PORT DIR``,
which imports torch once and forks one process per rank; teardown kills its whole
session. Results come back as JSON files, never pickles.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import itertools
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

import elastrain.transfer.chunks as chunks
import elastrain.transfer.landing as landing
import elastrain.transfer.payload as payload
import elastrain.transfer.striped as striped
from elastrain.transfer import (
    HealAuth,
    HealError,
    HealStats,
    PreparedSend,
    TorchState,
    heal,
    model_signature,
    signature_mismatch,
    state_hash,
)
from elastrain.transfer.dtypes import byte_view, dtype_from_name, dtype_name
from elastrain.transfer.flatten import flatten_state
from elastrain.transfer.landing import Landing, LandingReserve, section_bytes
from elastrain.transfer.manifest import (
    Manifest,
    Stripe,
    build_manifest,
    decode_manifest,
    encode_entries,
    encode_manifest,
    for_heal,
    plan_stripes,
    stripe_senders,
    validate_manifest,
)
from elastrain.transfer.seal import (
    SEAL_BYTES,
    STRIPE_SEAL_BYTES,
    check_seal,
    open_manifest,
    seal_manifest,
    seal_stripe,
)
from elastrain.transfer.tamper import HUGE_OPTIM_BYTES, LIES, TIB, Tamper

REPO = Path(__file__).resolve().parent.parent
GROUP_TIMEOUT = datetime.timedelta(seconds=20)
KEY = b"job-token"

# ---------------------------------------------------------------- models used everywhere


class Net(torch.nn.Module):
    """Small model with float, int64 (BatchNorm), bool and 0-dim bfloat16 state."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, 4)
        self.register_buffer("scale", torch.tensor(1.5, dtype=torch.bfloat16))
        self.register_buffer("mask", torch.tensor([True, False, True, True]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.fc2(torch.relu(self.bn(self.fc1(x))))
        return out * self.scale.float() * self.mask.float()


def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=g), torch.randn(32, 4, generator=g)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    x, y = batch(seed)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def trained(width: int = 16, steps: int = 3) -> tuple[Net, torch.optim.Adam]:
    """The up-to-date state: identical in every process that calls this."""
    torch.manual_seed(0)
    model = Net(width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.85, 0.99))
    for s in range(steps):
        train_step(model, opt, s)
    with torch.no_grad():
        model.get_buffer("scale").fill_(0.75)
    return model, opt


def fresh(width: int = 16) -> tuple[Net, torch.optim.Adam]:
    """A joiner: different init, different hyperparameters, no optimizer state."""
    torch.manual_seed(1234)
    model = Net(width)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


# ---------------------------------------------------------------- signatures and hashes


def test_signature_is_json_and_equal() -> None:
    sig = model_signature(Net())
    assert json.loads(json.dumps(sig)) == sig
    assert sig[0] == ["scale", [], "torch.bfloat16"]  # own buffers come before submodules
    assert ["fc1.weight", [16, 8], "torch.float32"] in sig
    assert ["bn.num_batches_tracked", [], "torch.int64"] in sig
    assert signature_mismatch(sig, json.loads(json.dumps(sig))) is None


def test_signature_mismatch_messages() -> None:
    sig = model_signature(Net())
    wide = model_signature(Net(width=17))
    msg = signature_mismatch(sig, wide)
    assert msg is not None and "'fc1.weight'" in msg and "[16, 8]" in msg and "[17, 8]" in msg

    other_dtype = [list(e) for e in sig]
    other_dtype[1][2] = "torch.uint8"
    msg = signature_mismatch(sig, other_dtype)
    assert msg is not None and "'mask'" in msg and "torch.uint8" in msg and "dtype" in msg

    msg = signature_mismatch(sig, sig + [["extra.bias", [3], "torch.float32"]])
    assert msg is not None and "'extra.bias'" in msg and "missing from the local" in msg
    msg = signature_mismatch(sig + [["extra.bias", [3], "torch.float32"]], sig)
    assert msg is not None and "'extra.bias'" in msg and "extra in the local" in msg
    msg = signature_mismatch(sig[1:], sig)
    assert msg is not None and "'scale'" in msg and "missing" in msg
    msg = signature_mismatch([sig[1], sig[0]] + sig[2:], sig)
    assert msg is not None and "different order" in msg


def test_dtype_names_round_trip() -> None:
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool):
        assert dtype_from_name(dtype_name(d)) is d
    assert byte_view(torch.tensor(1.0)).tolist() == [0, 0, 128, 63]


def test_state_hash_equal_for_identical_state_and_sensitive() -> None:
    a, b = trained(), trained()
    h = state_hash(*a)
    assert h == state_hash(*b)
    with torch.no_grad():
        b[0].get_buffer("bn.running_var")[3] += 1e-6
    assert state_hash(*b) != h
    c = trained()
    c[1].param_groups[0]["lr"] = 0.02
    assert state_hash(*c) != h
    d = trained()
    d[1].state[d[0].fc2.bias]["exp_avg_sq"][0] += 1.0
    assert state_hash(*d) != h


def test_state_hash_speed_120mb() -> None:
    model = torch.nn.Linear(2048, 2048 * 7)  # ~117 MB of float32
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state_hash(model, opt)
    t0 = time.perf_counter()
    state_hash(model, opt)
    elapsed = time.perf_counter() - t0
    print(f"state_hash: 117 MB in {elapsed * 1e3:.0f} ms")
    assert elapsed < 1.0  # the target is < 0.3 s; loose here for loaded CI machines


# ---------------------------------------------------------------- manifests and checksums


def _manifest(senders: list[int] = [0, 1]) -> Manifest:  # noqa: B006 - read-only default
    model, opt = trained()
    flat = flatten_state(model, opt)
    m = build_manifest("torch", flat.tensors, flat.section, senders, {"step": 3}, heal_id=7)
    return decode_manifest(encode_manifest(m))


def test_manifest_round_trip_validates() -> None:
    m = _manifest()
    validate_manifest(m, [0, 1])
    joiner = TorchState(*fresh())
    assert joiner.bound(m) is None and joiner.check(m) is None
    assert m.kind == "torch"
    assert m.meta == {"step": 3}
    assert m.entries[0].name == "model/scale"
    assert any(e.name.startswith("optim/0/") for e in m.entries)
    assert sum(s.nbytes for s in m.stripes) == m.total_bytes
    assert abs(m.stripes[0].nbytes - m.stripes[1].nbytes) <= 1


def test_a_manifest_from_a_layout_prepared_ahead_is_the_one_built_at_the_heal() -> None:
    """`PreparedSend`'s root lays its state out (and encodes its entries) before the
    heal and builds the heal's manifest from that with `for_heal`: the same manifest,
    the same bytes on the wire, as laying the tensors out at the heal."""
    model, opt = trained()
    flat = flatten_state(model, opt)
    layout = build_manifest("torch", flat.tensors, flat.section, [0], {}, 0)
    args = (flat.section, [2, 0, 1], {"step": 3}, 9)
    for auth, least in ((HealAuth.DIGEST, 0), (HealAuth.MAC, 1 << 30)):
        want = build_manifest("torch", flat.tensors, *args, auth=auth, min_stripe_bytes=least)
        got = for_heal(layout, [2, 0, 1], {"step": 3}, 9, auth=auth, min_stripe_bytes=least)
        assert got == want
        data = encode_manifest(got, encode_entries(layout.entries))
        assert data == encode_manifest(want)
        assert decode_manifest(data) == want


def test_manifest_that_lies_about_sizes_is_rejected() -> None:
    m = _manifest()
    e0 = m.entries[0]
    lie = dataclasses.replace(
        m, entries=(dataclasses.replace(e0, nbytes=e0.nbytes + 4),) + m.entries[1:]
    )
    with pytest.raises(
        HealError,
        match=r"entry 'model/scale' claims 6 bytes but shape \[\] of torch.bfloat16 is 2",
    ):
        validate_manifest(lie, [0, 1])

    e1 = m.entries[1]
    gap = dataclasses.replace(
        m, entries=(e0, dataclasses.replace(e1, offset=e1.offset + 8)) + m.entries[2:]
    )
    with pytest.raises(HealError, match="must be contiguous"):
        validate_manifest(gap, [0, 1])

    short = dataclasses.replace(m, total_bytes=m.total_bytes + 1)
    with pytest.raises(HealError, match="total_bytes"):
        validate_manifest(short, [0, 1])

    raw = json.loads(encode_manifest(m))
    raw["entries"][0]["nbytes"] = "512"
    with pytest.raises(HealError, match="malformed manifest"):
        decode_manifest(json.dumps(raw).encode())
    with pytest.raises(HealError, match="not JSON"):
        decode_manifest(b"\x80garbage")


def test_stripe_gap_and_overlap_are_rejected() -> None:
    m = _manifest()
    s0, s1 = m.stripes
    gap = dataclasses.replace(m, stripes=(dataclasses.replace(s0, nbytes=s0.nbytes - 5), s1))
    with pytest.raises(HealError, match="gap of 5 bytes before the stripe of sender 1"):
        validate_manifest(gap, [0, 1])
    overlap = dataclasses.replace(m, stripes=(s0, dataclasses.replace(s1, offset=s1.offset - 3)))
    with pytest.raises(HealError, match="sender 1 overlaps the previous one by 3 bytes"):
        validate_manifest(overlap, [0, 1])
    with pytest.raises(HealError, match=r"told senders=\[1, 0\]"):
        validate_manifest(m, [1, 0])


def test_a_small_payload_comes_from_one_sender_and_a_large_one_is_striped() -> None:
    """`stripe_senders`: a stripe per sender only once each gets min_stripe_bytes; the
    senders left out keep empty stripes at the end, so the manifest still tiles."""
    mib = 1 << 20
    assert [stripe_senders(n * mib, 3, 64 * mib) for n in (0, 40, 127, 128, 191, 192, 900)] == [
        1, 1, 1, 2, 2, 3, 3,
    ]  # fmt: skip
    assert stripe_senders(40 * mib, 3, 0) == 3  # 0: every sender, as before
    with pytest.raises(ValueError, match="at least one sender"):
        stripe_senders(mib, 0, 64 * mib)
    one = plan_stripes(40 * mib, [4, 5, 6], 64 * mib)
    assert [(s.sender_rank, s.offset, s.nbytes) for s in one] == [
        (4, 0, 40 * mib), (5, 40 * mib, 0), (6, 40 * mib, 0),
    ]  # fmt: skip
    two = plan_stripes(128 * mib + 1, [4, 5, 6], 64 * mib)
    assert [s.nbytes for s in two] == [64 * mib + 1, 64 * mib, 0]
    m = build_manifest("torch", [("model/w", torch.zeros(1000))], {}, [0, 1], {}, 1,
                       min_stripe_bytes=64 * mib)  # fmt: skip
    validate_manifest(m, [0, 1])  # empty stripes are well-formed
    assert [s.nbytes for s in m.stripes] == [4000, 0]


def test_manifest_checks_against_local_model_and_optimizer() -> None:
    m = _manifest()
    wide = Net(width=17)
    assert "'fc1.weight' has shape" in str(
        TorchState(wide, torch.optim.Adam(wide.parameters())).check(m)
    )
    net = Net()
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    assert "senders use torch.optim.adam.Adam" in str(TorchState(net, sgd).check(m))
    two_groups = torch.optim.Adam(
        [{"params": list(net.fc1.parameters())}, {"params": list(net.fc2.parameters())}]
    )
    assert "param groups" in str(TorchState(net, two_groups).check(m))


def test_plan_chunks_direct_split_and_packed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunks, "DIRECT_MIN", 16)
    monkeypatch.setattr(chunks, "DIRECT_MAX", 40)
    monkeypatch.setattr(chunks, "PACK_MAX", 24)
    sizes = {"a": 4, "b": 8, "c": 100, "d": 4, "e": 30}
    tensors = [(f"model/{k}", torch.zeros(n, dtype=torch.int8)) for k, n in sizes.items()]
    m = build_manifest("torch", tensors, {}, [0, 1], {}, 1)

    def layout(stripe: Stripe) -> list[tuple[bool, list[tuple[int, int, int]]]]:
        plan = chunks.plan_chunks(m.entries, stripe)
        return [(c.packed, [(p.entry, p.offset, p.nbytes) for p in c.pieces]) for c in plan]

    assert layout(Stripe(0, 0, 146)) == [
        (True, [(0, 0, 4), (1, 4, 8)]),
        (False, [(2, 12, 40)]),
        (False, [(2, 52, 40)]),
        (False, [(2, 92, 20)]),
        (False, [(3, 112, 4)]),
        (False, [(4, 116, 30)]),
    ]
    assert layout(Stripe(1, 50, 70)) == [
        (False, [(2, 50, 40)]),
        (False, [(2, 90, 22)]),
        (True, [(3, 112, 4), (4, 116, 4)]),
    ]
    assert (
        chunks.data_tag(chunks.MAX_HEAL_ID, chunks.MAX_CHUNKS - 1)
        < chunks.seal_tag(chunks.MAX_HEAL_ID)
        < 2**31
    )


def test_stripe_seal_is_keyed_and_bound_to_heal_sender_and_range() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    heal_seal = bytes(range(SEAL_BYTES))
    st = Stripe(4, 1000, 100)
    seal = seal_stripe(KEY, heal_seal, st, [data])
    assert len(seal) == STRIPE_SEAL_BYTES
    assert seal_stripe(KEY, heal_seal, st, [data[:30], data[30:]]) == seal  # chained
    check_seal(seal, seal, st)
    others = [
        seal_stripe(b"not-the-token", heal_seal, st, [data]),  # another key
        seal_stripe(None, heal_seal, st, [data]),  # no key
        seal_stripe(KEY, bytes(SEAL_BYTES), st, [data]),  # another heal
        seal_stripe(KEY, heal_seal, Stripe(5, 1000, 100), [data]),  # another sender
        seal_stripe(KEY, heal_seal, Stripe(4, 1100, 100), [data]),  # another offset
        seal_stripe(KEY, heal_seal, st, [data.flip(0)]),  # other bytes
    ]
    assert len({seal, *others}) == 1 + len(others)
    with pytest.raises(HealError, match=r"seal mismatch on the stripe from sender rank 4 .*1000"):
        check_seal(others[0], seal, st)


def test_manifest_seal_is_keyed_and_bound_to_the_round() -> None:
    data = encode_manifest(_manifest())
    sealed = data + seal_manifest(KEY, (7, 8, 9), 0, data)
    assert open_manifest(KEY, (7, 8, 9), 0, sealed) == data
    for key, nonces, root, blob in (
        (b"other", (7, 8, 9), 0, sealed),
        (KEY, (7, 8, 10), 0, sealed),  # an earlier round's manifest, replayed
        (KEY, (7, 8, 9), 1, sealed),  # from another root
        (KEY, (7, 8, 9), 0, sealed[:10] + b"X" + sealed[11:]),
        (KEY, (7, 8, 9), 0, sealed[:5]),
    ):
        with pytest.raises(HealError, match="seal of the manifest from rank"):
            open_manifest(key, nonces, root, blob)


def test_heal_stats_rate() -> None:
    assert HealStats("recv", 50_000_000, 0.5).rate_mb_s == pytest.approx(100.0)
    assert HealStats("idle", 0, 0.0).rate_mb_s == 0.0


def test_bad_arguments_raise_before_communicating() -> None:
    class FakeGroup:
        def size(self) -> int:
            return 3

        def rank(self) -> int:
            return 0

    model, opt = fresh()
    for senders, receivers in (([], [1]), ([0, 0], [1]), ([0], [0]), ([0], [3])):
        with pytest.raises(ValueError):
            heal(FakeGroup(), 0, senders, receivers, TorchState(model, opt), None, 5.0)
    with pytest.raises(ValueError, match="process group says"):
        heal(FakeGroup(), 1, [0], [1], TorchState(model, opt), None, 5.0)


# ---------------------------------------------------------------- landing


def _mapped(addr: int) -> bool:
    """Whether ``addr`` lies in a mapping of this process (Linux /proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return True
    return False


def test_landing_gives_each_entry_exactly_its_bytes_one_mapping_per_section() -> None:
    tensors = [
        ("model/w", torch.zeros(1024, 1024)),  # 4 MiB
        ("model/h", torch.zeros(3, dtype=torch.float16)),  # 6 bytes: unaligned after it
        ("model/d", torch.zeros((), dtype=torch.float64)),
        ("model/e", torch.zeros(0)),
        ("optim/0/exp_avg", torch.zeros(1024, 1024)),
        ("optim/0/step", torch.zeros(())),
        ("obj/o/x", torch.zeros(4, dtype=torch.int64)),  # a small section: torch.empty
    ]
    m = build_manifest("torch", tensors, {}, [0], {}, 1)
    land = Landing.allocate(m.entries)
    for i, (name, want) in enumerate(tensors):
        got = land.tensors[name]
        assert (got.dtype, got.shape, got.is_contiguous()) == (want.dtype, want.shape, True)
        # Its own storage, no larger than its bytes: torch.save and DCP write just these.
        assert got.untyped_storage().nbytes() == want.nbytes, name
        if want.numel():
            assert got.data_ptr() % 64 == 0, name
        # Written as the payload writes it: through the entry's target view.
        e = m.entries[i]
        land.target(e, e.offset, e.nbytes).fill_(i + 1)
    for i, (name, _) in enumerate(tensors):  # each tensor holds what its view wrote, no more
        assert bool((byte_view(land.tensors[name]) == i + 1).all()), name
    if landing._MADV_HUGEPAGE is None or not Path("/proc/self/maps").exists():
        return
    w, o = land.tensors["model/w"], land.tensors["optim/0/exp_avg"]
    assert w.data_ptr() % landing.HUGE_PAGE == 0 and o.data_ptr() % landing.HUGE_PAGE == 0
    assert land.tensors["model/h"].data_ptr() == w.data_ptr() + w.nbytes  # one mapping
    assert land.tensors["optim/0/step"].data_ptr() == o.data_ptr() + o.nbytes
    # The model's mapping goes once its tensors are dropped (install copies them),
    # while the optimizer's stays as long as any of its tensors is alive.
    w_at, step = w.data_ptr(), land.tensors["optim/0/step"]
    del w, o, land
    assert not _mapped(w_at)
    assert _mapped(step.data_ptr()) and float(step) != 0.0


def test_landing_falls_back_to_torch_empty_when_no_mapping_can_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*args: Any, **kw: Any) -> Any:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(landing.mmap, "mmap", refuse)
    m = build_manifest("torch", [("optim/0/a", torch.zeros(1024, 1024))], {}, [0], {}, 1)
    got = Landing.allocate(m.entries).tensors["optim/0/a"]
    assert got.shape == (1024, 1024) and got.untyped_storage().nbytes() == 4 << 20
    assert landing.fresh_bytes(landing.HUGE_PAGE).numel() == landing.HUGE_PAGE


def _resident(addr: int) -> int:
    """Resident bytes of the mapping of this process that holds ``addr`` (smaps Rss)."""
    hit = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = lo <= addr < hi
        elif hit and head == "Rss:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"{addr:#x} is not mapped")


def _region_start(reserve: LandingReserve, section: str) -> int:
    r = reserve._regions[section]  # the address only; the test does not touch it
    return torch.frombuffer(r.mapping, dtype=torch.uint8, count=1, offset=r.base).data_ptr()


@pytest.mark.skipif(
    landing._MADV_HUGEPAGE is None or not Path("/proc/self/smaps").exists(),
    reason="needs Linux mappings",
)
def test_landing_reserve_is_resident_before_the_heal_and_gives_back_its_surplus() -> None:
    mib = 1 << 20
    reserve = LandingReserve({"optim": 16 * mib, "obj": 4096})  # obj: too small to map
    reserve.wait()
    assert reserve.nbytes == 16 * mib
    at = _region_start(reserve, "optim")
    assert _resident(at) >= 16 * mib  # touched in the background, before any heal
    m = build_manifest("torch", [("optim/0/a", torch.zeros(mib // 4))], {}, [0], {}, 1)
    land = Landing.allocate(m.entries, reserve)
    assert land.tensors["optim/0/a"].data_ptr() == at  # landed in the reserved pages
    # Only what the entries use stays resident (the estimate's surplus went back);
    # 2 MiB: a huge page may hold the tail of the used part.
    assert _resident(at) <= 3 * mib
    with pytest.raises(KeyError):
        _region_start(reserve, "optim")  # single use


@pytest.mark.skipif(landing._MADV_HUGEPAGE is None, reason="needs huge-page mappings")
def test_a_heal_does_not_wait_for_pages_the_toucher_has_not_reached(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    started, go = threading.Event(), threading.Event()
    chunks_touched: list[int] = []

    def held(chunk: torch.Tensor) -> None:
        chunks_touched.append(chunk.numel())
        started.set()
        go.wait(30)

    monkeypatch.setattr(landing, "_touch_pages", held)
    monkeypatch.setattr(landing, "TOUCH_CHUNK", 2 << 20)
    reserve = LandingReserve({"optim": 8 << 20})  # four chunks to touch
    assert started.wait(30)
    got: list[Any] = []
    taker = threading.Thread(target=lambda: got.append(reserve.take("optim", 4 << 20)))
    taker.start()
    taker.join(0.2)
    assert taker.is_alive()  # the chunk being touched is not raced by the payload
    go.set()
    taker.join(30)
    assert got and got[0] is not None
    assert chunks_touched == [2 << 20]  # the toucher stopped there: the heal has come


def test_landing_reserve_too_small_for_a_section_lands_it_in_fresh_memory() -> None:
    reserve = LandingReserve({"optim": 2 << 20})
    m = build_manifest("torch", [("optim/0/a", torch.zeros(1 << 20))], {}, [0], {}, 1)  # 4 MiB
    land = Landing.allocate(m.entries, reserve)
    assert land.tensors["optim/0/a"].shape == (1 << 20,)
    assert reserve._regions == {}  # the short region was let go, not kept for later


def test_fresh_bytes_is_writable_and_huge_page_aligned() -> None:
    for n in (0, 1000, landing.HUGE_PAGE + 3):
        t = landing.fresh_bytes(n)
        assert (t.dtype, t.numel(), t.untyped_storage().nbytes()) == (torch.uint8, n, n)
        t.fill_(7)
        assert int(t.sum()) == 7 * n
    if landing._MADV_HUGEPAGE is not None:
        assert t.data_ptr() % landing.HUGE_PAGE == 0


# ---------------------------------------------------------------- heal, ranks as threads


def watch_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Bytes of every ``torch.empty`` call and every huge-page landing mapping from
    now on; a request over 1 GiB fails as an allocator out of memory would. The
    heal allocates through these only (the manifest buffer, the landing tensors,
    packed messages), so this shows what a lying sender made a receiver allocate.
    Build models before using it."""
    real, sizes = torch.empty, []  # type: ignore[var-annotated]
    real_region = landing._huge_region

    def empty(*size: Any, dtype: torch.dtype | None = None, **kw: Any) -> torch.Tensor:
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        n = math.prod(shape) * (dtype or torch.get_default_dtype()).itemsize
        sizes.append(n)
        if n > 1 << 30:
            raise RuntimeError(f"test allocator: refusing {n} bytes")
        return real(*size, dtype=dtype, **kw)

    def region(nbytes: int) -> Any:
        sizes.append(nbytes)
        if nbytes > 1 << 30:
            raise RuntimeError(f"test allocator: refusing a {nbytes}-byte mapping")
        return real_region(nbytes)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(landing, "_huge_region", region)
    return sizes


_GROUPS = itertools.count(1)
"""Numbers each `run_threads` group's store prefix."""


def run_threads(store: TCPStore, world: int, fn: Callable[[int, Any], Any]) -> list[Any]:
    """Run fn(rank, pg) on `world` threads sharing one gloo group; results or exceptions.

    Each call's group rendezvous under its own store prefix: a second group under
    the prefix of a first one on the same store would read the first one's keys
    and connect to its closed listeners (a hang, depending on timing)."""
    results: list[Any] = [None] * world
    prefix = f"gen{next(_GROUPS)}"

    def body(rank: int) -> None:
        try:
            client = TCPStore("127.0.0.1", store.port, is_master=False)
            pg = ProcessGroupGloo(PrefixStore(prefix, client), rank, world, GROUP_TIMEOUT)
            results[rank] = fn(rank, pg)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a heal thread hung"
    return results


def test_heal_threads_idle_rank_tensor_lr_and_sgd_state(master_store: TCPStore) -> None:
    def sgd(seed: int) -> tuple[Net, torch.optim.SGD]:
        torch.manual_seed(seed)
        m = Net()
        return m, torch.optim.SGD(m.parameters(), lr=torch.tensor(0.05), momentum=0.9)

    states = [sgd(0), sgd(0), sgd(9)]
    for s in range(2):
        train_step(*states[0], s)
    want = state_hash(*states[0])

    def fn(rank: int, pg: Any) -> tuple[dict[str, Any], HealStats]:
        model, opt = states[rank]
        meta = {"step": 2, "pair": (1, 2)} if rank == 0 else None
        return heal(pg, rank, [0], [2], TorchState(model, opt), meta, 10.0)

    res = run_threads(master_store, 3, fn)
    assert [type(r) for r in res] == [tuple] * 3, res
    assert res[0][1].role == "send" and res[1][1].role == "idle" and res[2][1].role == "recv"
    assert res[2][0] == {"step": 2, "pair": [1, 2]} == res[1][0]
    assert res[0][0] == {"step": 2, "pair": (1, 2)}
    assert res[0][1].bytes == res[2][1].bytes > 0
    assert state_hash(*states[2]) == want
    assert isinstance(states[2][1].param_groups[0]["lr"], torch.Tensor)
    assert state_hash(*states[1]) != want  # the idle rank was not touched


def test_heal_threads_fresh_senders_clear_receiver_state_and_empty_stripe(
    master_store: TCPStore,
) -> None:
    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(0))
            self.register_buffer("flag", torch.tensor(True))

    def make(flag: bool) -> tuple[Tiny, torch.optim.Adam]:
        m = Tiny()
        m.get_buffer("flag").fill_(flag)
        return m, torch.optim.Adam(m.parameters())

    states = [make(False), make(False), make(True)]
    states[2][1].state[states[2][0].w]["step"] = torch.tensor(5.0)  # stale state to be cleared
    want = state_hash(*states[0])

    def fn(rank: int, pg: Any) -> HealStats:
        return heal(pg, rank, [0, 1], [2], TorchState(*states[rank]), {}, 10.0)[1]

    res = run_threads(master_store, 3, fn)
    assert [r.bytes for r in res] == [1, 0, 1], res  # 1 byte total: sender 1's stripe is empty
    assert states[2][0].get_buffer("flag").item() is False
    assert len(states[2][1].state) == 0
    assert state_hash(*states[2]) == want


def test_heal_threads_direct_and_packed_messages(
    master_store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small thresholds so that the tiny model travels in every kind of message.
    monkeypatch.setattr(chunks, "DIRECT_MIN", 64)
    monkeypatch.setattr(chunks, "DIRECT_MAX", 200)
    monkeypatch.setattr(chunks, "PACK_MAX", 300)
    states = [trained(), trained(), fresh()]
    want = state_hash(*states[0])

    def fn(rank: int, pg: Any) -> HealStats:
        return heal(pg, rank, [0, 1], [2], TorchState(*states[rank]), {"step": 3}, 10.0)[1]

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, HealStats) for r in res), res
    assert state_hash(*states[2]) == want


def test_heal_threads_large_state_lands_in_mappings_and_saves_compactly(
    master_store: TCPStore,
) -> None:
    """Sections of megabytes land in shared huge-page mappings; the healed optimizer
    state is still one exact storage per tensor: it saves to the sender's size."""
    width = 1 << 16  # fc1: 2 MiB of weights, Adam state 2x the params
    states = [trained(width, steps=1), fresh(width)]
    want = state_hash(*states[0])

    def fn(rank: int, pg: Any) -> HealStats:
        return heal(pg, rank, [0], [1], TorchState(*states[rank]), {}, 20.0, key=KEY)[1]

    res = run_threads(master_store, 2, fn)
    assert all(isinstance(r, HealStats) for r in res), res
    assert state_hash(*states[1]) == want
    sizes = []
    for _, opt in states:
        buf = io.BytesIO()
        torch.save(opt.state_dict(), buf)
        sizes.append(len(buf.getvalue()))
    assert abs(sizes[1] - sizes[0]) < 4096, sizes
    train_step(*states[1], seed=9)  # the healed state trains like any other
    train_step(*states[0], seed=9)
    assert state_hash(*states[1]) == state_hash(*states[0])


def test_a_fresh_optimizers_state_is_estimated_for_the_classes_known() -> None:
    """Adam (with and without amsgrad) and SGD (with and without momentum): the
    estimate before the first step is the state after it, entry by entry (names and
    bytes, the step counter's included). Another class's state is not guessed."""
    for make in (
        lambda ps: torch.optim.Adam(ps),
        lambda ps: torch.optim.AdamW(ps, amsgrad=True),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
    ):
        torch.manual_seed(0)
        model = Net()
        opt = make(model.parameters())
        state = TorchState(model, opt)
        estimate = state.landing_estimate()
        train_step(model, opt, seed=1)
        held = [(n, t.nbytes) for n, t in state.flatten().tensors]
        assert sorted(estimate) == sorted(held), opt
        assert section_bytes(held) == section_bytes(estimate), opt
    model = Net()
    held = TorchState(model, torch.optim.RMSprop(model.parameters()))
    assert set(section_bytes(held.landing_estimate())) == {"model"}


@pytest.mark.skipif(landing._MADV_HUGEPAGE is None, reason="needs huge-page mappings")
def test_heal_threads_a_joiners_reserve_is_estimated_exactly_and_receives_the_state(
    master_store: TCPStore,
) -> None:
    """A fresh Adam's state is estimated before its first step as exactly what a heal
    brings; the heal lands model and optimizer in the reserve's touched pages, and
    the optimizer state lives on there."""
    width = 1 << 16  # 2 MiB of weights: every section is mapped
    states = [trained(width, steps=1), fresh(width)]
    want = state_hash(*states[0])
    joiner = TorchState(*states[1])
    sender_bytes = section_bytes((n, t.nbytes) for n, t in flatten_state(*states[0]).tensors)
    assert section_bytes(joiner.landing_estimate()) == sender_bytes
    reserve = LandingReserve(section_bytes(joiner.landing_estimate()))
    reserve.wait()
    start = {sec: _region_start(reserve, sec) for sec in ("model", "optim")}

    def fn(rank: int, pg: Any) -> HealStats:
        state = TorchState(*states[0]) if rank == 0 else joiner
        mine = reserve if rank == 1 else None
        return heal(pg, rank, [0], [1], state, {}, 20.0, key=KEY, reserve=mine)[1]

    res = run_threads(master_store, 2, fn)
    assert all(isinstance(r, HealStats) for r in res), res
    assert state_hash(*states[1]) == want
    model, opt = states[1]
    held = [t.data_ptr() for s in opt.state.values() for t in s.values() if t.numel() > 1]
    lo, hi = start["optim"], start["optim"] + sender_bytes["optim"]
    assert held and all(lo <= a < hi for a in held)
    train_step(*states[1], seed=9)  # the healed state trains like any other
    train_step(*states[0], seed=9)
    assert state_hash(*states[1]) == state_hash(*states[0])


def test_heal_threads_seal_mismatch_raises_and_leaves_receiver_intact(
    master_store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Senders seal through payload.seal_stripe, receivers through StripeSeal, so
    # corrupting the former fakes damage in flight.
    monkeypatch.setattr(payload, "seal_stripe", lambda *args: bytes(STRIPE_SEAL_BYTES))
    states = [trained(), trained(), fresh()]
    before = state_hash(*states[2])
    weight_before = states[2][0].fc1.weight.clone()

    def fn(rank: int, pg: Any) -> Any:
        return heal(
            pg, rank, [0, 1], [2], TorchState(*states[rank]), {"step": 3}, 10.0,
            auth=HealAuth.MAC,
        )  # fmt: skip

    res = run_threads(master_store, 3, fn)
    # Both senders' stripes were refused: nobody is left to send them again, and
    # every rank says so (the receiver names the first bad sender).
    assert all(isinstance(r, HealError) for r in res), res
    assert all("no sender is left to retry from (refused senders: [0, 1])" in str(r) for r in res)
    assert "seal mismatch on the stripe from sender rank 0" in str(res[2])
    assert state_hash(*states[2]) == before
    assert torch.equal(states[2][0].fc1.weight, weight_before)


def test_heal_threads_diverged_sender_aborts_everyone(master_store: TCPStore) -> None:
    states = [trained(), trained(width=12), fresh()]

    def fn(rank: int, pg: Any) -> Any:
        return heal(pg, rank, [0, 1], [2], TorchState(*states[rank]), {}, 10.0)

    t0 = time.perf_counter()
    res = run_threads(master_store, 3, fn)
    assert time.perf_counter() - t0 < 8
    assert isinstance(res[1], HealError) and "sender states differ" in str(res[1]), res
    for r in (0, 2):
        assert isinstance(res[r], HealError) and "rank(s) [1] rejected" in str(res[r]), res


def test_heal_threads_absent_sender_times_out(master_store: TCPStore) -> None:
    states = [trained(), fresh()]

    def fn(rank: int, pg: Any) -> Any:
        if rank == 0:  # a sender that never joins the heal (stuck elsewhere)
            time.sleep(1.5)
            return None
        t0 = time.perf_counter()
        try:
            heal(pg, rank, [0], [1], TorchState(*states[rank]), None, 0.5)
        except HealError as e:
            return e, time.perf_counter() - t0
        return None

    res = run_threads(master_store, 2, fn)
    err, elapsed = res[1]
    assert isinstance(err, HealError) and "manifest announcement all-reduce" in str(err), res
    assert "timeout_s=0.5" in str(err) and elapsed < 1.4


def test_heal_threads_unjsonable_meta_fails_everyone_fast(master_store: TCPStore) -> None:
    states = [trained(), fresh()]

    def fn(rank: int, pg: Any) -> Any:
        return heal(pg, rank, [0], [1], TorchState(*states[rank]), {"bad": object()}, 10.0)

    res = run_threads(master_store, 2, fn)
    assert isinstance(res[0], HealError) and "cannot build the manifest" in str(res[0])
    assert isinstance(res[1], HealError) and "could not build the manifest" in str(res[1])


# ---------------------------------------------------------------- hostile senders: refuse, retry


def test_tamper_damages_copies_repeatably() -> None:
    bufs = [torch.arange(10, dtype=torch.uint8), torch.arange(5, dtype=torch.uint8)]
    keep = [b.clone() for b in bufs]
    a, b = Tamper(flip=4, seed=3).stripe(bufs), Tamper(flip=4, seed=3).stripe(bufs)
    assert all(torch.equal(x, y) for x, y in zip(bufs, keep, strict=True))  # live bytes intact
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # seeded
    assert sum(int((x != y).sum()) for x, y in zip(a, keep, strict=True)) == 4
    assert Tamper().stripe(bufs) is bufs
    with pytest.raises(ValueError, match="one of"):
        Tamper(manifest="fib")


@pytest.mark.parametrize(
    "lie, needle",
    [
        ("more_bytes", r"claims \d+ bytes but shape"),
        ("fewer_bytes", r"claims \d+ bytes but shape"),
        ("dtype", r"claims \d+ bytes but shape .* of torch.float64"),
        ("shape", r"claims \d+ bytes but shape \[.*2\]"),
        ("total_bytes", "total_bytes"),
        ("truncated", "not JSON"),
    ],
)
def test_every_manifest_lie_is_caught_with_a_clear_message(lie: str, needle: str) -> None:
    assert lie in LIES
    data = encode_manifest(_manifest())
    with pytest.raises(HealError, match=needle):
        validate_manifest(
            decode_manifest(Tamper(manifest=lie, seed=1).manifest_bytes(data)), [0, 1]
        )


@pytest.mark.parametrize("auth", list(HealAuth))
def test_heal_threads_bad_stripe_is_refused_and_fetched_from_another_sender(
    master_store: TCPStore, auth: HealAuth, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small thresholds: the flipped bytes land in direct messages (written straight
    # into the receiver's landing buffer) as well as packed ones.
    monkeypatch.setattr(chunks, "DIRECT_MIN", 64)
    monkeypatch.setattr(chunks, "DIRECT_MAX", 200)
    monkeypatch.setattr(chunks, "PACK_MAX", 300)
    states = [trained(), trained(), fresh(), fresh()]
    want = state_hash(*states[0])

    def fn(rank: int, pg: Any) -> Any:
        tamper = Tamper(flip=40, seed=rank) if rank == 0 else None
        return heal(
            pg, rank, [0, 1], [2, 3], TorchState(*states[rank]), {"step": 3}, 10.0,
            tamper=tamper, auth=auth,
        )  # fmt: skip

    res = run_threads(master_store, 4, fn)
    assert all(isinstance(r, tuple) for r in res), res
    stats = [r[1] for r in res]
    assert all(st.refused == (0,) for st in stats)
    assert state_hash(*states[2]) == state_hash(*states[3]) == want == state_hash(*states[0])
    total = sum(t.nbytes for _, t in flatten_state(*states[2]).tensors)
    s0, s1 = stats[0].bytes // 2, stats[1].bytes // 2 - stats[0].bytes // 2
    assert abs(s0 - s1) <= 1 and s0 + s1 == total  # sender 1 sent its stripe and 0's
    assert stats[2].bytes == stats[3].bytes == total + s0


@pytest.mark.parametrize("flip", [0, 2])
def test_heal_threads_digest_mode_judges_the_bytes_and_the_claims(
    master_store: TCPStore, flip: int
) -> None:
    """Digest mode: a second sender without the token (forged key) whose bytes are
    right is not refused (what the digest checks is the bytes; the manifest, which
    only the token opens, came from the root). With its bytes damaged, its claim
    in the blame round does not verify: refused, its stripe fetched from the root."""
    states = [trained(), trained(), fresh()]
    want = state_hash(*states[1])

    def fn(rank: int, pg: Any) -> Any:
        tamper = Tamper(forge=True, flip=flip, seed=4) if rank == 0 else None
        return heal(
            pg, rank, [1, 0], [2], TorchState(*states[rank]), {}, 10.0, key=KEY, tamper=tamper
        )

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert all(r[1].refused == ((0,) if flip else ()) for r in res)
    assert state_hash(*states[2]) == want


def test_heal_threads_two_bad_senders_of_three(master_store: TCPStore) -> None:
    """Both refused stripes go to the one good sender: two ranges, one receiver, one round."""
    states = [trained(), trained(), trained(), fresh()]
    want = state_hash(*states[2])

    def fn(rank: int, pg: Any) -> Any:
        tamper = Tamper(flip=1, seed=rank) if rank in (0, 1) else None
        return heal(pg, rank, [0, 1, 2], [3], TorchState(*states[rank]), {}, 10.0, tamper=tamper)

    res = run_threads(master_store, 4, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert all(r[1].refused == (0, 1) for r in res)
    assert state_hash(*states[3]) == want
    total = sum(t.nbytes for _, t in flatten_state(*states[3]).tensors)
    assert res[2][1].bytes == total  # its own third plus the other two thirds again
    assert res[3][1].bytes == total + res[0][1].bytes + res[1][1].bytes


@pytest.mark.parametrize("lie", LIES)
def test_heal_threads_lying_manifest_root_is_replaced_by_the_next_sender(
    master_store: TCPStore, lie: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = [trained(), trained(), fresh()]
    want = state_hash(*states[1])
    sizes = watch_allocations(monkeypatch)

    def fn(rank: int, pg: Any) -> Any:
        tamper = Tamper(manifest=lie, seed=2) if rank == 0 else None
        meta = {"root": rank} if rank < 2 else None
        return heal(pg, rank, [0, 1], [2], TorchState(*states[rank]), meta, 10.0, tamper=tamper)

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert all(r[1].refused == (0,) for r in res)
    assert res[2][0] == {"root": 1}  # the meta of the sender that became root
    assert res[0][1].bytes == 0 and res[1][1].bytes == res[2][1].bytes > 0
    assert state_hash(*states[2]) == want
    # A claim of 1 TiB or 256 GiB was refused before anything was allocated for it.
    assert sizes and max(sizes) < 1 << 20


@pytest.mark.parametrize(
    "tamper",
    [
        Tamper(manifest="shape"),
        Tamper(manifest="truncated"),
        Tamper(manifest="huge_length"),
        Tamper(manifest="huge_optim"),
        Tamper(flip=1),
        Tamper(forge=True),
    ],
)
@pytest.mark.parametrize("auth", list(HealAuth))
def test_heal_threads_no_honest_sender_left_fails_loudly(
    master_store: TCPStore, tamper: Tamper, auth: HealAuth, monkeypatch: pytest.MonkeyPatch
) -> None:
    states = [trained(), fresh()]
    before = state_hash(*states[1])
    sizes = watch_allocations(monkeypatch)

    def fn(rank: int, pg: Any) -> Any:
        mine = tamper if rank == 0 else None
        return heal(
            pg, rank, [0], [1], TorchState(*states[rank]), {}, 20.0, key=KEY, tamper=mine,
            auth=auth,
        )  # fmt: skip

    t0 = time.perf_counter()
    res = run_threads(master_store, 2, fn)
    # Decided together: nobody waits out the 20 s deadline (before, a manifest that
    # was not JSON left the root waiting in the verdict until it).
    assert time.perf_counter() - t0 < 8
    assert all(isinstance(r, HealError) and "no sender is left" in str(r) for r in res), res
    why = {
        "shape": "claims",
        "truncated": "not JSON",
        "huge_length": f"rank 0 announced {TIB} manifest bytes",
        "huge_optim": f"claims {HUGE_OPTIM_BYTES // 4} elements; param",
        None: (
            "seal of the manifest from rank 0"
            if not tamper.flip
            else "seal mismatch on the stripe"
            if auth == HealAuth.MAC
            else "state digest mismatch"
        ),
    }
    assert why[tamper.manifest] in str(res[1])
    assert state_hash(*states[1]) == before
    assert max(sizes, default=0) < 1 << 20


def test_heal_threads_receiver_without_the_token_is_not_healed(master_store: TCPStore) -> None:
    """A rank holding another key verifies no manifest: every root is refused and the
    heal fails everywhere, its state untouched."""
    states = [trained(), trained(), fresh()]
    before = state_hash(*states[2])

    def fn(rank: int, pg: Any) -> Any:
        key = b"a guess" if rank == 2 else KEY
        return heal(pg, rank, [0, 1], [2], TorchState(*states[rank]), {}, 10.0, key=key)

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, HealError) and "no sender is left" in str(r) for r in res), res
    assert "seal of the manifest from rank 1 does not verify" in str(res[2])
    assert state_hash(*states[2]) == before


def test_bound_refuses_claims_beyond_the_receivers_layout() -> None:
    data = encode_manifest(_manifest())
    joiner = TorchState(*fresh())
    huge_optim = decode_manifest(Tamper(manifest="huge_optim", seed=1).manifest_bytes(data))
    validate_manifest(huge_optim, [0, 1])  # self-consistent: only the bound catches it
    assert f"claims {HUGE_OPTIM_BYTES // 4} elements; param" in str(joiner.bound(huge_optim))
    huge = decode_manifest(Tamper(manifest="huge_entry", seed=0).manifest_bytes(data))
    validate_manifest(huge, [0, 1])
    assert huge.total_bytes > TIB and joiner.bound(huge) is not None
    assert joiner.manifest_limit() < 1 << 30 and joiner.payload_limit() < 1 << 20
    assert joiner.bound(_manifest()) is None
    # Too many optimizer tensors for one param, and a tensor for a param that is not there.
    m = _manifest()
    e = next(x for x in m.entries if x.name == "optim/0/exp_avg")
    extra = tuple(dataclasses.replace(e, name=f"optim/0/x{i}") for i in range(8))
    section = json.loads(json.dumps(m.section))
    section["state"]["0"].update({f"x{i}": {"$tensor": f"optim/0/x{i}"} for i in range(8)})
    many = dataclasses.replace(m, entries=m.entries + extra, section=section)
    assert "more than 8 optimizer tensors for param 0" in str(joiner.bound(many))
    section = json.loads(json.dumps(m.section))
    section["state"]["99"] = {"a": {"$tensor": "optim/99/a"}}
    stray = dataclasses.replace(
        m, entries=m.entries + (dataclasses.replace(e, name="optim/99/a"),), section=section
    )
    assert "this optimizer has" in str(joiner.bound(stray))


# ---------------------------------------------------------------- heal across processes

# Every scenario runs in the same 3 worker processes, one fresh gloo group per
# scenario (store prefix gen1, gen2, ...), so torch is imported only 3 times.
SCENARIOS: dict[str, tuple[list[int], list[int]]] = {
    "two_senders": ([0, 1], [2]),
    "one_sender": ([0], [1, 2]),
    "mismatch": ([0, 1], [2]),  # rank 2 has a wider model
    "corrupt_stripe": ([0, 1], [2]),  # rank 0 flips bytes of its stripe on the wire
}
WORLD = 3
SENT_META = {"step": 3, "rng": [1, 2, 3], "pair": (4.5, None), "cursor": {"epoch": 0}}


@pytest.fixture(scope="module")
def process_results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, list[Any]]]:
    """Run the worker processes once; {scenario: [report of rank 0, 1, 2]}.

    One launcher process imports torch once and forks the 3 ranks (see `_launch`);
    it runs in its own session so that teardown can kill it and every rank.
    """
    out_dir = tmp_path_factory.mktemp("heal")
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, str(WORLD), str(store.port), str(out_dir)]
    log_path = out_dir / "workers.log"
    with open(log_path, "wb") as log:
        launcher = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        try:
            # A backstop only: heal and group timeouts end a real hang in ~30 s; the
            # rest is importing torch on a possibly busy machine.
            launcher.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"heal workers hung:\n{log_path.read_text()}")
        assert launcher.returncode == 0, f"workers failed:\n{log_path.read_text()}"
        yield {
            name: [json.loads((out_dir / f"{name}-rank{r}.json").read_text()) for r in range(WORLD)]
            for name in SCENARIOS
        }
    finally:
        try:
            os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's session: it and its ranks
        except ProcessLookupError:
            pass
        launcher.wait(timeout=10)
        del store


def _assert_healed(res: list[dict[str, Any]], senders: list[int], receivers: list[int]) -> None:
    for report in res:
        assert report["ok"], report
    want = res[senders[0]]["before"]
    assert all(res[s]["before"] == want for s in senders)
    for r in receivers:
        assert res[r]["before"] != want
        assert res[r]["after"] == want
        assert res[r]["meta"] == json.loads(json.dumps(SENT_META))
        assert res[r]["stats"]["role"] == "recv"
        assert res[r]["stats"]["bytes"] == res[r]["total_bytes"] > 0
        # The payload phase is a part of the call, not all of it: the manifest
        # rounds come before it and the install after it.
        assert 0 < res[r]["stats"]["payload_s"] < res[r]["stats"]["seconds"]
        assert res[r]["lr"] == 1e-2
    for s in senders:
        assert res[s]["meta"] == json.loads(json.dumps(SENT_META))
        assert res[s]["stats"]["role"] == "send"
    sent = sum(res[s]["stats"]["bytes"] for s in senders)
    assert sent == len(receivers) * res[receivers[0]]["stats"]["bytes"]
    # one more identical optimizer step keeps every rank bit-identical
    assert len({report["after_step"] for report in res}) == 1
    assert res[0]["after_step"] != want


def test_heal_processes_two_senders_one_receiver(process_results: dict[str, Any]) -> None:
    res = process_results["two_senders"]
    _assert_healed(res, senders=[0, 1], receivers=[2])
    s0, s1 = res[0]["stats"]["bytes"], res[1]["stats"]["bytes"]
    assert abs(s0 - s1) <= 1  # striped: each sender sent half


def test_heal_processes_one_sender_two_receivers(process_results: dict[str, Any]) -> None:
    _assert_healed(process_results["one_sender"], senders=[0], receivers=[1, 2])


def test_heal_processes_mismatched_receiver_fails_cleanly(process_results: dict[str, Any]) -> None:
    res = process_results["mismatch"]
    assert not any(r["ok"] for r in res), res
    assert res[2]["error_type"] == "HealError"
    assert "'fc1.weight' has shape [17, 8] locally but [16, 8] remotely" in res[2]["error"]
    for r in res[:2]:
        assert r["error_type"] == "HealError" and "rank(s) [2] rejected" in r["error"]
    assert max(r["seconds"] for r in res) < 5  # the verdict fails everyone fast, no timeout


def test_heal_processes_corrupt_stripe_is_fetched_from_the_other_sender(
    process_results: dict[str, Any],
) -> None:
    res = process_results["corrupt_stripe"]
    assert all(r["ok"] for r in res), res
    assert all(r["stats"]["refused"] == [0] for r in res)
    assert res[2]["before"] != res[0]["before"] == res[1]["before"] == res[2]["after"]
    assert res[0]["after"] == res[0]["before"]  # the tampering sender's own state is intact
    assert res[2]["stats"]["bytes"] == res[2]["total_bytes"] + res[0]["stats"]["bytes"]
    assert len({r["after_step"] for r in res}) == 1


# ---------------------------------------------------------------- worker process entry point


def _run_scenario(name: str, gen: int, rank: int, client: TCPStore, out_dir: Path) -> None:
    senders, receivers = SCENARIOS[name]
    if rank in senders:
        model, opt = trained()
    else:
        model, opt = fresh(width=17 if name == "mismatch" else 16)
    report: dict[str, Any] = {"rank": rank, "before": state_hash(model, opt)}
    pg = ProcessGroupGloo(PrefixStore(f"gen{gen}", client), rank, WORLD, GROUP_TIMEOUT)
    t0 = time.perf_counter()
    try:
        meta = SENT_META if rank in senders else None
        tamper = Tamper(flip=7, seed=5) if name == "corrupt_stripe" and rank == 0 else None
        state = TorchState(model, opt)
        got, stats = heal(pg, rank, senders, receivers, state, meta, 10.0, key=KEY, tamper=tamper)
    except Exception as e:  # noqa: BLE001 - reported to the test
        report.update(ok=False, error_type=type(e).__name__, error=str(e))
    else:
        report.update(
            ok=True,
            meta=got,
            stats=dataclasses.asdict(stats),
            after=state_hash(model, opt),
            total_bytes=sum(t.nbytes for _, t in flatten_state(model, opt).tensors),
            lr=opt.param_groups[0]["lr"],
        )
        train_step(model, opt, seed=99)
        report["after_step"] = state_hash(model, opt)
    report["seconds"] = time.perf_counter() - t0
    (out_dir / f"{name}-rank{rank}.json").write_text(json.dumps(report))


def _worker(rank: int, client: TCPStore, out_dir: Path) -> None:
    for gen, name in enumerate(SCENARIOS, start=1):
        _run_scenario(name, gen, rank, client, out_dir)


def _launch(world: int, port: int, out_dir: Path) -> int:
    """Import torch once, then fork one process per rank; exit status 0 iff all ranks succeed.

    Forking before any gloo group or store client exists is safe and saves each
    rank the seconds of importing torch (and torch._dynamo, which the first
    optimizer pulls in).
    """
    assert world == WORLD
    torch.set_num_threads(1)
    trained()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _worker(rank, TCPStore("127.0.0.1", port, is_master=False), out_dir)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(_launch(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])))


def test_heal_threads_prepared_senders_send_what_they_prepared_without_flattening_again(
    master_store: TCPStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The senders' flatten and layout and the root's digest, done ahead
    (`PreparedSend`, what the replicated topology begins at a generation's
    connect), are the heal's: the receiver gets the state bit for bit and no
    sender flattens or lays out its state again. A second sender's stripe (the
    state striped over both) comes from its preparation too."""
    states = [trained(), trained(), fresh()]
    want = state_hash(*states[0])
    sender_states = [TorchState(*states[0]), TorchState(*states[1])]
    prepared = [PreparedSend(sender_states[0]), PreparedSend(sender_states[1], root=False)]
    assert prepared[0].digesting() is not None and prepared[1].digesting() is None
    flattened: list[int] = []
    real = TorchState.flatten

    def counting(self: TorchState) -> Any:
        flattened.append(id(self))
        return real(self)

    monkeypatch.setattr(TorchState, "flatten", counting)
    laid_out = []
    real_build = striped.build_manifest

    def building(*a: Any, **k: Any) -> Any:
        laid_out.append(threading.current_thread().name)
        return real_build(*a, **k)

    monkeypatch.setattr(striped, "build_manifest", building)

    def fn(rank: int, pg: Any) -> Any:
        threading.current_thread().name = f"rank{rank}"
        state = sender_states[rank] if rank < 2 else TorchState(*states[2])
        return heal(
            pg, rank, [0, 1], [2], state, {"step": 3}, 10.0, key=KEY,
            prepared=prepared[rank] if rank < 2 else None,
        )  # fmt: skip

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert state_hash(*states[2]) == want
    assert not {id(s) for s in sender_states} & set(flattened)
    assert laid_out == []  # the root's manifest too comes from its preparation (`for_heal`)
    assert res[1][1].bytes > 0  # the second sender sent its stripe
    assert [r[1].prepared for r in res] == [True, True, False]
    st = res[2][1]
    assert st.rounds_s > 0 and st.payload_s > 0 and st.rounds_s + st.payload_s <= st.seconds


@pytest.mark.parametrize("senders", [[0, 1], [0]])
def test_heal_threads_a_state_written_after_its_preparation_is_never_installed(
    master_store: TCPStore, senders: list[int]
) -> None:
    """The contract of `PreparedSend` broken: the root's state written after it was
    prepared, so its digest is of the state before. The receiver's digest of what
    landed matches neither the root's sealed digest (the root's digest is the
    reference: a second sender's stripe is refused too), so the heal fails on
    every rank and the receiver keeps its own state (not in place: untouched)."""
    states = [trained(), trained(), fresh()]
    receiver_before = state_hash(*states[2])
    root_state = TorchState(*states[0])
    prepared = PreparedSend(root_state)
    digesting = prepared.digesting()
    assert digesting is not None
    digesting.result()
    with torch.no_grad():
        next(states[0][0].parameters()).add_(1.0)  # written after the preparation

    def fn(rank: int, pg: Any) -> Any:
        state = root_state if rank == 0 else TorchState(*states[rank])
        return heal(
            pg, rank, senders, [2], state, {"step": 3}, 10.0, key=KEY,
            prepared=prepared if rank == 0 else None,
        )  # fmt: skip

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, HealError) for r in res), res
    assert "digest" in str(res[2]) and "no sender is left" in str(res[2])
    assert state_hash(*states[2]) == receiver_before

"""Storage layer of durable checkpoints (elastrain.checkpoint); hermetic, in tmp dirs."""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import math
import os
import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import elastrain.checkpoint.files as files_mod
import elastrain.checkpoint.writer as writer_mod
from elastrain.checkpoint import (
    CheckpointConfig,
    CheckpointWriter,
    CommitError,
    Snapshot,
    apply_retention,
    commit,
    discard_newer,
    latest_verified,
    load,
    young_daly_interval,
)
from elastrain.checkpoint.files import (
    MARKER,
    DurableFile,
    read_signed_json,
    step_dir,
    write_signed_json,
)
from elastrain.checkpoint.layout import Layout
from elastrain.transfer.dtypes import byte_view

MEMBERS = ["w0", "w1", "w2"]


def make_state(seed: int = 0, n: int = 5000) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model/w": torch.randn(n, 7, generator=g),
        "model/wt": torch.randn(13, 11, generator=g).t(),  # non-contiguous
        "model/empty": torch.zeros(0, 4),
        "model/bf16": torch.randn(301, generator=g).to(torch.bfloat16),
        "optim/0/step": torch.tensor(17.0),
        "optim/0/count": torch.tensor(12345678901, dtype=torch.int64),
        "mask": torch.rand(9, 5, generator=g) > 0.5,
        "complex": torch.randn(6, dtype=torch.complex64, generator=g),
        "bytes": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
    }


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape, k
        assert torch.equal(byte_view(got[k]), byte_view(t)), k


def save(
    d: Path,
    step: int,
    state: dict[str, torch.Tensor],
    *,
    num_shards: int = 1,
    generation: int = 1,
    members: list[str] | None = None,
    shards: list[int] | None = None,
    do_commit: bool = True,
) -> None:
    """Every listed shard saved by its own writer (as members would), then committed."""
    members = members or MEMBERS[:num_shards]
    cfg = CheckpointConfig(directory=str(d))
    writers = [CheckpointWriter(cfg) for _ in range(num_shards)]
    handles = [
        writers[i].save_async(
            step,
            Snapshot.take(state, {"step": step}, shard=i, num_shards=num_shards),
            generation=generation,
            members=members,
        )
        for i in (range(num_shards) if shards is None else shards)
    ]
    assert all(h.wait(30).ok for h in handles)
    for w in writers:
        w.close()
    if do_commit:
        commit(d, step, generation=generation, members=members, num_shards=num_shards)


@pytest.mark.parametrize("num_shards", [1, 3])
def test_round_trip_bit_exact(tmp_path: Path, num_shards: int) -> None:
    state = make_state()
    meta = {"step": 7, "rng": {"seed": 1, "offset": [1, 2, 3]}, "loss": 0.25, "note": "é"}
    members = MEMBERS[:num_shards]
    snaps = [Snapshot.take(state, meta, shard=i, num_shards=num_shards) for i in range(num_shards)]
    assert sum(s.nbytes for s in snaps) == Layout.of(state).total  # striped, written once
    events: list[tuple[str, dict[str, Any]]] = []
    writers = [
        CheckpointWriter(
            CheckpointConfig(directory=str(tmp_path)), events=lambda k, f: events.append((k, f))
        )
        for _ in range(num_shards)
    ]
    results = [
        w.save_async(7, s, generation=3, members=members).wait(30)
        for w, s in zip(writers, snaps, strict=True)
    ]
    assert [r.status for r in results] == ["ok"] * num_shards
    assert [k for k, _ in events] == ["checkpoint_saved"] * num_shards
    assert latest_verified(tmp_path) is None  # not committed yet
    marker = commit(tmp_path, 7, generation=3, members=members, num_shards=num_shards)
    assert marker.name == MARKER
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and (ckpt.step, ckpt.generation, ckpt.members) == (7, 3, members)
    tensors, got_meta = load(ckpt)
    assert_same(tensors, state)
    assert got_meta == meta
    # commit is idempotent
    assert commit(tmp_path, 7, generation=3, members=members, num_shards=num_shards) == marker


def test_shard_files_are_safetensors(tmp_path: Path) -> None:
    st = pytest.importorskip("safetensors.torch")
    state = {"a": torch.arange(10, dtype=torch.float32), "b": torch.arange(16).view(4, 4)}
    save(tmp_path, 1, state, num_shards=2)
    files = sorted((tmp_path / "step-00000001").glob("*.safetensors"))
    parts = [st.load_file(str(f)) for f in files]
    assert torch.equal(parts[0]["a"], state["a"])  # 40 + 128 bytes: cut at 80
    assert torch.equal(torch.cat([parts[0]["b[0:5]"], parts[1]["b[5:16]"]]), state["b"].flatten())


def test_striping_cuts_on_element_boundaries() -> None:
    state = {"x": torch.zeros(3, dtype=torch.bool), "y": torch.zeros(1001), "z": torch.zeros(5)}
    lay = Layout.of(state)
    for n in (1, 2, 3, 7, 5000):
        b = lay.bounds(n)
        assert b[0] == 0 and b[-1] == lay.total and b == sorted(b) and len(b) == n + 1
        for cut in b[1:-1]:
            if 3 <= cut < 3 + 4004:
                assert (cut - 3) % 4 == 0
        if n <= 7:
            assert max(hi - lo for lo, hi in zip(b, b[1:], strict=False)) <= lay.total / n + 8


def _corrupt(kind: str, d: Path) -> str:
    """Damage checkpoint dir ``d``; returns the file name the warning must name."""
    shard = d / "shard-00001-of-00003.safetensors"
    if kind == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 5)
        return shard.name
    if kind == "flipped":
        with open(shard, "r+b") as f:
            f.seek(shard.stat().st_size - 100)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x10]))
        return shard.name
    if kind == "no_marker":
        (d / MARKER).unlink()
        return MARKER
    marker = read_signed_json(d / MARKER)
    marker["shards"][2]["size"] += 4
    if kind == "lying_size":  # re-signed: only the size check can catch it
        write_signed_json(d / MARKER, marker, fsync=False)
        return "shard-00002-of-00003.safetensors"
    raw = json.loads((d / MARKER).read_text())  # edited by hand: its sha256 catches it
    raw["shards"][2]["size"] += 4
    (d / MARKER).write_text(json.dumps(raw))
    return MARKER


@pytest.mark.parametrize("kind", ["truncated", "flipped", "no_marker", "lying_size", "edited"])
def test_damaged_newest_is_skipped_with_warning(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    old, new = make_state(1), make_state(2)
    save(tmp_path, 10, old, num_shards=3)
    save(tmp_path, 20, new, num_shards=3)
    name = _corrupt(kind, tmp_path / "step-00000020")
    with caplog.at_level(logging.WARNING, logger="elastrain.checkpoint"):
        ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 10
    warn = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warn) == 1 and "step-00000020" in warn[0] and name in warn[0], warn
    assert_same(load(ckpt)[0], old)


def test_commit_refuses_missing_shard(tmp_path: Path) -> None:
    state = make_state()
    save(tmp_path, 10, state, num_shards=3)
    save(tmp_path, 20, state, num_shards=3, shards=[0, 2], do_commit=False)  # w1 died mid-save
    with pytest.raises(CommitError, match=r"shard 1 of 3 is missing"):
        commit(tmp_path, 20, generation=1, members=MEMBERS, num_shards=3)
    assert not (tmp_path / "step-00000020" / MARKER).exists()
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 10


def test_commit_refuses_mixed_generations_and_members(tmp_path: Path) -> None:
    state = make_state()
    save(tmp_path, 20, state, num_shards=3, shards=[0, 1], do_commit=False)
    save(tmp_path, 20, state, num_shards=3, generation=2, shards=[2], do_commit=False)
    with pytest.raises(CommitError, match=r"shard-00002-of-00003.json has generation=2"):
        commit(tmp_path, 20, generation=1, members=MEMBERS, num_shards=3)
    with pytest.raises(CommitError, match=r"generation=1, expected 2"):
        commit(tmp_path, 20, generation=2, members=MEMBERS, num_shards=3)
    save(tmp_path, 30, state, num_shards=2, members=["w0", "w1"], do_commit=False)
    with pytest.raises(CommitError, match=r"members"):
        commit(tmp_path, 30, generation=1, members=["w0", "w9"], num_shards=2)
    assert latest_verified(tmp_path) is None


def test_writer_skips_committed_step_and_busy_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state()
    save(tmp_path, 10, state)
    w = CheckpointWriter(CheckpointConfig(directory=str(tmp_path)))
    snap = Snapshot.take(state, {}, shard=0, num_shards=1)
    assert w.save_async(10, snap, generation=1, members=["w0"]).wait().status == "skipped"

    gate, real_write = threading.Event(), os.write

    def slow_write(fd: int, data: Any) -> int:
        gate.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", slow_write)
    first = w.save_async(20, snap, generation=1, members=["w0"])
    assert w.busy
    other = Snapshot.take(state, {}, shard=0, num_shards=1)
    skipped = w.save_async(30, other, generation=1, members=["w0"]).wait(0)
    assert skipped.status == "skipped" and "in flight" in (skipped.error or "")
    # the snapshot being written is not reused; a new buffer is allocated
    again = Snapshot.take(state, {}, shard=0, num_shards=1, into=snap)
    assert again.buffer.data_ptr() != snap.buffer.data_ptr()
    gate.set()
    other_ptr = other.buffer.data_ptr()
    blocked = w.save_async(40, other, generation=1, members=["w0"], block=True)
    assert first.wait(30).ok and blocked.wait(30).ok
    reused = Snapshot.take(state, {}, shard=0, num_shards=1, into=other)
    assert reused.buffer.data_ptr() == other_ptr
    assert other.buffer.numel() == 0  # handed over
    w.close()


def test_close_without_wait_cancels_and_cleans(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate, real_write = threading.Event(), os.write

    def slow_write(fd: int, data: Any) -> int:
        gate.wait(10)
        return real_write(fd, data)

    monkeypatch.setattr(writer_mod, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(os, "write", slow_write)
    w = CheckpointWriter(CheckpointConfig(directory=str(tmp_path)))
    h = w.save_async(
        5, Snapshot.take(make_state(), {}, shard=0, num_shards=1), generation=1, members=["w0"]
    )
    w.close(wait=False)
    gate.set()
    res = h.wait(30)
    assert res.status == "failed" and "writer closed" in (res.error or "")
    assert list((tmp_path / "step-00000005").iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        w.save_async(
            6, Snapshot.take(make_state(), {}, shard=0, num_shards=1), generation=1, members=["w0"]
        )


def _assert_failed_save_is_harmless(
    tmp_path: Path,
    res: Any,
    events: list[tuple[str, dict[str, Any]]],
    good: dict[str, torch.Tensor],
) -> None:
    assert res.status == "failed" and res.errno == errno.ENOSPC
    assert "No space left on device" in (res.error or "")
    assert events[-1][0] == "checkpoint_failed" and events[-1][1]["errno"] == errno.ENOSPC
    d = tmp_path / "step-00000020"
    assert not d.exists() or list(d.iterdir()) == []  # temp files removed, no manifest
    with pytest.raises(CommitError):
        commit(tmp_path, 20, generation=1, members=["w0"], num_shards=1)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 10
    assert_same(load(ckpt)[0], good)


def test_enospc_from_write_fails_only_that_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    good = make_state(1)
    save(tmp_path, 10, good)
    events: list[tuple[str, dict[str, Any]]] = []
    w = CheckpointWriter(
        CheckpointConfig(directory=str(tmp_path)), events=lambda k, f: events.append((k, f))
    )
    real_write = os.write

    def full_disk(fd: int, data: Any) -> int:
        if len(data) > 4096:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_disk)
    snap = Snapshot.take(make_state(2), {}, shard=0, num_shards=1)
    with caplog.at_level(logging.ERROR, logger="elastrain.checkpoint"):
        res = w.save_async(20, snap, generation=1, members=["w0"]).wait(30)
    assert any("step 20" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    _assert_failed_save_is_harmless(tmp_path, res, events, good)
    monkeypatch.setattr(os, "write", real_write)
    assert w.save_async(30, snap, generation=1, members=["w0"]).wait(30).ok  # still usable
    w.close()


def test_a_step_given_up_while_its_shard_finishes_is_a_skip_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 gives a step up (another member's shard failed) and removes its
    directory as soon as this shard's manifest is visible, before this writer's
    last directory fsync: the shard is not reported as a failed write (that would
    be a spurious ENOENT beside the real failure), but as skipped, and the
    writer goes on."""
    events: list[tuple[str, dict[str, Any]]] = []
    w = CheckpointWriter(
        CheckpointConfig(directory=str(tmp_path)), events=lambda k, f: events.append((k, f))
    )
    real = files_mod.fsync_dir
    d20 = step_dir(tmp_path, 20)

    def given_up_first(path: Path) -> None:
        if path == d20 and any(p.name.endswith(".json") for p in path.iterdir()):
            shutil.rmtree(path)  # rank 0's cleanup wins the race
        real(path)

    monkeypatch.setattr(files_mod, "fsync_dir", given_up_first)
    snap = Snapshot.take(make_state(2), {}, shard=0, num_shards=1)
    res = w.save_async(20, snap, generation=1, members=["w0"]).wait(30)
    assert res.status == "skipped" and "given up" in (res.error or ""), res
    assert [k for k, _ in events] == ["checkpoint_skipped"], events
    assert not d20.exists()
    monkeypatch.setattr(files_mod, "fsync_dir", real)
    assert w.save_async(30, snap, generation=1, members=["w0"]).wait(30).ok
    w.close()


def test_enospc_on_real_small_filesystem(small_fs: Path) -> None:
    good = make_state(1, n=10000)  # about 290 KB
    save(small_fs, 10, good)
    filler = small_fs / "filler"
    free = shutil.disk_usage(small_fs).free
    filler.write_bytes(b"\0" * (free - 100_000))  # leaves less than one checkpoint
    events: list[tuple[str, dict[str, Any]]] = []
    w = CheckpointWriter(
        CheckpointConfig(directory=str(small_fs)), events=lambda k, f: events.append((k, f))
    )
    snap = Snapshot.take(make_state(2, n=10000), {}, shard=0, num_shards=1)
    res = w.save_async(20, snap, generation=1, members=["w0"]).wait(30)
    _assert_failed_save_is_harmless(small_fs, res, events, good)
    filler.unlink()
    assert w.save_async(30, snap, generation=1, members=["w0"]).wait(30).ok
    w.close()


def test_retention_keep_last_keep_every_and_newest_verified(tmp_path: Path) -> None:
    state = {"x": torch.arange(100.0)}
    for step in (10, 20, 30, 40, 50, 60):
        save(tmp_path, step, state)
    save(tmp_path, 5, state, do_commit=False)  # an abandoned save, older than newest
    save(tmp_path, 70, state, do_commit=False)  # maybe in flight: kept
    cfg = CheckpointConfig(directory=str(tmp_path), keep_last=2, keep_every=20)
    deleted = apply_retention(tmp_path, cfg)
    assert sorted(p.name for p in deleted) == ["step-00000005", "step-00000010", "step-00000030"]
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [f"step-000000{s}" for s in (20, 40, 50, 60, 70)]
    # newest two damaged: the newest verified one (40) must survive keep_last=1
    for s in (50, 60):
        f = tmp_path / f"step-000000{s}" / "shard-00000-of-00001.safetensors"
        f.write_bytes(f.read_bytes()[:-1] + b"\x01")
    cfg = CheckpointConfig(directory=str(tmp_path), keep_last=1)
    deleted = apply_retention(tmp_path, cfg)
    assert sorted(p.name for p in deleted) == ["step-00000020", "step-00000050"]
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 40


def test_discard_newer_at_resume(tmp_path: Path) -> None:
    state = make_state()
    save(tmp_path, 10, state, num_shards=3)
    save(tmp_path, 20, state, num_shards=3)
    _corrupt("flipped", tmp_path / "step-00000020")
    save(tmp_path, 30, state, num_shards=3, do_commit=False)  # the old run died before commit
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 10
    cleared = discard_newer(tmp_path, ckpt.step)
    assert [p.name for p in cleared] == ["step-00000020", "step-00000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rejected-step-00000020", "step-00000010"]
    # the new run can save step 20 again; a stale step-30 shard cannot complete its step 30
    save(tmp_path, 20, make_state(5), num_shards=3)
    save(tmp_path, 30, state, num_shards=3, shards=[0, 1], do_commit=False)
    with pytest.raises(CommitError, match="missing"):
        commit(tmp_path, 30, generation=1, members=MEMBERS, num_shards=3)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.step == 20
    assert_same(load(ckpt)[0], make_state(5))


def test_young_daly_and_validation() -> None:
    assert young_daly_interval(3600.0, 10.0) == pytest.approx(math.sqrt(72000.0))
    assert young_daly_interval(86400, 0.5) == pytest.approx(293.9387691)
    for bad in [(0, 1), (-1, 1), (3600, 0), (math.nan, 1), (math.inf, 1), (True, 1), (10, 10)]:
        with pytest.raises(ValueError):
            young_daly_interval(*bad)


def test_config_validation(tmp_path: Path) -> None:
    CheckpointConfig(directory=str(tmp_path / "new"), keep_last=1, keep_every=100)
    (tmp_path / "file").write_text("x")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"directory": ""}, "non-empty"),
        ({"directory": str(tmp_path / "file")}, "not a directory"),
        ({"directory": str(tmp_path), "keep_last": 0}, "keep_last"),
        ({"directory": str(tmp_path), "keep_every": -5}, "keep_every"),
    ]
    for kw, match in cases:
        with pytest.raises(ValueError, match=match):
            CheckpointConfig(**kw)


def test_take_rejects_bad_input() -> None:
    with pytest.raises(TypeError, match="JSON"):
        Snapshot.take({"x": torch.zeros(2)}, {"bad": object()}, shard=0, num_shards=1)
    with pytest.raises(ValueError, match="shard"):
        Snapshot.take({"x": torch.zeros(2)}, {}, shard=2, num_shards=2)
    with pytest.raises(TypeError):
        Snapshot.take({"x": torch.zeros(2).to_sparse()}, {}, shard=0, num_shards=1)


def test_events_callback_errors_do_not_break_the_writer(tmp_path: Path) -> None:
    def boom(kind: str, fields: dict[str, Any]) -> None:
        raise RuntimeError("sink down")

    w = CheckpointWriter(CheckpointConfig(directory=str(tmp_path)), events=boom)
    for step in (1, 2):
        snap = Snapshot.take({"x": torch.ones(4)}, {}, shard=0, num_shards=1)
        assert w.save_async(step, snap, generation=0, members=["w0"]).wait(30).ok
    w.close()


# ---- DurableFile: the kernel's writeback started as the bytes go out ----------


def _fake_sync_file_range(calls: list[tuple[int, int, int]], fail: int = 0) -> Any:
    def fn(fd: int, offset: int, nbytes: int, flags: int) -> int:
        calls.append((offset, nbytes, flags))
        if fail:
            ctypes.set_errno(fail)
            return -1
        return 0

    return fn


def test_a_durable_file_hands_every_byte_to_writeback_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(files_mod, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(files_mod, "_sync_file_range", _fake_sync_file_range(calls))
    pieces = [os.urandom(n) for n in (10, 990, 2500, 1, 3000, 7)]
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        out = DurableFile(fd, writeback=True)
        for p in pieces:
            out.write(p)
        out.sync()
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"".join(pieces) and out.size == 6508
    # From offset 0, back to back, at least 1000 bytes at a time, never waiting
    # (flags 2: SYNC_FILE_RANGE_WRITE); what is left to the fsync is under 1000.
    assert calls and calls[0][0] == 0 and {f for _, _, f in calls} == {2}
    assert all(o + n == calls[i + 1][0] for i, (o, n, _) in enumerate(calls[:-1]))
    assert all(n >= 1000 for _, n, _ in calls)
    assert 0 <= out.size - (calls[-1][0] + calls[-1][1]) < 1000


def test_a_durable_file_without_writeback_or_with_a_file_system_that_refuses_it_only_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "WRITEBACK_BYTES", 100)
    for writeback, fail, want_calls in ((False, 0, 0), (True, errno.EINVAL, 1)):
        calls: list[tuple[int, int, int]] = []
        monkeypatch.setattr(files_mod, "_sync_file_range", _fake_sync_file_range(calls, fail))
        path = tmp_path / f"f-{writeback}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            out = DurableFile(fd, writeback=writeback)
            out.write(b"x" * 1000)
        finally:
            os.close(fd)
        assert path.read_bytes() == b"x" * 1000
        assert len(calls) == want_calls  # refused once: not asked again


def test_a_durable_file_raises_a_writeback_io_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "WRITEBACK_BYTES", 100)
    monkeypatch.setattr(files_mod, "_sync_file_range", _fake_sync_file_range([], errno.EIO))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with pytest.raises(OSError, match="sync_file_range") as e:
            DurableFile(fd, writeback=True).write(b"x" * 1000)
        assert e.value.errno == errno.EIO
    finally:
        os.close(fd)


@pytest.mark.skipif(files_mod._sync_file_range is None, reason="no sync_file_range here")
def test_a_durable_file_calls_the_real_sync_file_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files_mod, "WRITEBACK_BYTES", 4096)
    data = os.urandom(5 * 4096 + 17)
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        out = DurableFile(fd, writeback=True)
        out.write(data)
        out.sync()
        assert out._sync_file_range is not None  # accepted by this file system
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == data

"""Checkpoints that do not block (issue 18, item 4): what only the optimizer step
writes is copied in the background until the training thread's next mutation
point. In-process, one member; fast (no worker processes)."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import load as dcp_load

from elastrain.checkpoint import (
    CheckpointConfig,
    CheckpointWriter,
    Snapshot,
    commit,
    latest_verified,
    load,
)
from elastrain.checkpoint import deferred as deferred_module
from elastrain.checkpoint import files as files_module
from elastrain.checkpoint import writer as writer_module
from elastrain.checkpoint.dcp import Chunk, ShardedWriter, ShardParts, ShardSnapshot, commit_sharded
from elastrain.checkpoint.deferred import CopyFailed, DeferredCopy
from elastrain.checkpoint.files import DurableFile, step_dir
from elastrain.checkpoint.manager import Checkpointing
from elastrain.checkpoint.restore import ordered_json
from elastrain.observe.events import EventLog, read_events
from elastrain.transfer.dtypes import byte_view
from elastrain.transfer.flatten import flatten_state

from .test_durable_unit import cfg


def model_and_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    step(model, opt)
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One forward (writes BatchNorm's statistics), backward and optimizer step."""
    opt.zero_grad()
    model(torch.randn(16, 64)).pow(2).mean().backward()
    opt.step()


def clone_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in flatten_state(model, opt).tensors}


def state_fn(model: nn.Module, opt: torch.optim.Optimizer, n: int) -> Any:
    def fn() -> tuple[dict[str, torch.Tensor], dict[str, Any], frozenset[str]]:
        flat = flatten_state(model, opt)
        meta = {"committed": n, "optimizer": ordered_json(flat.section)}
        return dict(flat.tensors), meta, flat.stable

    return fn


@pytest.fixture
def no_copier(monkeypatch: pytest.MonkeyPatch) -> None:
    """No copier thread: the deferred copy happens only when the training thread
    settles, so a mutation before `settle` would show in the checkpoint."""
    monkeypatch.setattr(DeferredCopy, "start", lambda self: None)


def test_only_what_the_optimizer_step_writes_is_deferred() -> None:
    model, opt = model_and_opt()
    flat = flatten_state(model, opt)
    names = [n for n, _ in flat.tensors]
    assert "model/0.weight" in flat.stable and "optim/0/exp_avg" in flat.stable
    assert "optim/0/step" in flat.stable
    # Forward writes BatchNorm's running statistics: copied at once.
    assert "model/1.running_mean" in names and "model/1.running_mean" not in flat.stable
    assert "model/1.num_batches_tracked" not in flat.stable


def test_a_snapshot_holds_the_state_it_was_taken_of_after_the_next_step(
    tmp_path: Path, no_copier: None
) -> None:
    model, opt = model_and_opt()
    want = clone_state(model, opt)
    tensors, meta, stable = state_fn(model, opt, 1)()
    snap = Snapshot.take(tensors, meta, shard=0, num_shards=1, defer=stable)
    assert snap.deferred.nbytes > 0 and not snap.deferred.done
    # The next step's forward writes the buffers: they were copied by take.
    model(torch.randn(16, 64))
    assert snap.deferred.settle() >= 0.0  # the mutation point: the copy is finished here
    step(model, opt)
    writer = CheckpointWriter(CheckpointConfig(directory=str(tmp_path), fsync=False))
    assert writer.save_async(1, snap, generation=1, members=["w0"]).wait().ok
    writer.close()
    commit(tmp_path, 1, generation=1, members=["w0"], num_shards=1, fsync=False)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None
    got, _ = load(ckpt)
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    # And the step did change what the copy read later.
    assert not torch.equal(clone_state(model, opt)["model/0.weight"], want["model/0.weight"])


def test_the_copier_thread_copies_in_chunks_and_the_writer_waits_for_it() -> None:
    src = torch.arange(1000, dtype=torch.float32)
    dst = torch.zeros(1000, dtype=torch.float32)
    copy = DeferredCopy([(byte_view(dst), byte_view(src))], chunk_bytes=512)
    copy.start()
    copy.wait()  # the writer's wait: returns once every chunk is copied
    assert copy.done and torch.equal(dst, src)
    assert copy.waited() == 0.0  # the training thread never waited


def engine_save(model: nn.Module, opt: torch.optim.Optimizer, n: int, ck: Checkpointing) -> None:
    """What the trainer does after committing the step that makes its count ``n``."""
    assert ck.save_due(n, 0)
    ck.save(n, 1, ["w0"], 0, state_fn(model, opt, n))


def checkpointing(tmp_path: Path) -> Checkpointing:
    c = cfg(checkpoint_every=1, checkpoint_fsync=False, checkpoint_commit_timeout_s=30.0)
    return Checkpointing(c.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, "w0"), "w0")


def test_blocking_is_the_take_plus_the_wait_at_the_mutation_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entered, release = threading.Event(), threading.Event()
    real = deferred_module.copy_chunk

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        entered.set()
        release.wait()
        real(dst, src)

    monkeypatch.setattr(deferred_module, "copy_chunk", slow_copy)
    model, opt = model_and_opt()
    ck = checkpointing(tmp_path)
    engine_save(model, opt, 1, ck)
    entered.wait()  # the copier holds the only chunk
    assert ck._copying is not None
    copy = ck._copying[0].deferred

    def release_later() -> None:
        # The copy ends 0.2 s after the training thread started waiting for it
        # (its clock already running), however late either thread gets a core.
        while not copy.settling:
            time.sleep(0.001)  # polling the other thread's state
        time.sleep(0.2)  # the copy's remaining work, simulated
        release.set()

    releaser = threading.Thread(target=release_later)
    releaser.start()
    waited = ck.settle()  # the training thread reaches its mutation point now
    releaser.join()
    assert waited >= 0.2
    ck.close()
    (saved,) = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_saved"]
    (committed,) = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_committed"]
    assert saved["blocking_s"] >= waited
    assert committed["blocking_s"] == saved["blocking_s"]
    # The schedule's save cost is the same blocking time, sent in the next all-reduce.
    assert ck.contribution()[:2] == [pytest.approx(saved["blocking_s"]), 1.0]


def test_a_cost_measured_after_the_allreduce_waits_for_the_next_one(tmp_path: Path) -> None:
    model, opt = model_and_opt()
    ck = checkpointing(tmp_path)
    engine_save(model, opt, 1, ck)
    take_cost = ck.contribution()[0]  # the next step's all-reduce carries the take
    assert take_cost > 0
    ck.settle()  # that step's apply: the take and the wait, measured after the all-reduce
    ck.absorb([take_cost, 1.0, 0.1, 1.0, 0.0, 0.0, 0.0])
    cost, n = ck.contribution()[:2]
    assert n == 1.0 and cost >= take_cost  # not dropped: the step after carries it
    ck.absorb([cost, 1.0, 0.1, 1.0, 0.0, 0.0, 0.0])
    assert ck.contribution()[:2] == [0.0, 0.0]
    ck.close()


def test_a_failed_copy_fails_that_save_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = deferred_module.copy_chunk
    calls: list[int] = []

    def failing_once(dst: torch.Tensor, src: torch.Tensor) -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected copy failure")
        real(dst, src)

    monkeypatch.setattr(deferred_module, "copy_chunk", failing_once)
    model, opt = model_and_opt()
    ck = checkpointing(tmp_path)
    engine_save(model, opt, 1, ck)
    assert ck.settle() >= 0.0  # never raises on the training thread
    # The failed save ends (so the next one is not skipped as "previous still writing").
    assert ck._handle is not None and not ck._handle.wait(timeout=30).ok
    step(model, opt)  # training goes on
    want = clone_state(model, opt)
    engine_save(model, opt, 2, ck)
    ck.settle()
    step(model, opt)
    ck.close()
    ev = read_events(tmp_path)
    failed = [e for e in ev if e["kind"] == "checkpoint_failed" and e["step"] == 1]
    # The writer's (the copy failed) and rank 0's (it gave up at once on the marker).
    assert [e["phase"] for e in failed] == ["snapshot", "commit"]
    assert "injected copy failure" in failed[0]["error"]
    assert not [e for e in ev if e["kind"] == "checkpoint_failed" and e["step"] == 2]
    assert not (step_dir(tmp_path / "ck", 1) / "COMMITTED.json").exists()
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.step == 2
    got, _ = load(ckpt)
    assert all(torch.equal(got[n], t) for n, t in want.items())


def test_waiting_on_a_part_returns_once_its_chunks_are_copied_not_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = torch.arange(1024, dtype=torch.uint8)
    dst = torch.zeros(1024, dtype=torch.uint8)
    second = threading.Event()
    real = deferred_module.copy_chunk

    def copy(d: torch.Tensor, s: torch.Tensor) -> None:
        if d.data_ptr() != dst.data_ptr():
            assert second.wait(30), "the test never let the second chunk be copied"
        real(d, s)

    monkeypatch.setattr(deferred_module, "copy_chunk", copy)
    deferred = DeferredCopy([(dst, src)], chunk_bytes=512)
    deferred.start()
    deferred.wait(dst[:512])  # the first chunk only: its copy is done
    assert torch.equal(dst[:512], src[:512]) and not deferred.done
    deferred.wait(dst[100:100])  # an empty span waits for nothing
    second.set()
    deferred.wait(dst[500:524])  # overlaps both chunks
    assert torch.equal(dst, src)
    deferred.wait()


def test_waiting_on_a_part_raises_when_a_chunk_under_it_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def failing(d: torch.Tensor, s: torch.Tensor) -> None:
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(deferred_module, "copy_chunk", failing)
    dst = torch.zeros(1024, dtype=torch.uint8)
    deferred = DeferredCopy([(dst, torch.ones(1024, dtype=torch.uint8))], chunk_bytes=512)
    deferred.start()
    with pytest.raises(CopyFailed, match="injected copy failure"):
        deferred.wait(dst[600:610])  # never copied: the copy gave up


class _RecordingFile(DurableFile):
    """A `DurableFile` that says when the first ``after`` bytes were appended."""

    after = 0
    reached = threading.Event()

    def write(self, data: Any) -> None:
        super().write(data)
        if self.size >= self.after:
            self.reached.set()


def _state_of_two() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4096), torch.randn(4096)  # 16 KiB each: one deferred chunk each


@pytest.mark.parametrize("fmt", ["flat", "dcp"])
def test_the_writer_writes_what_is_copied_while_the_rest_is_still_being_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    """The writer follows the deferred copy chunk by chunk: the first tensor's
    bytes go out while the second's copy has not run (it runs only once they
    did; a writer that waited for the whole copy first would wait here)."""
    a, b = _state_of_two()
    real = deferred_module.copy_chunk
    overlapped: list[bool] = []

    def copy(d: torch.Tensor, s: torch.Tensor) -> None:
        if s.data_ptr() == b.data_ptr():
            overlapped.append(_RecordingFile.reached.wait(30))
        real(d, s)

    monkeypatch.setattr(deferred_module, "copy_chunk", copy)
    monkeypatch.setattr(_RecordingFile, "reached", threading.Event())
    monkeypatch.setattr(_RecordingFile, "after", a.numel() * a.element_size())
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", 4096)
    config = CheckpointConfig(directory=str(tmp_path), fsync=False)
    # Both formats write through the one durable write (`files.atomic_file`).
    monkeypatch.setattr(files_module, "DurableFile", _RecordingFile)
    if fmt == "flat":
        writer: CheckpointWriter = CheckpointWriter(config)
        snap: Any = Snapshot.take({"a": a, "b": b}, {}, shard=0, num_shards=1, defer={"a", "b"})
    else:
        writer = ShardedWriter(config)
        declared = {"a": ("torch.float32", (4096,)), "b": ("torch.float32", (4096,))}
        chunks = [Chunk("a", 0, 4096, a, defer=True), Chunk("b", 0, 4096, b, defer=True)]
        snap = ShardSnapshot.take(ShardParts(declared, chunks, {}), shard=0, num_shards=1)
    assert writer.save_async(3, snap, generation=1, members=["w0"]).wait(timeout=60).ok
    writer.close()
    assert overlapped == [True]
    if fmt == "flat":
        commit(tmp_path, 3, generation=1, members=["w0"], num_shards=1, fsync=False)
        ckpt = latest_verified(tmp_path)
        assert ckpt is not None
        got, _ = load(ckpt)
    else:
        commit_sharded(str(tmp_path), 3, generation=1, members=["w0"], num_shards=1, fsync=False)
        got = {"a": torch.zeros(4096), "b": torch.zeros(4096)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # no process group: one process
            dcp_load(got, checkpoint_id=str(step_dir(tmp_path, 3)))
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)


def test_a_copy_failing_after_the_writes_began_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, b = _state_of_two()
    real = deferred_module.copy_chunk

    def copy(d: torch.Tensor, s: torch.Tensor) -> None:
        if s.data_ptr() == b.data_ptr():
            assert _RecordingFile.reached.wait(30)  # the first tensor's bytes are out
            raise RuntimeError("injected copy failure")
        real(d, s)

    monkeypatch.setattr(deferred_module, "copy_chunk", copy)
    monkeypatch.setattr(_RecordingFile, "reached", threading.Event())
    monkeypatch.setattr(_RecordingFile, "after", a.numel() * a.element_size())
    monkeypatch.setattr(writer_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(files_module, "DurableFile", _RecordingFile)
    writer = CheckpointWriter(CheckpointConfig(directory=str(tmp_path), fsync=False))
    snap = Snapshot.take({"a": a, "b": b}, {}, shard=0, num_shards=1, defer={"a", "b"})
    res = writer.save_async(3, snap, generation=1, members=["w0"]).wait(timeout=60)
    writer.close()
    assert not res.ok and res.error is not None and "injected copy failure" in res.error
    assert list(step_dir(tmp_path, 3).iterdir()) == []  # neither the data file nor a temp file

"""Sharded checkpoints (issue 16 item 4): each shard's rows written once, in DCP
format, resumed on any R x S.

Unit tests (one process): the chunk planning, a write/read round trip from a
2-way sharded state into 1, 2, 3 and 4 ways and into the replicated trainer,
`torch.distributed.checkpoint.load` into a plain model, and what commit and the
reader refuse. Whole jobs: a 2 x 2 job checkpointing every few steps has every
worker killed, then is run again on the same run directory as 2 x 2, 1 x 4 and
4 x 1; its loss curve continues the uninterrupted run's bit for bit.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elastrain import env
from elastrain.checkpoint import CheckpointConfig, latest_verified, load
from elastrain.checkpoint.dcp import (
    BLOCK_BYTES,
    METADATA,
    Chunk,
    ShardedReader,
    ShardedWriter,
    ShardParts,
    ShardSnapshot,
    commit_sharded,
    cover,
    data_file_name,
    model_key,
    optim_key,
    tiling_problem,
)
from elastrain.checkpoint.deferred import DeferredCopy
from elastrain.checkpoint.files import MARKER, CheckpointCorrupt, CommitError, step_dir
from elastrain.checkpoint.restore import install_checkpoint
from elastrain.checkpoint.sharded_parts import (
    replicated_state,
    schema_problem,
    shard_parts,
    shard_source,
    writer_shard,
)
from elastrain.control.config import CoordinatorConfig
from elastrain.control.layout import Layout, Slot
from elastrain.control.server import CoordinatorServer
from elastrain.data import GlobalOrder
from elastrain.exitcodes import EXIT_STATE_LOST
from elastrain.launch.launcher import LaunchConfig, Launcher
from elastrain.observe.events import read_events
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.sharded import ShardedBackend, shard_rows
from elastrain.transfer import TorchState, section_bytes

from .conftest import ROOT, Job

SHARDED = str(ROOT / "tests" / "scripts" / "train_sharded.py")


def _script() -> Any:
    # The script imports its model from its own directory (job_common.py), as it
    # does under the launcher.
    scripts = str(ROOT / "tests" / "scripts")
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    spec = importlib.util.spec_from_file_location("train_sharded_ckpt", SHARDED)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SCRIPT = _script()


# ---- pure planning ------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    rows=st.integers(0, 60),
    saved=st.integers(1, 5),
    want=st.integers(1, 5),
    data=st.data(),
)
def test_cover_takes_every_row_of_a_new_shard_once_from_the_saved_chunks(
    rows: int, saved: int, want: int, data: st.DataObject
) -> None:
    chunks = [shard_rows(rows, saved, k) for k in range(saved)]
    order = data.draw(st.permutations(range(saved)))
    shuffled = [chunks[i] for i in order]
    assert tiling_problem(shuffled, rows) is None
    for k in range(want):
        lo, hi = shard_rows(rows, want, k)
        got = cover(shuffled, lo, hi)
        flat = [r for _, a, b in got for r in range(a, b)]
        assert flat == list(range(lo, hi))
        for i, a, b in got:
            clo, chi = shuffled[i]
            assert clo <= a < b <= chi


def test_cover_and_tiling_say_which_rows_are_missing_or_doubled() -> None:
    with pytest.raises(ValueError, match="rows 4-6 are in no saved chunk"):
        cover([(0, 4), (6, 9)], 2, 8)
    with pytest.raises(ValueError, match="rows 9-10"):
        cover([(0, 4), (4, 9)], 0, 10)
    assert cover([(5, 9), (0, 5)], 3, 7) == [(1, 3, 5), (0, 5, 7)]
    assert cover([], 3, 3) == []
    assert tiling_problem([(0, 4), (3, 9)], 9) == "rows 3-4 are in two chunks"
    assert tiling_problem([(0, 4), (5, 9)], 9) == "rows 4-5 are in no chunk"
    assert tiling_problem([(0, 4)], 9) == "rows 4-9 are in no chunk"
    assert tiling_problem([(0, 4), (4, 4), (4, 9)], 9) is None
    assert tiling_problem([], 0) is None


def test_one_writer_per_shard_index_the_lowest_replica() -> None:
    layout = Layout(2, {"a": Slot(1, 0), "b": Slot(1, 1), "c": Slot(0, 1), "d": Slot(2, 0)})
    assert {m: writer_shard(layout, m) for m in "abcd"} == {"a": 0, "b": None, "c": 1, "d": None}


# ---- one process: a sharded state, written and read back ------------------------------


def _config(shard_size: int) -> TrainerConfig:
    return TrainerConfig(global_batch_size=24, micro_batch_size=3, total_steps=10, seed=5,
                         shard_size=shard_size)  # fmt: skip


def _fresh(shard_size: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = SCRIPT.Net()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def _trained_shards(size: int, steps: int = 3) -> list[ShardedBackend]:
    """`size` members holding the shards of one state after `steps` AdamW updates
    (made-up gradients: each member gets its rows of the same full gradient)."""
    members = []
    for k in range(size):
        model, opt = _fresh(size)
        b = ShardedBackend(model, opt, SCRIPT.loss_fn, _config(size))
        b.place(k, size)
        members.append(b)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 + step)
        for name, shape in members[0]._shapes.items():
            full = torch.randn(shape, generator=g)
            for k, b in enumerate(members):
                lo, hi = shard_rows(shape[0], size, k)
                p = b.local.get_parameter(name.replace(".", "/"))
                p.grad = full[lo:hi].clone()
        for b in members:
            assert b.optimizer is not None
            b.optimizer.step()
    return members


@pytest.mark.parametrize("size", [2, 3])
def test_a_sharded_joiner_estimates_the_largest_shard_a_heal_brings(size: int) -> None:
    """Before it holds a shard, a joiner's landing estimate covers, section by
    section, what a heal of any shard of the job's shard size brings, and equals
    the largest one's (shard 0: `torch.chunk` rows)."""
    model, opt = _fresh(size)
    joiner = ShardedBackend(model, opt, SCRIPT.loss_fn, _config(size))
    want = section_bytes(joiner.landing_estimate())
    got = [
        section_bytes((n, t.nbytes) for n, t in b.state().flatten().tensors)
        for b in _trained_shards(size, steps=1)
    ]
    assert got[0] == want
    assert all(g[sec] <= want[sec] for g in got for sec in g)


def _write(directory: Path, members: list[ShardedBackend], step: int = 7) -> Path:

    writer = ShardedWriter(CheckpointConfig(directory=str(directory), fsync=False))
    names = [f"m{k}" for k in range(len(members))]
    for k, b in enumerate(members):
        parts = shard_parts(b, {"committed": step, "k": k}, k)
        snap = ShardSnapshot.take(parts, shard=k, num_shards=len(members))
        assert writer.save_async(step, snap, generation=3, members=names).wait().ok
    writer.close()
    return commit_sharded(
        str(directory), step, generation=3, members=names, num_shards=len(members), fsync=False
    )


def _whole(members: list[ShardedBackend]) -> dict[str, torch.Tensor]:
    """The full tensors the shards make together, by DCP key."""
    out: dict[str, torch.Tensor] = {}
    b0 = members[0]
    assert b0.optimizer is not None
    for name, shape in b0._shapes.items():
        local = name.replace(".", "/")
        out[model_key(name)] = torch.cat([b.local.get_parameter(local).detach() for b in members])
        for key in ("exp_avg", "exp_avg_sq"):
            out[optim_key(name, key)] = torch.cat(
                [b.optimizer.state[b.local.get_parameter(local)][key] for b in members]  # type: ignore[union-attr]
            ).reshape(shape)
        out[optim_key(name, "step")] = b0.optimizer.state[b0.local.get_parameter(local)]["step"]
    return out


@pytest.mark.parametrize("new_size", [1, 2, 3, 4])
def test_a_2_way_checkpoint_resumes_as_any_shard_size_bit_for_bit(
    tmp_path: Path, new_size: int
) -> None:
    old = _trained_shards(2)
    _write(tmp_path, old)
    whole = _whole(old)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.kind == "dcp" and ckpt.step == 7
    assert ckpt.meta["committed"] == 7 and ckpt.meta["k"] == 0  # writer 0's meta
    schema = ckpt.meta["schema"]
    state_bytes = sum(t.numel() * t.element_size() for t in whole.values())
    for k in range(new_size):
        model, opt = _fresh(new_size)
        b = ShardedBackend(model, opt, SCRIPT.loss_fn, _config(new_size))
        assert schema_problem(schema, b) is None
        read: list[int] = []
        b.resume_from(
            shard_source(ShardedReader(ckpt), schema, lambda n, _s, out=read: out.append(n))
        )
        b.place(k, new_size)
        assert b.optimizer is not None
        for name, shape in b._shapes.items():
            lo, hi = shard_rows(shape[0], new_size, k)
            p = b.local.get_parameter(name.replace(".", "/"))
            assert torch.equal(p.detach(), whole[model_key(name)][lo:hi])
            st = b.optimizer.state[p]
            assert list(st) == ["step", "exp_avg", "exp_avg_sq"]  # the optimizer's order
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(st[key], whole[optim_key(name, key)][lo:hi])
            assert torch.equal(st["step"], whole[optim_key(name, "step")])
        assert b.optimizer.param_groups[0]["lr"] == 3e-3
        # It read its shard, not the checkpoint: rows plus at most a block per piece.
        assert read and read[0] <= state_bytes / new_size + 2 * len(whole) * BLOCK_BYTES
        if new_size > 1:
            assert read[0] < state_bytes


def test_a_member_reads_only_the_blocks_that_hold_its_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With blocks smaller than the chunks, a member of 4 ways reads about its
    quarter of a 2-way checkpoint: its rows, rounded out to whole blocks."""
    block = 512
    monkeypatch.setattr("elastrain.checkpoint.dcp.BLOCK_BYTES", block)
    old = _trained_shards(2, steps=1)
    _write(tmp_path, old)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None and ckpt.manifest["block_bytes"] == block
    whole = _whole(old)
    state = sum(t.numel() * t.element_size() for t in whole.values())
    pieces = 2 * len(whole)  # a new shard overlaps at most two saved chunks per tensor
    for k in range(4):
        reader = ShardedReader(ckpt)
        model, opt = _fresh(4)
        b = ShardedBackend(model, opt, SCRIPT.loss_fn, _config(4))
        b.resume_from(shard_source(reader, ckpt.meta["schema"]))
        b.place(k, 4)
        assert state / 4 * 0.9 < reader.bytes_read <= state / 4 * 1.1 + 2 * pieces * block


def test_a_deferred_shard_copy_holds_its_step_though_the_next_update_ran(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No copier thread: the deferred rows are copied only at the mutation point
    # (`settle`, which the trainer calls before the next update).
    monkeypatch.setattr(DeferredCopy, "start", lambda self: None)
    old = _trained_shards(2, steps=1)
    want = {k: t.clone() for k, t in _whole(old).items()}
    snaps = []
    for k, b in enumerate(old):
        parts = shard_parts(b, {"committed": 7}, k)
        # The rows of the parameters and of Adam's moments wait; Adam's one-element
        # step and the buffers (forward may write them) are copied at once.
        deferred = {c.fqn for c in parts.chunks if c.defer}
        assert deferred and not any(
            f.endswith(".step") or f == model_key("scale") for f in deferred
        )
        snaps.append(ShardSnapshot.take(parts, shard=k, num_shards=2))
    assert any(c.fqn == model_key("scale") for c in shard_parts(old[0], {}, 0).chunks)
    for snap in snaps:
        snap.deferred.settle()
    for b in old:  # the next update writes every row in place
        assert b.optimizer is not None
        for q in b.local.parameters():
            q.grad = torch.ones_like(q)
        b.optimizer.step()
    writer = ShardedWriter(CheckpointConfig(directory=str(tmp_path), fsync=False))
    for snap in snaps:
        assert writer.save_async(7, snap, generation=3, members=["m0", "m1"]).wait().ok
    writer.close()
    commit_sharded(str(tmp_path), 7, generation=3, members=["m0", "m1"], num_shards=2, fsync=False)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None
    now = _whole(old)
    with ShardedReader(ckpt) as reader:
        for fqn, t in want.items():
            assert torch.equal(reader.read(fqn).reshape(t.shape), t), fqn
    assert not torch.equal(now[model_key("head.weight")], want[model_key("head.weight")])


def test_a_sharded_checkpoint_resumes_into_the_replicated_trainer(tmp_path: Path) -> None:
    old = _trained_shards(2)
    _write(tmp_path, old)
    whole = _whole(old)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None
    model, opt = _fresh(1)
    state = TorchState(model, opt)
    tensors, section = replicated_state(ShardedReader(ckpt), ckpt.meta["schema"], state)
    # A compiled model asks for the same tensors (its names lose torch.compile's _orig_mod.).
    compiled = TorchState(torch.compile(model, backend="eager"), opt)
    again, _ = replicated_state(ShardedReader(ckpt), ckpt.meta["schema"], compiled)
    assert list(again) == list(tensors)
    install_checkpoint(state, tensors, section, str(ckpt.path))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), whole[model_key(name)])
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], whole[optim_key(name, key)])
    # The same update from here on as the shards' (AdamW is elementwise).
    g = torch.Generator().manual_seed(7)
    grads = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    for k, b in enumerate(old):
        for n, shape in b._shapes.items():
            lo, hi = shard_rows(shape[0], 2, k)
            b.local.get_parameter(n.replace(".", "/")).grad = grads[n][lo:hi].clone()
        assert b.optimizer is not None
        b.optimizer.step()
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), _whole(old)[model_key(n)])


def test_torch_dcp_load_reads_it_into_a_plain_model(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    old = _trained_shards(2)
    marker = _write(tmp_path, old)
    whole = _whole(old)
    model, _ = _fresh(1)
    sd = model.state_dict()
    optim = {n: {"exp_avg": torch.zeros_like(p), "step": torch.tensor(0.0)}
             for n, p in model.named_parameters()}  # fmt: skip
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd, "optim": {"state": optim}}, checkpoint_id=str(marker.parent))
    model.load_state_dict(sd)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), whole[model_key(name)])
        assert torch.equal(optim[name]["exp_avg"], whole[optim_key(name, "exp_avg")])
        assert torch.equal(optim[name]["step"], whole[optim_key(name, "step")])
    names = sorted(p.name for p in marker.parent.iterdir())
    assert names == sorted(
        [METADATA, MARKER, data_file_name(0), data_file_name(1),
         "shard-00000-of-00002.json", "shard-00001-of-00002.json"]
    )  # fmt: skip


def test_commit_refuses_missing_or_mixed_parts_and_no_marker_means_no_checkpoint(
    tmp_path: Path,
) -> None:
    old = _trained_shards(2, steps=1)
    writer = ShardedWriter(CheckpointConfig(directory=str(tmp_path), fsync=False))
    snap = ShardSnapshot.take(shard_parts(old[0], {}, 0), shard=0, num_shards=2)
    assert writer.save_async(5, snap, generation=1, members=["a", "b"]).wait().ok
    with pytest.raises(CommitError, match="shard 1 of 2 is missing"):
        commit_sharded(str(tmp_path), 5, generation=1, members=["a", "b"], num_shards=2)
    assert latest_verified(tmp_path) is None
    snap = ShardSnapshot.take(shard_parts(old[1], {}, 1), shard=1, num_shards=2)
    assert writer.save_async(5, snap, generation=2, members=["a", "b"]).wait().ok
    with pytest.raises(CommitError, match="generation=2, expected 1"):
        commit_sharded(str(tmp_path), 5, generation=1, members=["a", "b"], num_shards=2)
    assert not (step_dir(tmp_path, 5) / MARKER).exists()
    assert not (step_dir(tmp_path, 5) / METADATA).exists()
    # A writer that left out rows: the chunks do not tile the tensor.
    parts = shard_parts(old[1], {}, 1)
    parts.chunks = parts.chunks[1:]
    snap = ShardSnapshot.take(parts, shard=1, num_shards=2)
    assert writer.save_async(5, snap, generation=1, members=["a", "b"]).wait().ok
    with pytest.raises(CommitError, match="in no chunk"):
        commit_sharded(str(tmp_path), 5, generation=1, members=["a", "b"], num_shards=2)
    writer.close()


def test_a_changed_byte_is_caught_by_verification_and_by_the_reader(tmp_path: Path) -> None:
    old = _trained_shards(2, steps=1)
    marker = _write(tmp_path, old)
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None
    data = marker.parent / data_file_name(1)
    m = json.loads(marker.read_text())
    chunk = next(
        c for c in m["tensors"][model_key("blocks.0.up.weight")]["chunks"] if c["file"] == data.name
    )
    raw = bytearray(data.read_bytes())
    raw[chunk["data_offset"]] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorrupt, match="fail their crc32"):
        ShardedReader(ckpt).read(model_key("blocks.0.up.weight"))
    assert latest_verified(tmp_path) is None  # the whole-file CRC-32 too


def test_a_checkpoint_of_another_model_or_optimizer_is_refused_before_training(
    tmp_path: Path,
) -> None:
    _write(tmp_path, _trained_shards(2, steps=1))
    ckpt = latest_verified(tmp_path)
    assert ckpt is not None
    schema = ckpt.meta["schema"]
    torch.manual_seed(0)
    other = SCRIPT.Net(d=36)
    b = ShardedBackend(other, torch.optim.AdamW(other.parameters()), SCRIPT.loss_fn, _config(2))
    assert "are not this model's" in (schema_problem(schema, b) or "")
    model, _ = _fresh(2)
    b = ShardedBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), SCRIPT.loss_fn,
                       _config(2))  # fmt: skip
    assert "its optimizer is torch.optim.adamw.AdamW" in (schema_problem(schema, b) or "")


def test_snapshot_refuses_chunks_the_checkpoint_does_not_declare() -> None:
    parts = ShardParts({"a": ("torch.float32", (4, 2))}, [Chunk("b", 0, 1, torch.zeros(2))], {})
    with pytest.raises(ValueError, match="does not declare"):
        ShardSnapshot.take(parts, shard=0, num_shards=1)
    parts.chunks = [Chunk("a", 2, 5, torch.zeros(3, 2))]
    with pytest.raises(ValueError, match="outside"):
        ShardSnapshot.take(parts, shard=0, num_shards=1)
    parts.chunks = [Chunk("a", 0, 2, torch.zeros(2, 2, dtype=torch.float64))]
    with pytest.raises(ValueError, match="expected torch.float32"):
        ShardSnapshot.take(parts, shard=0, num_shards=1)


# ---- whole jobs ----------------------------------------------------------------------

STEPS, EVERY, KILL = 40, 5, 14
B, SEED, DATASET = 24, 5, 2048
PACE = "0.4"
"""Seconds per step of the run that is killed: the checkpoint at step 10 must
commit before the kill at step 14 (on a loaded machine unpaced steps outran it)."""


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


@dataclass
class Reference:
    events: list[dict[str, Any]]
    final: dict[str, torch.Tensor]
    """The state after the last step: the step-40 checkpoint's flattened tensors."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Reference:
    """The uninterrupted run: train_sharded.py replicated, as one member, in this
    process (the gradient is an exact float64 sum whatever the membership or layout,
    so every job below must match it bit for bit), with one checkpoint, at the end."""
    d = tmp_path_factory.mktemp("sharded-ckpt-ref") / "ref"
    srv = CoordinatorServer(CoordinatorConfig(target=1), "ref-token", run_dir=str(d))
    srv.start()
    worker_env = {
        env.COORDINATOR: srv.address,
        env.TOKEN: "ref-token",
        env.MEMBER_ID: "w0",
        env.RUN_DIR: str(d),
        env.STEPS: str(STEPS),
        env.CKPT_EVERY: str(STEPS),
        env.CKPT_DIR: str(d / "checkpoints"),
        env.RESUME: "none",
    }
    errors: list[BaseException] = []

    def train() -> None:
        try:
            _script().main()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        with mock.patch.dict(os.environ, worker_env), mock.patch.object(sys, "argv", [SHARDED]):
            # Off the main thread, so the trainer leaves pytest's SIGTERM handler alone.
            t = threading.Thread(target=train, name="reference-worker")
            t.start()
            t.join(timeout=300)
    finally:
        srv.stop()
    assert not t.is_alive() and not errors, errors
    events = read_events(d)
    assert sorted(loss_curve(events)) == list(range(STEPS))
    ckpt = latest_verified(d / "checkpoints")
    assert ckpt is not None and ckpt.step == STEPS
    return Reference(events, load(ckpt)[0])


def _launch(run_dir: Path, shard_size: int | None, **kw: Any) -> Job:
    kw.setdefault("checkpoint_every", EVERY)
    cfg = LaunchConfig(
        script=SHARDED,
        workers=4,
        steps=STEPS,
        shard_size=shard_size,
        run_dir=str(run_dir),
        progress=False,
        extra_env={"PYTHONPATH": str(ROOT)},
        **kw,
    )
    la = Launcher(cfg)
    return Job(la, la.run())


@dataclass
class Killed:
    job: Job
    newest: int


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory, reference: Reference) -> Killed:
    """A 2 x 2 job checkpointing every EVERY steps whose every worker is killed at
    step KILL (nobody replaces them): the job fails, its checkpoints stay."""
    tmp = tmp_path_factory.mktemp("sharded-ckpt-killed")
    pace = tmp / "pace"
    pace.write_text(PACE)
    points = [{"member": f"w{i}", "step": KILL, "phase": "compute", "action": "kill"}
              for i in range(4)]  # fmt: skip
    job = _launch(
        tmp / "job",
        2,
        replace=False,
        script_args=["--pace-file", str(pace)],
        fault_points=json.dumps(points),
    )
    assert job.result.status == "failed"
    assert {e["member"] for e in job.of("fault_injected")} == {"w0", "w1", "w2", "w3"}
    newest = latest_verified(job.run_dir / "checkpoints")
    assert newest is not None and newest.kind == "dcp" and EVERY <= newest.step < KILL
    assert newest.num_shards == 2  # one writer per shard index, not one per member
    # Up to the kill it trained exactly as the uninterrupted run.
    a, b = loss_curve(reference.events), loss_curve(job.events)
    assert set(b) <= set(range(KILL + 1)) and all(a[s] == b[s] for s in b)
    return Killed(job, newest.step)


def _since_last_start(job: Job) -> list[dict[str, Any]]:
    t0 = max(e["t"] for e in job.events if e["kind"] == "job_start")
    return [e for e in job.events if e["t"] >= t0]


def _final_state(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """The step-STEPS checkpoint's parameters and AdamW state, by flattened name
    (a sharded one read with torch's own DCP loader into a plain model)."""
    import torch.distributed.checkpoint as dcp

    ckpt = latest_verified(ckpt_dir)
    assert ckpt is not None and ckpt.step == STEPS
    if ckpt.kind != "dcp":
        return load(ckpt)[0]
    model = SCRIPT.Net()
    names = [n for n, _ in model.named_parameters()]
    sd = model.state_dict()
    optim = {}
    for n, p in model.named_parameters():
        optim[n] = {"step": torch.tensor(0.0), "exp_avg": torch.empty_like(p),
                    "exp_avg_sq": torch.empty_like(p)}  # fmt: skip
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd, "optim": {"state": optim}}, checkpoint_id=str(ckpt.path))
    out = {f"model/{k}": v for k, v in sd.items()}
    for i, n in enumerate(names):
        out.update({f"optim/{i}/{k}": v for k, v in optim[n].items()})
    return out


@pytest.mark.parametrize(
    ("shard_size", "layout"),
    [(2, "2x2"), (4, "1x4"), (None, "unsharded")],
    ids=["2x2", "1x4", "4x1"],
)
def test_a_killed_2x2_job_resumes_from_its_checkpoint_as_any_layout(
    tmp_path: Path, reference: Reference, killed: Killed, shard_size: int | None, layout: str
) -> None:
    """Every worker of a 2 x 2 job was killed; the job is run again on (a copy of)
    its run directory as 2 x 2, 1 x 4 or 4 x 1 (replicated). Each member reads
    its new shard's rows (4 x 1: every tensor) from the 2-way checkpoint, the job
    continues from it, and its loss curve and final state are the uninterrupted
    run's bit for bit; the final checkpoint, read back with torch's DCP loader
    when sharded, holds exactly the uninterrupted run's parameters and AdamW state."""
    run_dir = tmp_path / "job"
    shutil.copytree(killed.job.run_dir, run_dir)
    step = killed.newest
    # One checkpoint, at the end, written by the new layout's writers (a periodic one
    # whose predecessor is still writing is skipped by design, and a loaded machine
    # once stalled a 80 KB write for 5 s: the last one must not be skipped here).
    # As 1 x 4 the members build the model on the meta device: the checkpoint is
    # their state, no member ever holds the full model.
    meta = ["--meta-members", "w0,w1,w2,w3"] if shard_size == 4 else []
    job = _launch(run_dir, shard_size, checkpoint_every=STEPS, script_args=meta)
    assert job.result.status == "done", job.result.message
    assert job.result.resumed_from == step
    if meta:
        assert "w0: model built on the meta device" in job.log("w0")
    ev = _since_last_start(job)
    loaded = [e for e in ev if e["kind"] == "checkpoint_loaded"]
    assert sorted(e["proc"] for e in loaded) == ["w0", "w1", "w2", "w3"]
    assert {e["step"] for e in loaded} == {step}
    ready = next(e for e in ev if e["kind"] == "generation_ready")
    assert ready["start_step"] == step and set(ready["steps"].values()) == {step}
    assert ready.get("layout", "unsharded").split(":")[0] == layout
    state = _state_bytes()
    if shard_size == 4:
        # Each read about its quarter (whole small chunks), none the whole state.
        assert all(e["bytes"] < 0.8 * state for e in loaded), loaded
    commits = sorted({e["step"] for e in ev if e["kind"] == "step_commit"})
    assert commits == list(range(step, STEPS))
    assert check_same_state(ev) == []
    led = check_exactly_once(ev, expected_ids)
    assert [v for v in led.violations if not v.startswith("steps never committed")] == []
    a, b = loss_curve(reference.events), loss_curve(ev)
    for s in range(step, STEPS):
        assert a[s] == b[s], f"step {s}: uninterrupted {a[s]!r}, resumed as {layout} {b[s]!r}"
    final = _final_state(run_dir / "checkpoints")
    assert sorted(final) == sorted(reference.final)
    for name, want in reference.final.items():
        assert torch.equal(final[name], want), name


def _state_bytes() -> int:
    """train_sharded.py's whole training state: params and AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in SCRIPT.Net().parameters())


def test_r1_a_dead_rank_is_a_whole_job_resume_from_the_newest_checkpoint(
    tmp_path: Path, reference: Reference
) -> None:
    """R = 1 (one replica group of 4): a dead rank's shard has no twin, so nothing in
    memory restores it. When its replacement arrives every worker ends (exit 79,
    "shard_lost") naming the newest checkpoint; the job is run again on the same
    run directory and resumes from it (here as 2 x 2), continuing the uninterrupted
    run's loss curve. Measured: kill -> job ended, rerun -> first commit."""
    pace = tmp_path / "pace"
    pace.write_text(PACE)
    run_dir = tmp_path / "job"
    # Killed by its own step hook at exactly step KILL, between two checkpoints (the
    # launcher's kill@ fires at the first status poll past it, which may fall right
    # after a checkpoint: the replacement's shard is then current, see the docs).
    point = {"member": "w1", "step": KILL - 1, "phase": "compute", "action": "kill"}
    first = _launch(
        run_dir, 4, script_args=["--pace-file", str(pace)], fault_points=json.dumps([point])
    )
    assert first.result.status == "failed"
    # The first worker to see it (often the replacement) ends the job with its message.
    assert first.of("worker_exited", returncode=EXIT_STATE_LOST)
    assert "found part of the job's state lost from memory" in first.result.message
    assert "has no up-to-date holder" in first.result.message
    assert "run the same command again" in first.result.message
    newest = latest_verified(run_dir / "checkpoints")
    assert newest is not None and newest.kind == "dcp" and EVERY <= newest.step < KILL - 1
    (kill,) = first.of("fault_injected")
    (end,) = first.of("job_end")
    pace.unlink()
    second = _launch(run_dir, 2)
    assert second.result.status == "done", second.result.message
    assert second.result.resumed_from == newest.step
    ev = _since_last_start(second)
    start = next(e for e in ev if e["kind"] == "job_start")
    commit = next(e for e in ev if e["kind"] == "step_commit")
    a, b = loss_curve(reference.events), loss_curve(ev)
    assert sorted(b) == list(range(newest.step, STEPS))
    assert all(a[s] == b[s] for s in b)
    print(
        f"\nR=1 whole-job resume: kill at step {kill['step']} -> job ended "
        f"{end['t'] - kill['t']:.1f} s later; rerun -> first commit "
        f"{commit['t'] - start['t']:.1f} s (loaded step {newest.step}: "
        f"{kill['step'] - newest.step} steps redone)"
    )
    record = os.environ.get("ELASTRAIN_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"kill_to_end_s": end["t"] - kill["t"],
                                "rerun_to_first_commit_s": commit["t"] - start["t"],
                                "steps_redone": kill["step"] - newest.step}) + "\n")  # fmt: skip


def test_a_preempted_2x2_job_writes_a_sharded_emergency_checkpoint_and_resumes_from_it(
    tmp_path: Path, reference: Reference
) -> None:
    """Preempting a 2 x 2 job (no periodic checkpoints): every member stops after the
    same step, the shards' writers write their rows, rank 0 commits, everyone exits
    76; the rerun (as 4 x 1) resumes from that checkpoint and matches the
    uninterrupted run bit for bit."""
    pace = tmp_path / "pace"
    pace.write_text(PACE)
    run_dir = tmp_path / "job"

    asked: list[bool] = []

    def watch(st: dict[str, Any]) -> None:
        if int(st.get("step", 0)) >= 6 and not asked:
            asked.append(True)
            la.preempt()  # once: a second call stops the job at once

    cfg = LaunchConfig(
        script=SHARDED,
        script_args=["--pace-file", str(pace)],
        workers=4,
        steps=STEPS,
        shard_size=2,
        run_dir=str(run_dir),
        progress=False,
        extra_env={"PYTHONPATH": str(ROOT)},
    )
    la = Launcher(cfg, on_status=watch)
    first = Job(la, la.run())
    assert first.result.status == "preempted", first.result.message
    emergency = first.of("checkpoint_emergency")
    assert len(emergency) == 4 and all(e["ok"] for e in emergency), emergency
    (step,) = {e["step"] for e in emergency}
    (committed,) = first.of("checkpoint_committed")
    assert committed["step"] == step and committed["num_shards"] == 2
    assert {e["shard"] for e in first.of("checkpoint_saved")} == {0, 1}
    assert len(first.of("checkpoint_saved")) == 2  # one writer per shard, not per member
    pace.unlink()
    second = _launch(run_dir, None, checkpoint_every=None)
    assert second.result.status == "done", second.result.message
    assert second.result.resumed_from == step
    a, b = loss_curve(reference.events), loss_curve(_since_last_start(second))
    assert sorted(b) == list(range(step, STEPS)) and all(a[s] == b[s] for s in b)

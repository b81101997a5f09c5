"""A replicated job's checkpoints in DCP format (``--ckpt-format dcp``), in-process:
the schema, every member's rows (they tile every tensor exactly for any member
count), a write by 3 members through `Checkpointing` that torch's own
`dcp.load` reads into a plain model and optimizer, resume into a fresh
model, optimizer and LR scheduler, and the flag's way from the command line to
the worker's config. The whole-job tests are in tests/test_durable.py."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from elastrain import env
from elastrain.checkpoint import CheckpointFormat, latest_verified
from elastrain.checkpoint.dcp import ShardedReader, model_key, optim_key, tiling_problem
from elastrain.checkpoint.manager import Checkpointing, SaveRole, written_format
from elastrain.checkpoint.replicated_parts import replicated_parts, replicated_schema, saved_objects
from elastrain.checkpoint.restore import install_checkpoint
from elastrain.checkpoint.sharded_parts import declared_tensors, object_key, replicated_state
from elastrain.launch.config import LaunchConfig
from elastrain.observe.events import EventLog, read_events
from elastrain.runtime.config import TrainerConfig, read_worker_env
from elastrain.runtime.preflight import format_problem
from elastrain.runtime.sharded import shard_rows
from elastrain.transfer import TorchState, state_digest


class Net(nn.Module):
    """Parameters of several shapes (one with a single row, one 0-dim), a
    BatchNorm's buffers (one 0-dim) and a frozen parameter the optimizer lacks."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 7)
        self.bn = nn.BatchNorm1d(7)
        self.b = nn.Linear(7, 1)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.frozen = nn.Parameter(torch.randn(3, 2), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.bn(self.a(x)).tanh()) * self.scale


def built(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def trained(steps: int = 3, seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    model, opt, sched = built(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(6, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def state_of(model: Net, opt: torch.optim.Optimizer, sched: Any) -> TorchState:
    return TorchState(model, opt, {"sched": sched})


# ---- the schema and the rows ------------------------------------------------------


def test_the_schema_describes_every_tensor_of_the_model_optimizer_and_objects() -> None:
    model, opt, sched = trained()
    schema = replicated_schema(state_of(model, opt, sched))
    assert schema["class"] == "torch.optim.adamw.AdamW"
    params = {n: (shape, dtype, entries) for n, shape, dtype, entries in schema["params"]}
    assert list(params) == [n for n, _ in model.named_parameters()]
    shape, dtype, entries = params["a.weight"]
    assert shape == [7, 4] and dtype == "torch.float32"
    assert entries == [
        ["step", "tensor", "torch.float32", []],
        ["exp_avg", "rows", "torch.float32"],
        ["exp_avg_sq", "rows", "torch.float32"],
    ]
    assert params["frozen"][2] == []  # not in the optimizer: no state, rows still written
    assert [b[0] for b in schema["buffers"]] == [
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    (group,) = schema["groups"]
    assert group["lr"] == pytest.approx(1e-2 * 0.5) and group["weight_decay"] == 0.1
    assert group["params"] == [n for n, p in model.named_parameters() if p.requires_grad]
    assert "frozen" not in group["params"] and len(group["params"]) == 7
    # StepLR's state is JSON only: no tensors of its own.
    assert schema["objects"] == []
    keys = declared_tensors(schema)
    assert keys[model_key("bn.num_batches_tracked")] == ("torch.int64", ())
    assert keys[optim_key("scale", "exp_avg")] == ("torch.float32", ())
    assert optim_key("frozen", "exp_avg") not in keys


@settings(max_examples=25, deadline=None)
@given(members=st.integers(1, 9))
def test_the_members_rows_tile_every_tensor_exactly(members: int) -> None:
    model, opt, sched = trained()
    state = state_of(model, opt, sched)
    schema = replicated_schema(state)
    # What is split by rows, and deferred (only the optimizer step writes it): the
    # trained parameters and their row-shaped state. The rest is whole, by member 0,
    # copied at once: buffers, the frozen parameter's rows are split but not deferred,
    # one-element state (Adam's step; the 0-dim parameter's moments).
    trained_params = {n for n, p in model.named_parameters() if p.requires_grad}
    split = {model_key(n) for n, *_ in schema["params"]}
    split |= {optim_key(n, e[0]) for n, _, _, es in schema["params"] for e in es if e[1] == "rows"}
    deferred = {model_key(n) for n in trained_params} | (split - {model_key(n) for n, *_ in
                                                                  schema["params"]})  # fmt: skip
    parts = [replicated_parts(state, {"committed": 3}, r, members) for r in range(members)]
    declared = parts[0].tensors
    assert all(p.tensors == declared for p in parts)  # every writer declares the same
    rows: dict[str, list[tuple[int, int]]] = {k: [] for k in declared}
    for r, part in enumerate(parts):
        for c in part.chunks:
            rows[c.fqn].append((c.lo, c.hi))
            shape = declared[c.fqn][1]
            n = shape[0] if shape else 1
            if c.fqn in split:  # as a shard size of `members` would split it: torch.chunk's
                assert (c.lo, c.hi) == shard_rows(n, members, r)
            else:
                assert r == 0 and (c.lo, c.hi) == (0, n)
            assert c.defer == (c.fqn in deferred), c.fqn
    for fqn, (_, shape) in declared.items():
        n = shape[0] if shape else 1
        assert tiling_problem(rows[fqn], n) is None, (fqn, rows[fqn])


def test_an_optimizer_over_foreign_tensors_is_refused_naming_the_flag() -> None:
    model, _, _ = built()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match="not the model's parameters.*--ckpt-format flat"):
        replicated_schema(TorchState(model, opt))


# ---- written by 3 members, read by torch and by a resuming member ------------------


def write_by_members(tmp_path: Path, members: int, state: TorchState, step: int) -> Path:
    """Checkpoint `step` written as a replicated job's members write it: each its
    rows through its own `Checkpointing` (DCP format), rank 0 commits."""
    cfg = TrainerConfig(
        global_batch_size=8,
        micro_batch_size=4,
        total_steps=10,
        checkpoint_every=step,
        checkpoint_fsync=False,
        checkpoint_format="dcp",
    )
    assert cfg.checkpoint.format == CheckpointFormat.DCP
    names = [f"w{r}" for r in range(members)]
    cks = [
        Checkpointing(cfg.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, n), n,
                      format=written_format(cfg.checkpoint.format, sharded=False))
        for n in names
    ]  # fmt: skip
    for r, ck in enumerate(cks):
        role = SaveRole.replicated(r, names)
        parts = lambda r=r: replicated_parts(state, {"committed": step}, r, members)  # noqa: E731
        assert ck.save_due(step, r)
        ck.save(step, 2, names, r, parts, role)
    for ck in cks:
        ck.close()
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.step == step and ckpt.kind == "dcp"
    assert ckpt.num_shards == members and ckpt.members == names
    files = sorted(p.name for p in ckpt.path.iterdir() if p.suffix == ".distcp")
    assert files == [f"__{r}_0.distcp" for r in range(members)]
    saved = [e for e in read_events(tmp_path) if e["kind"] == "checkpoint_saved"]
    assert sorted(e["shard"] for e in saved) == list(range(members))
    return ckpt.path


def test_the_emergency_checkpoint_is_written_in_dcp_format_too(tmp_path: Path) -> None:
    """A preemption notice's checkpoint (every member calls `emergency`, rank 0
    returns once it is committed) goes the same way in DCP format."""
    import threading
    import time

    model, opt, sched = trained()
    state = state_of(model, opt, sched)
    cfg = TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=10,
                        checkpoint_fsync=False, checkpoint_format="dcp")  # fmt: skip
    names = ["w0", "w1"]
    cks = [
        Checkpointing(cfg.checkpoint, str(tmp_path / "ck"), EventLog(tmp_path, n), n,
                      format=cfg.checkpoint.format)
        for n in names
    ]  # fmt: skip
    deadline = time.monotonic() + 30
    results: dict[int, bool] = {}

    def emergency(r: int) -> None:
        parts = lambda: replicated_parts(state, {"committed": 7}, r, 2)  # noqa: E731
        results[r] = cks[r].emergency(
            7, 2, names, r, parts, deadline, SaveRole.replicated(r, names)
        )

    threads = [threading.Thread(target=emergency, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: True}
    ckpt = latest_verified(tmp_path / "ck")  # committed by the time rank 0 returned
    assert ckpt is not None and ckpt.step == 7 and ckpt.kind == "dcp" and ckpt.num_shards == 2
    for ck in cks:
        ck.close()


def test_torch_dcp_load_reads_it_into_a_plain_model_and_optimizer(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model, opt, sched = trained()
    path = write_by_members(tmp_path, 3, state_of(model, opt, sched), 3)
    fresh, fresh_opt, _ = built(seed=1)
    sd = fresh.state_dict()
    names = {p: n for n, p in fresh.named_parameters()}
    optim = {
        names[p]: {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                   "exp_avg_sq": torch.zeros_like(p)}
        for g in fresh_opt.param_groups for p in g["params"]
    }  # fmt: skip
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd, "optim": {"state": optim}}, checkpoint_id=str(path))
    for k, v in model.state_dict().items():
        assert torch.equal(sd[k], v), k
    trained_names = {p: n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for key, v in s.items():
            assert torch.equal(optim[trained_names[p]][key], v), (trained_names[p], key)


def test_without_torchs_private_zip_writer_the_files_are_torch_saves_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer builds torch.save's zip writer itself (to leave out the zip's
    own CRC-32s); where torch renamed what it uses, it falls back to torch.save,
    and the files read the same, by torch and by elastrain."""
    import torch.distributed.checkpoint as dcp

    from elastrain.checkpoint import dcp as ours

    monkeypatch.setattr(ours, "_zip_save", lambda: None)
    model, opt, sched = trained()
    path = write_by_members(tmp_path, 2, state_of(model, opt, sched), 3)
    sd = built(seed=1)[0].state_dict()
    with pytest.warns(UserWarning, match="single process"):
        dcp.load({"model": sd}, checkpoint_id=str(path))
    assert all(torch.equal(sd[k], v) for k, v in model.state_dict().items())
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None
    with ShardedReader(ckpt) as reader:
        assert torch.equal(reader.read(model_key("a.weight")), model.a.weight.detach())


@pytest.mark.parametrize("how", ["corrupt", "truncate"])
def test_chaos_damage_hits_a_distcp_file_and_verification_refuses_it(
    tmp_path: Path, how: str
) -> None:
    """`corrupt-ckpt`/`truncate-ckpt` damage one member's ``.distcp`` file of the
    newest checkpoint; it then fails verification (a resume skips it)."""
    import random

    from elastrain.chaos.inject import damage_checkpoint

    model, opt, sched = trained()
    write_by_members(tmp_path, 2, state_of(model, opt, sched), 3)
    done = damage_checkpoint(tmp_path / "ck", random.Random(1), how)
    assert done["checkpoint_step"] == 3 and done["path"].endswith(".distcp"), done
    assert latest_verified(tmp_path / "ck") is None


def test_a_resuming_member_installs_model_optimizer_and_scheduler(tmp_path: Path) -> None:
    model, opt, sched = trained()
    state = state_of(model, opt, sched)
    path = write_by_members(tmp_path, 2, state, 3)
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None and ckpt.path == path
    fresh = state_of(*built(seed=1))
    assert state_digest(fresh) != state_digest(state)
    reader = ShardedReader(ckpt)
    tensors, section = replicated_state(reader, ckpt.meta["schema"], fresh)
    objects = saved_objects(ShardedReader(ckpt), ckpt.meta)
    assert objects is not None
    section["objects"], more = objects
    tensors.update(more)
    install_checkpoint(fresh, tensors, section, str(path))
    assert state_digest(fresh) == state_digest(state)
    assert fresh.objects["sched"].state_dict() == sched.state_dict()


def test_elastrain_export_reads_the_model_from_it(tmp_path: Path) -> None:
    from elastrain.checkpoint.export import model_tensors

    model, opt, sched = trained()
    write_by_members(tmp_path, 3, state_of(model, opt, sched), 3)
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None
    got = model_tensors(ckpt)
    want = model.state_dict()
    assert list(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_a_registered_objects_tensors_travel_as_their_own_keys(tmp_path: Path) -> None:
    class Counter:
        def __init__(self, v: float) -> None:
            self.t = torch.full((2, 3), v)

        def state_dict(self) -> dict[str, Any]:
            return {"t": self.t, "note": "x"}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.t.copy_(sd["t"])

    model, opt, _ = trained()
    state = TorchState(model, opt, {"ctr": Counter(4.0)})
    schema = replicated_schema(state)
    assert schema["objects"] == [["obj/ctr/t", [2, 3], "torch.float32"]]
    assert object_key("obj/ctr/t") == "objects.ctr/t"
    write_by_members(tmp_path, 2, state, 4)
    ckpt = latest_verified(tmp_path / "ck")
    assert ckpt is not None
    got = saved_objects(ShardedReader(ckpt), ckpt.meta)
    assert got is not None
    section, tensors = got
    assert section == {"ctr": {"t": {"$tensor": "obj/ctr/t"}, "note": "x"}}
    assert torch.equal(tensors["obj/ctr/t"], torch.full((2, 3), 4.0))


@settings(max_examples=60, deadline=None)
@given(a=st.binary(max_size=3000), b=st.binary(max_size=3000))
def test_crc32_combine_is_zlibs(a: bytes, b: bytes) -> None:
    """The DCP writer derives a data file's CRC-32 from its chunks' block CRC-32s
    (the bytes are read once for checksums): combining must equal zlib's own."""
    import zlib

    from elastrain.checkpoint.dcp import crc32_combine

    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


# ---- the flag ---------------------------------------------------------------------


def test_which_format_is_written_and_what_is_refused() -> None:
    dcp_, flat = CheckpointFormat.DCP, CheckpointFormat.FLAT
    assert written_format(flat, sharded=False) == flat
    assert written_format(dcp_, sharded=False) == dcp_
    assert written_format(flat, sharded=True) == dcp_  # a sharded job's only format
    assert format_problem(dcp_, "torch", False) is None
    assert format_problem(flat, "jax", False) is None
    assert format_problem(dcp_, "jax", True) is None
    why = format_problem(dcp_, "jax", False)
    assert why is not None and "--ckpt-format" in why and "jax" in why


def test_the_flag_travels_from_the_command_line_to_the_workers_config(tmp_path: Path) -> None:
    from elastrain.cli import build_parser

    parser, subs = build_parser()
    script = tmp_path / "train.py"
    script.write_text("")
    args = parser.parse_args(["run", "-n", "2", "--ckpt-format", "dcp", str(script)])
    assert args.ckpt_format == "dcp"
    assert parser.parse_args(["run", "-n", "2", str(script)]).ckpt_format is None
    agent = parser.parse_args(["agent", "--coordinator", "h:1", "--ckpt-format", "dcp",
                               str(script)])  # fmt: skip
    assert agent.ckpt_format == "dcp"
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--ckpt-format", "zip", str(script)])
    with pytest.raises(ValueError, match="--ckpt-format must be one of flat, dcp"):
        LaunchConfig(script=str(script), checkpoint_format="zip")
    where = read_worker_env({env.CKPT_FORMAT: "dcp"})
    base = TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=1)
    assert base.checkpoint.format == CheckpointFormat.FLAT
    assert where.apply(base).checkpoint.format == CheckpointFormat.DCP
    with pytest.raises(ValueError, match="checkpoint_format must be one of"):
        TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=1,
                      checkpoint_format="zip")  # fmt: skip
    assert isinstance(subs, dict) and isinstance(parser, argparse.ArgumentParser)

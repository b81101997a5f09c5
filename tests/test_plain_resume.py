"""`elastrain run --resume-from DIR`: starting from a DCP checkpoint a plain torch
job wrote (docs/guide/checkpoints.md, "Starting from a plain DCP checkpoint").

The plain side is what a DDP/FSDP2 user does: `get_state_dict(model, optimizer)`
and `torch.distributed.checkpoint.save`, here in one process (DCP saves without
a process group)."""

from __future__ import annotations

import importlib.util
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.state_dict import get_state_dict

from elastrain.checkpoint.plain import (
    PlainCheckpointError,
    PlainReader,
    classify,
    read_layout,
    read_step,
    resume_step,
)
from elastrain.checkpoint.plain_state import (
    ScriptState,
    plain_problem,
    plain_schema,
    with_script_objects,
)
from elastrain.checkpoint.restore import install_checkpoint
from elastrain.checkpoint.sharded_parts import replicated_state
from elastrain.data import GlobalOrder
from elastrain.observe.ledger import check_same_state
from elastrain.runtime.torch_backend import seed_micro_batch
from elastrain.transfer import TorchState

from .conftest import MLP, Job

K = 3
"""Steps the plain job trains before it saves."""
B, MB, SEED = 32, 4, 7
"""tests/scripts/train_mlp.py's global batch, micro-batch and seed."""


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("train_mlp_plain", MLP)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mlp(hidden: int = 256) -> nn.Module:
    """train_mlp.py's model (its initialisation does not matter: the checkpoint replaces it)."""
    return nn.Sequential(nn.Linear(16, hidden), nn.Tanh(), nn.Dropout(0.1), nn.Linear(hidden, 1))


def plain_training(steps: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A plain torch loop on train_mlp.py's data, in its own order and seed."""
    torch.manual_seed(123)
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # train_mlp.py's optimizer
    data = _script().Regression()
    for _ in range(steps):
        idx = torch.randint(0, len(data), (B,))
        opt.zero_grad()
        nn.functional.mse_loss(model(data.x[idx]), data.y[idx]).backward()
        opt.step()
    return model, opt


def save_plain(directory: Path, model: nn.Module, opt: torch.optim.Optimizer, **extra: Any) -> None:
    """The torch side's save call, as docs/guide/checkpoints.md shows it."""
    model_sd, optim_sd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "no process group: single process"
        dcp.save({"model": model_sd, "optim": optim_sd, **extra}, checkpoint_id=str(directory))


def tensor_meta(*shape: int) -> TensorStorageMetadata:
    return TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(shape), [])


# ---- the keys ------------------------------------------------------------------


def test_layout_of_a_get_state_dict_checkpoint(tmp_path: Path) -> None:
    """Model names as get_state_dict writes them, optimizer state by parameter name
    (names with dots split at the parameter), the step, and what is not loaded."""
    model, opt = plain_training(1)
    save_plain(tmp_path, model, opt, step=1, lr_scheduler={"last_epoch": 1})
    layout = read_layout(tmp_path)
    assert list(layout.model) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert layout.model["0.weight"].shape == (256, 16)
    assert layout.model["0.weight"].dtype == "torch.float32"
    assert set(layout.optim) == {"0.weight", "0.bias", "3.weight", "3.bias"}
    assert list(layout.optim["3.weight"]) == ["step", "exp_avg", "exp_avg_sq"]
    assert layout.optim["3.weight"]["exp_avg"].shape == (1, 256)
    assert layout.optim["3.weight"]["step"].shape == ()
    assert layout.step and read_step(tmp_path, layout) == 1
    assert layout.ignored == ["lr_scheduler.last_epoch"]  # optim.param_groups.* is not listed


def test_ddp_and_compile_names_map_to_the_models_own() -> None:
    """A DDP model's own state_dict() (`module.`) and torch.compile's `_orig_mod.`
    are stripped as get_state_dict strips them; the longest parameter name wins."""
    meta = {
        "model.module._orig_mod.a.weight": tensor_meta(2, 2),
        "model.module._orig_mod.a.weight_v": tensor_meta(2),
        "optim.state.module._orig_mod.a.weight_v.exp_avg": tensor_meta(2),
        "optim.state.module._orig_mod.a.weight.exp_avg": tensor_meta(2, 2),
    }
    layout = classify(meta)
    assert list(layout.model) == ["a.weight", "a.weight_v"]
    assert layout.optim == {
        "a.weight_v": {"exp_avg": tensor_meta_info(2)},
        "a.weight": {"exp_avg": tensor_meta_info(2, 2)},
    }
    assert layout.keys["optim.state.a.weight.exp_avg"] == (
        "optim.state.module._orig_mod.a.weight.exp_avg"
    )
    assert not layout.step


def tensor_meta_info(*shape: int) -> Any:
    from elastrain.checkpoint.plain import TensorInfo

    return TensorInfo("torch.float32", shape)


@pytest.mark.parametrize(
    ("meta", "says"),
    [
        ({"optim.state.0.exp_avg": tensor_meta(2)}, "no model.* entries"),
        (
            {"model.w": tensor_meta(2), "optim.state.0.exp_avg": tensor_meta(2)},
            "keyed by parameter index",
        ),
        (
            {"model.w": tensor_meta(2), "optim.state.v.exp_avg": tensor_meta(2)},
            "names no parameter",
        ),
        ({"model.w": BytesStorageMetadata()}, "'model.w' is not a tensor"),
    ],
)
def test_checkpoints_of_another_layout_are_refused_saying_why(
    meta: dict[str, Any], says: str
) -> None:
    with pytest.raises(PlainCheckpointError, match=says):
        classify(meta)


def test_the_step_comes_from_the_checkpoint_or_the_flag(tmp_path: Path) -> None:
    assert resume_step(5, None, tmp_path) == 5
    assert resume_step(None, 7, tmp_path) == 7
    assert resume_step(5, 5, tmp_path) == 5
    with pytest.raises(PlainCheckpointError, match="--resume-step N"):
        resume_step(None, None, tmp_path)
    with pytest.raises(PlainCheckpointError, match="contradicts"):
        resume_step(5, 6, tmp_path)
    model, opt = plain_training(0)
    save_plain(tmp_path / "f", model, opt, step=2.5)
    with pytest.raises(PlainCheckpointError, match="not a non-negative integer"):
        read_step(tmp_path / "f", read_layout(tmp_path / "f"))
    save_plain(tmp_path / "t", model, opt, step=torch.tensor(4))
    assert read_step(tmp_path / "t", read_layout(tmp_path / "t")) == 4
    with pytest.raises(PlainCheckpointError, match="no .metadata file"):
        read_layout(tmp_path / "missing")


# ---- against the script's model ----------------------------------------------------


def test_a_mismatch_names_the_first_differing_tensor(tmp_path: Path) -> None:
    model, opt = plain_training(1)
    save_plain(tmp_path, model, opt)
    layout = read_layout(tmp_path)
    wider = mlp(257)
    problem = plain_problem(
        layout, ScriptState.of_torch(wider, torch.optim.Adam(wider.parameters()))
    )
    assert problem == (
        "tensor '0.weight' is [256, 16] torch.float32 in the checkpoint and "
        "[257, 16] torch.float32 in this model"
    )
    half = mlp().to(torch.bfloat16)
    problem = plain_problem(layout, ScriptState.of_torch(half, torch.optim.Adam(half.parameters())))
    assert problem is not None and "'0.weight'" in problem and "torch.bfloat16" in problem
    deeper = nn.Sequential(*mlp(), nn.Linear(1, 1))
    problem = plain_problem(
        layout, ScriptState.of_torch(deeper, torch.optim.Adam(deeper.parameters()))
    )
    assert problem == "it has no tensor '4.weight' of this model ([1, 1] torch.float32)"
    shallow = nn.Sequential(nn.Linear(16, 256))
    problem = plain_problem(
        layout, ScriptState.of_torch(shallow, torch.optim.Adam(shallow.parameters()))
    )
    assert problem == "its tensor '3.weight' is not in this model (2 such)"
    frozen = mlp()
    problem = plain_problem(
        layout, ScriptState.of_torch(frozen, torch.optim.Adam(frozen[0].parameters()))
    )
    assert problem == "it has optimizer state for '3.weight', which this optimizer does not update"


def test_installed_state_continues_as_the_plain_optimizer_would(tmp_path: Path) -> None:
    """In-process, the worker's install: the model's tensors and the optimizer state
    are the checkpoint's bit for bit, the hyperparameters the script's, and the next
    optimizer step is the plain job's next step."""
    model, opt = plain_training(K)
    save_plain(tmp_path, model, opt)
    fresh = mlp()
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=5e-3)  # the script's lr wins
    state = TorchState(fresh, fresh_opt)
    layout = read_layout(tmp_path)
    assert plain_problem(layout, ScriptState.of_torch(fresh, fresh_opt)) is None
    reader = PlainReader(tmp_path, layout)
    reader.read_all()
    tensors, section = replicated_state(
        reader, plain_schema(layout, ScriptState.of_torch(fresh, fresh_opt)), state
    )
    with_script_objects(state, tensors, section)
    install_checkpoint(state, tensors, section, str(tmp_path))
    for a, b in zip(model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert fresh_opt.param_groups[0]["lr"] == 5e-3
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key, v in opt.state[p].items():
            assert torch.equal(v, fresh_opt.state[q][key]), key
    opt.param_groups[0]["lr"] = 5e-3
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (fresh, fresh_opt)):
        m.eval()
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


# ---- the job -----------------------------------------------------------------------


def step_losses(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> dict[int, float]:
    """What elastrain computes for these steps from this state: its data order
    (GlobalOrder), each micro-batch's RNG seeded from (seed, step, micro-batch),
    the mean loss and gradient over the global batch, then the optimizer step."""
    data = _script().Regression()
    order = GlobalOrder(len(data), SEED)
    model.train()
    out = {}
    for s in steps:
        opt.zero_grad()
        total = 0.0
        for i in range(B // MB):
            ids = order.ids(s * B + i * MB, s * B + (i + 1) * MB)
            with torch.random.fork_rng(devices=[]):
                seed_micro_batch(SEED, s, i)
                loss = _script().loss_fn(model, (data.x[ids], data.y[ids]))
                (loss * MB / B).backward()
            total += float(loss.detach()) * MB
        out[s] = total / B
        opt.step()
    return out


def test_a_job_starts_from_a_plain_dcp_checkpoint_at_its_step(
    tmp_path: Path, run_job: Callable[..., Job]
) -> None:
    """2 workers start from a plain job's checkpoint of step K: the first committed
    step is K, and its loss and the next ones are those the plain model and
    optimizer compute for those steps of elastrain's data order. A second run with
    --resume-from in the same run directory, which now has its own checkpoints, is
    refused. (6-8 s here.)"""
    model, opt = plain_training(K)
    plain = tmp_path / "plain"
    save_plain(plain, model, opt, step=K)
    job = run_job(
        steps=K + 3, workers=2, name="from-plain", resume_from=str(plain), checkpoint_every=2
    )
    assert job.result.status == "done", job.result.message
    assert job.result.resumed_from == K
    loaded = job.of("checkpoint_loaded")
    assert len(loaded) == 2 and {e["step"] for e in loaded} == {K}
    assert all(e["plain"] and e["path"] == str(plain) for e in loaded)
    commits = sorted({e["step"] for e in job.of("step_commit")})
    assert commits == [K, K + 1, K + 2]
    assert check_same_state(job.events) == []  # both members installed the same state
    expected = step_losses(model, opt, range(K, K + 3))
    got = {e["step"]: e["loss"] for e in job.of("step_commit")}
    for s in commits:
        assert math.isclose(got[s], expected[s], rel_tol=1e-5), (s, got[s], expected[s])

    again = run_job(steps=K + 5, workers=2, name="from-plain", resume_from=str(plain))
    assert again.result.status == "failed"
    assert "already has its own checkpoints" in again.result.message
    assert again.launcher.pids == {}


@pytest.mark.parametrize("size", [1, 3])
def test_a_sharded_member_takes_its_rows_from_a_plain_checkpoint(tmp_path: Path, size: int) -> None:
    """A sharded job's member (train_sharded.py's model, its AdamW) reads the rows
    of its slot, and their Adam moments, from a plain checkpoint of the whole model;
    the hyperparameters are the script's."""
    from elastrain.checkpoint.sharded_parts import schema_problem, shard_source
    from elastrain.runtime.sharded import ShardedBackend, shard_rows

    from .test_sharded_checkpoint import SCRIPT, _config

    torch.manual_seed(1)
    plain = SCRIPT.Net()
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        plain(torch.randn(5, 12)).square().mean().backward()
        opt.step()
    save_plain(tmp_path, plain, opt, step=2)
    layout = read_layout(tmp_path)
    params = dict(plain.named_parameters())
    for k in range(size):
        torch.manual_seed(0)
        model = SCRIPT.Net()
        b = ShardedBackend(
            model, torch.optim.AdamW(model.parameters(), lr=3e-3), SCRIPT.loss_fn, _config(size)
        )
        script = ScriptState.of_sharded(b.model_schema())
        assert plain_problem(layout, script) is None
        schema = plain_schema(layout, script)
        assert schema_problem(schema, b) is None
        b.resume_from(shard_source(PlainReader(tmp_path, layout), schema))
        b.place(k, size)
        assert b.optimizer is not None and b.optimizer.param_groups[0]["lr"] == 3e-3
        for name, shape in b._shapes.items():
            lo, hi = shard_rows(shape[0], size, k)
            p = b.local.get_parameter(name.replace(".", "/"))
            assert torch.equal(p.detach(), params[name].detach()[lo:hi])
            st = b.optimizer.state[p]
            assert torch.equal(st["exp_avg"], opt.state[params[name]]["exp_avg"][lo:hi])
            assert torch.equal(st["step"], opt.state[params[name]]["step"])


def test_resume_step_without_resume_from_is_a_clear_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from elastrain.cli import main

    assert main(["run", "--resume-step", "3", MLP]) == 2
    err = capsys.readouterr().err
    assert "--resume-step needs --resume-from DIR" in err and "Traceback" not in err

"""`elastrain export`: a run's newest verified checkpoint as hf, safetensors or dcp.

In-process: checkpoints are written with the library's own save path (a
replicated job's flat checkpoint, `Snapshot` + `CheckpointWriter` + `commit`; a
sharded job's DCP checkpoint, `ShardSnapshot` + `ShardedWriter` +
`commit_sharded`), then exported by `elastrain.cli.main` and loaded by the other
tool (Transformers, safetensors, torch.distributed.checkpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from elastrain.checkpoint import latest_verified
from elastrain.checkpoint.export import ExportError, export_model, model_tensors, wrapper_prefix
from elastrain.checkpoint.files import step_dir
from elastrain.cli import main
from elastrain.transfer.flatten import flatten_state

from .test_checkpoint import save
from .test_sharded_checkpoint import _fresh, _trained_shards, _whole, _write

transformers = pytest.importorskip("transformers")


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


class Wrapped(torch.nn.Module):
    """A training script's own module around the Transformers model."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = tiny_llama()
        self.value_head = torch.nn.Linear(32, 1)


def trained_checkpoint(run_dir: Path, model: torch.nn.Module, step: int = 3) -> None:
    """One AdamW step on a real loss, then a flat checkpoint of model + optimizer
    at `step` in run_dir/checkpoints, as a replicated job writes it (2 stripes)."""
    lm = model.lm if isinstance(model, Wrapped) else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    lm(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    flat = flatten_state(model, opt)
    save(run_dir / "checkpoints", step, dict(flat.tensors), num_shards=2)


@pytest.mark.parametrize("wrapped", [False, True], ids=["as-the-example", "wrapped"])
def test_hf_export_loads_in_transformers_with_the_checkpoint_weights_and_logits(
    tmp_path: Path, wrapped: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    model = Wrapped() if wrapped else tiny_llama()
    lm = model.lm if isinstance(model, Wrapped) else model
    trained_checkpoint(tmp_path / "run", model)
    lm.config.save_pretrained(tmp_path / "cfg")
    out = tmp_path / "out"
    argv = ["export", str(tmp_path / "run"), "--format", "hf", "--hf-config", str(tmp_path / "cfg")]
    assert main([*argv, "-o", str(out)]) == 0
    captured = capsys.readouterr()
    assert "written (100%)" in captured.err
    assert "checkpoint step 3" in captured.out
    wrapper = "prefix 'lm.' stripped, 2 tensors of the wrapper left out"  # value_head's
    assert (wrapper in captured.out) == wrapped
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(loaded) is type(lm)
    ckpt = latest_verified(tmp_path / "run" / "checkpoints")
    assert ckpt is not None
    saved = model_tensors(ckpt)
    prefix = "lm." if wrapped else ""
    got = loaded.state_dict()
    assert sorted(got) == sorted(lm.state_dict())
    for name, t in got.items():
        assert torch.equal(t, saved[prefix + name]), name
    ids = torch.arange(12).reshape(1, 12)
    lm.eval()
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, lm(input_ids=ids).logits)


def test_safetensors_and_dcp_exports_of_a_flat_checkpoint_hold_the_model_only(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp

    model = tiny_llama()
    trained_checkpoint(tmp_path / "run", model)
    want = model.state_dict()

    res = export_model(tmp_path / "run", "safetensors", tmp_path / "st")
    got = load_file(tmp_path / "st" / "model.safetensors")
    assert sorted(got) == sorted(want)  # no optim/..., no obj/...
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert res.tensors == len(want) and res.step == 3

    export_model(tmp_path / "run", "dcp", tmp_path / "dcp")
    fresh = tiny_llama()
    sd = {k: torch.zeros_like(v) for k, v in fresh.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "dcp"))
    assert all(torch.equal(sd[k], want[k]) for k in want)


def test_a_sharded_jobs_dcp_checkpoint_exports_whole_tensors(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    shards = _trained_shards(2)
    _write(tmp_path / "run" / "checkpoints", shards)
    whole = _whole(shards)
    model, _ = _fresh(1)
    params = dict(model.named_parameters())

    export_model(tmp_path / "run", "safetensors", tmp_path / "st")
    got = load_file(tmp_path / "st" / "model.safetensors")
    assert sorted(got) == sorted(model.state_dict())
    for name in params:
        assert torch.equal(got[name], whole[f"model.{name}"]), name

    export_model(tmp_path / "run", "dcp", tmp_path / "dcp")
    sd = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "dcp"))
    model.load_state_dict(sd)
    for name, p in params.items():
        assert torch.equal(p.detach(), whole[f"model.{name}"]), name


def test_export_takes_the_newest_checkpoint_that_verifies_as_resume_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_llama()
    trained_checkpoint(tmp_path / "run", model, step=3)
    at_3 = {k: v.clone() for k, v in model.state_dict().items()}
    trained_checkpoint(tmp_path / "run", model, step=6)
    shard = step_dir(tmp_path / "run" / "checkpoints", 6) / "shard-00001-of-00002.safetensors"
    raw = bytearray(shard.read_bytes())
    raw[-5] ^= 0xFF
    shard.write_bytes(bytes(raw))

    assert (
        main(
            ["export", str(tmp_path / "run"), "--format", "safetensors", "-o", str(tmp_path / "o")]
        )
        == 0
    )
    err = capsys.readouterr()
    assert "checkpoint step 6 fails verification" in err.err and "crc32" in err.err
    assert "checkpoint step 3" in err.out
    got = load_file(tmp_path / "o" / "model.safetensors")
    assert all(torch.equal(got[k], at_3[k]) for k in at_3)


def test_export_errors_name_the_problem_and_write_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    out = tmp_path / "out"

    def fails(*argv: str) -> str:
        assert main(["export", str(run), *argv]) == 2
        assert not out.exists() or not any(out.iterdir())
        assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        return capsys.readouterr().err

    assert "no committed checkpoint that verifies" in fails(
        "--format", "safetensors", "-o", str(out)
    )
    missing = ["export", str(tmp_path / "nope"), "--format", "dcp", "-o", str(out)]
    assert main(missing) == 2
    assert "is not a directory (give the run directory" in capsys.readouterr().err
    trained_checkpoint(run, tiny_llama())
    assert "unknown export format 'onnx'" in fails("--format", "onnx", "-o", str(out))
    assert "needs --hf-config" in fails("--format", "hf", "-o", str(out))
    assert "--hf-config is for --format hf" in fails(
        "--format", "dcp", "--hf-config", str(tmp_path), "-o", str(out)
    )
    other = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    other.save_pretrained(tmp_path / "cfg")
    assert "has shape" in fails(
        "--format", "hf", "--hf-config", str(tmp_path / "cfg"), "-o", str(out)
    )
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(run), "--format", "safetensors", "-o", str(out)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_wrapper_prefix_is_the_one_under_which_every_expected_name_is() -> None:
    expected = {"model.embed.weight": (4, 2), "lm_head.weight": (4, 2)}
    assert wrapper_prefix(["model.embed.weight", "lm_head.weight"], expected) == ""
    names = ["a.lm.model.embed.weight", "a.lm.lm_head.weight", "a.model.embed.weight", "v.w"]
    assert wrapper_prefix(names, expected) == "a.lm."
    with pytest.raises(ExportError, match=r"lacks 1 of the 2 .*'lm_head.weight'"):
        wrapper_prefix(["x.model.embed.weight"], expected)
    with pytest.raises(ExportError, match="no tensor named like 'model.embed.weight'"):
        wrapper_prefix(["xmodel.embed.weight"], expected)

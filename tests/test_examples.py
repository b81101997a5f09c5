"""The examples a user copies from: the porting guide's two scripts and the Hugging
Face causal LM.

The guide (docs/guide/porting.md) shows the diff between examples/porting/ddp_train.py
and examples/porting/elastic_train.py and states how many lines changed; the
first test recomputes both from the files, so the guide cannot drift from them.
The job tests run the elastic scripts briefly under the launcher.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Job

GUIDE = ROOT / "docs" / "guide" / "porting.md"
PORTING = ROOT / "examples" / "porting"
HF_EXAMPLE = str(ROOT / "examples" / "hf_causal_lm.py")


def _count(before: list[str], after: list[str]) -> tuple[int, int, int]:
    """(changed, deleted, added): per hunk of the diff, the larger of the lines
    deleted and added (a rewritten line counts once), summed; and the raw counts."""
    changed = deleted = added = 0
    ops = difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag != "equal":
            changed += max(i2 - i1, j2 - j1)
            deleted += i2 - i1
            added += j2 - j1
    return changed, deleted, added


def test_the_porting_guide_shows_the_real_diff_and_its_count() -> None:
    before = (PORTING / "ddp_train.py").read_text().splitlines()
    after = (PORTING / "elastic_train.py").read_text().splitlines()
    guide = GUIDE.read_text()
    diff = list(
        difflib.unified_diff(before, after, "ddp_train.py", "elastic_train.py", lineterm="")
    )
    shown = re.search(r"```diff\n(.*?)\n```", guide, re.S)
    assert shown is not None, "docs/guide/porting.md has no diff block"
    assert shown.group(1).splitlines() == diff, "the guide's diff is not the scripts' diff"
    stated = re.search(r"Changed lines: \*\*(\d+)\*\* \((\d+) lines deleted, (\d+) added", guide)
    assert stated is not None, "docs/guide/porting.md states no 'Changed lines' count"
    changed, deleted, added = _count(before, after)
    assert tuple(map(int, stated.groups())) == (changed, deleted, added)
    assert changed <= 20, f"porting the DDP script takes {changed} changed lines (target: 20)"


def test_the_ported_script_trains(run_job: Callable[..., Job]) -> None:
    # One worker: what is tested is the script (a kill is tested everywhere else).
    job = run_job(script=str(PORTING / "elastic_train.py"), steps=3, workers=1)
    assert job.result.status == "done", job.result.message
    # Step 0 is an evaluation step: rank 0 printed its validation loss.
    log = job.log("w0")
    assert re.search(r"step 0 loss \d+\.\d+ val loss \d+\.\d+", log), log[-2000:]
    assert {e["step"] for e in job.of("step_commit")} == {0, 1, 2}


# ---------------------------------------------------------------- Hugging Face


def _transformers() -> Any:
    return pytest.importorskip(
        "transformers",
        reason="transformers is not installed (the optional extra: pip install -e '.[hf]')",
    )


def test_a_hugging_face_model_and_schedule_heal_into_a_fresh_member() -> None:
    transformers = _transformers()
    import torch

    from elastrain.transfer import TorchState, state_digest
    from elastrain.transfer.manifest import build_manifest, decode_manifest, encode_manifest

    def member(seed: int) -> tuple[Any, torch.optim.Optimizer, Any]:
        torch.manual_seed(seed)
        cfg = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
        )
        model = transformers.LlamaForCausalLM(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sched = transformers.get_cosine_schedule_with_warmup(opt, 2, 10)
        return model, opt, sched

    model, opt, sched = member(0)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    sender = TorchState(model, opt, {"sched": sched})
    fresh_model, fresh_opt, fresh_sched = member(5)
    receiver = TorchState(fresh_model, fresh_opt, {"sched": fresh_sched})
    flat = sender.flatten()
    m = decode_manifest(
        encode_manifest(build_manifest("torch", flat.tensors, flat.section, [0], {}, 1))
    )
    assert receiver.bound(m) is None and receiver.check(m) is None
    receiver.install({n: t.clone() for n, t in flat.tensors}, json.loads(json.dumps(flat.section)))
    assert state_digest(receiver) == state_digest(sender)
    assert fresh_sched.get_last_lr() == sched.get_last_lr()
    with torch.no_grad():
        torch.testing.assert_close(
            fresh_model(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0
        )


def test_the_hugging_face_example_trains(run_job: Callable[..., Job], tmp_path: Path) -> None:
    _transformers()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from elastrain.observe.report import build_report, render_html

    # Briefly, on one worker; the heal of its state is the test above, and
    # `elastrain run -n 2 --min 2 --fault kill@10 examples/hf_causal_lm.py` shows a kill.
    job = run_job(script=HF_EXAMPLE, steps=2, workers=1, tensorboard=str(tmp_path / "tb"))
    assert job.result.status == "done", job.result.message
    assert re.search(r"step 0 loss \d+\.\d+ lr ", job.log("w0")), job.log("w0")[-2000:]
    commits = {e["step"]: e for e in job.of("step_commit")}
    assert set(commits) == {0, 1}
    # trainer.log("lr", ...): an event per step, the report's last value, TensorBoard.
    logged = [(e["step"], e["value"]) for e in job.of("user_scalar") if e["name"] == "lr"]
    assert [s for s, _ in logged] == [0, 1] and all(v > 0 for _, v in logged)
    rep = build_report(job.run_dir)
    assert rep.scalars == {"lr": (logged[-1][1], 1)}
    assert "<td>lr</td>" in render_html(rep)
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/step_seconds", "user/lr", "goodput/time"} <= set(tags)
    loss = [(s.step, s.value) for s in acc.Scalars("train/loss")]
    assert loss == [(s, pytest.approx(commits[s]["loss"], rel=1e-6)) for s in (0, 1)]
    lr = [(s.step, s.value) for s in acc.Scalars("user/lr")]
    assert lr == [(s, pytest.approx(v, rel=1e-6)) for s, v in logged]
    assert 0 < acc.Scalars("goodput/time")[-1].value <= 1

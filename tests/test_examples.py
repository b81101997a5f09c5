"""The examples a user copies from: the porting guide's two scripts and the Hugging
Face causal LM.

The guides (docs/guide/porting.md, docs/guide/porting-fsdp.md) show the diff between
a torchrun script in examples/porting/ and its elastrain port and state how many
lines changed; the first test recomputes both from the files, so a guide cannot
drift from them. The job tests run the elastic scripts under the launcher (the
FSDP2 port under a kill and under a reshard, against its failure-free run in-process).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from .conftest import ROOT, Job, run_in_process

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


PAIRS = [
    # (guide, torchrun script, its port, most changed lines allowed)
    (GUIDE, "ddp_train.py", "elastic_train.py", 20),
    (ROOT / "docs" / "guide" / "porting-fsdp.md", "fsdp_train.py", "elastic_fsdp_train.py", 25),
]


@pytest.mark.parametrize(("guide", "before_name", "after_name", "most"), PAIRS)
def test_the_porting_guide_shows_the_real_diff_and_its_count(
    guide: Path, before_name: str, after_name: str, most: int
) -> None:
    before = (PORTING / before_name).read_text().splitlines()
    after = (PORTING / after_name).read_text().splitlines()
    text = guide.read_text()
    diff = list(difflib.unified_diff(before, after, before_name, after_name, lineterm=""))
    shown = re.search(r"```diff\n(.*?)\n```", text, re.S)
    assert shown is not None, f"{guide.name} has no diff block"
    assert shown.group(1).splitlines() == diff, f"{guide.name}'s diff is not the scripts' diff"
    stated = re.search(r"Changed lines: \*\*(\d+)\*\* \((\d+) lines deleted, (\d+) added", text)
    assert stated is not None, f"{guide.name} states no 'Changed lines' count"
    changed, deleted, added = _count(before, after)
    assert tuple(map(int, stated.groups())) == (changed, deleted, added)
    assert changed <= most, f"porting {before_name} takes {changed} changed lines (target: {most})"


def test_the_ported_script_trains(run_job: Callable[..., Job]) -> None:
    # One worker: what is tested is the script (a kill is tested everywhere else).
    job = run_job(script=str(PORTING / "elastic_train.py"), steps=3, workers=1)
    assert job.result.status == "done", job.result.message
    # Step 0 is an evaluation step: rank 0 printed its validation loss.
    log = job.log("w0")
    assert re.search(r"step 0 loss \d+\.\d+ val loss \d+\.\d+", log), log[-2000:]
    assert {e["step"] for e in job.of("step_commit")} == {0, 1, 2}


FSDP_PORT = str(PORTING / "elastic_fsdp_train.py")
FSDP_STEPS = 40


def _fsdp_checked(events: list[dict[str, Any]]) -> None:
    """Every step committed, twins alike at every generation start, every sample once."""
    from elastrain.data.order import GlobalOrder
    from elastrain.observe.ledger import check_exactly_once, check_same_state

    assert {e["step"] for e in events if e["kind"] == "step_commit"} == set(range(FSDP_STEPS))
    assert check_same_state(events) == []
    order = GlobalOrder(64 * 60, 0)  # the script's training set, seed 0
    report = check_exactly_once(events, lambda s: order.ids(s * 64, (s + 1) * 64))
    assert report.violations == [] and report.committed_steps == FSDP_STEPS


def _fsdp_port(run_job: Callable[..., Job], name: str, **kw: Any) -> Job:
    job = run_job(script=FSDP_PORT, steps=FSDP_STEPS, workers=4, shard_size=2, name=name, **kw)
    assert job.result.status == "done", job.result.message
    _fsdp_checked(job.events)
    return job


def _first_difference(ref: list[dict[str, Any]], run: Job) -> str:
    """Where `run`'s loss curve first leaves the reference's: that step's shares per
    member (`step_contrib`: generation, sample ids, loss sum), the reference's, and how
    the run's workers were started, so a failure names the member that differs."""
    from elastrain.observe.ledger import loss_curve

    want, got = loss_curve(ref), loss_curve(run.events)
    step = next((s for s in sorted(want) if got.get(s) != want[s]), None)
    if step is None:
        return "the loss curves agree"

    def shares(events: list[dict[str, Any]]) -> list[Any]:
        return [(e.get("proc"), e["gen"], e["samples"], e.get("loss_sum"))
                for e in events if e["kind"] == "step_contrib" and e["step"] == step]  # fmt: skip

    started = [{k: v for k, v in e.items() if k not in ("t", "kind")}
               for e in run.of("worker_spawned")]  # fmt: skip
    return (f"{run.run_dir}: step {step} loss {got.get(step)!r}, reference {want[step]!r}\n"
            f"run's shares: {shares(run.events)}\nreference's: {shares(ref)}\n"
            f"generations: {run.of('generation_ready')[:2]}\nworkers: {started}")  # fmt: skip


def test_the_fsdp_port_keeps_its_curve_through_a_kill_and_a_reshard(
    run_job: Callable[..., Job], tmp_path: Path
) -> None:
    """The FSDP2 port (docs/guide/porting-fsdp.md) as a user runs it: 2 x 2 with a
    rank killed (its twin heals the replacement) and with a rank killed whose
    replacement does not come in time (none: the survivors regroup as 1 x 3). The loss curve,
    the clipped norms, the learning rate and the held-out losses equal the
    failure-free run's, bit for bit (float64 reductions). That run: the script as
    one member in this process (`run_in_process`), whose curve, norms and held-out
    losses a failure-free 2 x 2 job's equal bit for bit (checked)."""
    from elastrain.observe.ledger import loss_curve

    def seen(events: list[dict[str, Any]]) -> tuple[dict[int, float], list[Any], list[Any]]:
        norms = [(e["step"], e["grad_norm"]) for e in events if e["kind"] == "step_commit"]
        evals = sorted({(e["step"], e["sums"]["loss"]) for e in events if e["kind"] == "eval_end"})
        return loss_curve(events), sorted(set(norms)), evals

    clean = run_in_process(FSDP_PORT, tmp_path / "clean", FSDP_STEPS)
    _fsdp_checked(clean.events)
    curve, norms, evals = seen(clean.events)
    assert all(n is not None and n > 0 for _, n in norms)
    assert [s for s, _ in evals] == [20, 40]  # after 20 and 40 steps

    killed = _fsdp_port(run_job, "kill", faults=["kill@12:w1"])
    assert seen(killed.events) == (curve, norms, evals), _first_difference(clean.events, killed)
    assert len(killed.of("worker_spawned")) == 5  # four, and w1's replacement
    log = "".join(f.read_text() for f in sorted((killed.run_dir / "logs").glob("w*.log")))
    # The evaluation after 20 steps comes with the next step's result (r.step 20).
    assert re.search(r"step 20 loss \d+\.\d+ val loss \d+\.\d+", log), log[-2000:]

    # The regroup is due at the first step boundary after the vacancy (0 s): this
    # job's steps take 0.03 s on an idle machine, so a wait of 0.5 s could outlast
    # the 28 steps left after the kill and the job end before it resharded. The
    # replacement comes too late: never (no replacement). A replacement held back
    # past the job's end (a long --replace-delay) is the same vacancy to the
    # coordinator, but the launcher then waits out its 15 s grace for the members
    # still to come before it ends the job.
    resharded = _fsdp_port(
        run_job, "reshard", faults=["kill@12:w1"], reshard_after_s=0.0, replace=False
    )
    assert seen(resharded.events) == (curve, norms, evals), _first_difference(
        clean.events, resharded
    )
    sizes = {e.get("shard_size") for e in resharded.of("generation_ready")}
    assert 3 in sizes, sizes


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

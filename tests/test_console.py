"""Issue 15: the console of `elastrain run` (the leader's output, all members), the
start-up watch, the script checks made before any process starts, and exit codes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from elastrain.cli import exit_status
from elastrain.exitcodes import EXIT_MISCONFIGURED, RUN_PREEMPTED, RUN_USAGE
from elastrain.launch.console import ConsoleMode, LogFollower
from elastrain.launch.preflight import script_problems
from elastrain.launch.startup import Exit, FailureWatch, signature, stop_message, tail
from elastrain.observe.events import read_events
from elastrain.runtime.preflight import Misconfigured, batch_problems, explain, preflight

ROOT = Path(__file__).resolve().parents[1]


def follow(tmp_path: Path, mode: ConsoleMode) -> tuple[LogFollower, list[str]]:
    (tmp_path / "logs").mkdir()
    out: list[str] = []
    return LogFollower(tmp_path, mode, out.append), out


def write(tmp_path: Path, member: str, text: str) -> None:
    with (tmp_path / "logs" / f"{member}.log").open("a") as f:
        f.write(text)


def test_the_console_shows_the_leader_and_follows_it_when_it_moves(tmp_path: Path) -> None:
    f, out = follow(tmp_path, ConsoleMode.LEADER)
    write(tmp_path, "w0", "loading data\n")
    write(tmp_path, "w1", "loading data too\n")
    f.poll()
    assert out == []  # nobody is rank 0 yet: held
    f.update({"members": ["w1", "w0"]})
    write(tmp_path, "w1", "step 1 loss 2.0\npartial")
    write(tmp_path, "w0", "not shown\n")
    f.poll()
    assert out == ["loading data too", "step 1 loss 2.0"]
    f.update({"members": ["w0"]})  # w1 died; w0 is rank 0 now
    write(tmp_path, "w0", "step 2 loss 1.9\n")
    f.poll()
    assert out[2:] == ["elastrain: rank 0 is now w0; its output follows", "step 2 loss 1.9"]
    f.update({"members": ["w1", "w0"]})
    f.close()  # the partial line is shown at the end
    assert out[-1] == "partial"


def test_the_console_can_show_every_member_prefixed(tmp_path: Path) -> None:
    f, out = follow(tmp_path, ConsoleMode.ALL)
    write(tmp_path, "w0", "a\n")
    write(tmp_path, "w1", "b\n")
    write(tmp_path, "coordinator", "never\n")
    f.poll()
    assert sorted(out) == ["[w0] a", "[w1] b"]


def test_batch_problems_say_what_to_change() -> None:
    assert batch_problems(64, 8, 4) == []
    [p] = batch_problems(10, 4)
    assert "does not divide" in p and "micro_batch_size=2" in p
    [p] = batch_problems(16, 4, 5)
    assert "1 worker(s) would get no micro-batch" in p and "-n 4" in p
    with pytest.raises(Misconfigured, match="does not divide"):
        preflight(object(), 10, 4)
    assert "no default process group" in (explain(
        "ValueError: Default process group has not been initialized, please make sure") or "")  # fmt: skip
    assert explain("KeyError: x") is None


DDP_SCRIPT = """
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
def main():
    dist.init_process_group("gloo")
    model = DDP(make())
if __name__ == "__main__":
    main()
"""


def test_script_checks() -> None:
    probs = script_problems(DDP_SCRIPT, 4, "train.py")
    assert len(probs) == 2
    assert probs[0].startswith("train.py:5: ") and "init_process_group" in probs[0]
    assert probs[1].startswith("train.py:6: ") and "DistributedDataParallel" in probs[1]
    guarded = "import os\nif not os.environ.get('ELASTRAIN_COORDINATOR'):\n    dist.init_process_group()\n"
    assert script_problems(guarded, 4) == []
    batch = "cfg = TrainerConfig(global_batch_size=16, micro_batch_size=4, total_steps=9)\n"
    assert script_problems(batch, 4) == []
    assert "no micro-batch" in script_problems(batch, 5)[0]
    assert "does not divide" in script_problems(batch.replace("=16", "=10"), 2)[0]


def test_exit_statuses_of_elastrain_run() -> None:
    assert exit_status("done", "", ("done",)) == 0
    assert (
        exit_status("preempted", "newest committed checkpoint: 6 steps", ("done",)) == RUN_PREEMPTED
    )
    assert exit_status("preempted", "no checkpoint was committed", ("done",)) == 1
    assert exit_status("failed", "x", ("done",)) == 1
    assert exit_status("interrupted", "", ("done",)) == 130


def test_startup_watch_stops_at_the_first_repeat(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    (tmp_path / "events").mkdir()
    tb = 'Traceback (most recent call last):\n  File "t.py", line 3\nValueError: bad batch\n'
    for m in ("w0", "w1", "w2"):
        write(tmp_path, m, tb)
    (tmp_path / "events" / "w2-12.jsonl").write_text('{"kind": "step_commit"}\n')
    w = FailureWatch()
    sig = signature(tail(tmp_path / "logs" / "w0.log"))
    assert sig == signature(tb.splitlines()) == "ValueError: bad batch"
    assert w.on_exit(Exit("w0", 10, 1, 0.0, log_signature=sig)) is None
    # it had committed a step
    assert w.on_exit(Exit("w2", 12, 1, 0.1, committed=True, log_signature=sig)) is None
    assert w.on_exit(Exit("w1", 11, -9, 0.2, log_signature=sig)) is None  # a signal from outside
    stop = w.on_exit(Exit("w1", 11, 1, 0.3, log_signature=sig))
    assert stop is not None and stop.member == "w0"
    log = tmp_path / "logs" / "w0.log"
    msg = stop_message(stop, log, tail(log), "")
    assert "w0 and w1 failed the same way" in msg
    assert "  | ValueError: bad batch" in msg
    write(tmp_path, "w3", "elastrain: misconfigured: the model is wrapped\n")
    stop = FailureWatch().on_exit(Exit("w3", 13, EXIT_MISCONFIGURED, 0.0))
    assert stop is not None and "found a mistake in the script" in stop.head


def run_cli(tmp_path: Path, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "train.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "elastrain.cli", "run", "--plain", "--run-dir",
           str(tmp_path / "run"), *args, str(path)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                            start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def no_process_left(run_dir: Path) -> None:
    if not (run_dir / "events").is_dir():
        return
    for e in read_events(run_dir):
        if e["kind"] in ("worker_spawned", "coordinator_start"):
            assert not Path(f"/proc/{e['pid']}").exists() or "zombie" in Path(
                f"/proc/{e['pid']}/status").read_text().lower(), e  # fmt: skip


@pytest.mark.parametrize(
    ("script", "args", "needle"),
    [
        (DDP_SCRIPT, (), "initialises its own process group"),
        (
            "from elastrain.runtime.config import TrainerConfig\n"
            "c = TrainerConfig(global_batch_size=10, micro_batch_size=4, total_steps=3)\n",
            (),
            "does not divide",
        ),  # fmt: skip
        (
            "c = TrainerConfig(global_batch_size=16, micro_batch_size=4, total_steps=3)\n",
            ("-n", "5"),
            "would get no micro-batch",
        ),  # fmt: skip
    ],
)
def test_mistakes_visible_in_the_script_stop_before_anything_starts(
    tmp_path: Path, script: str, args: tuple[str, ...], needle: str
) -> None:
    r = run_cli(tmp_path, script, *args)
    assert r.returncode == RUN_USAGE and needle in r.stdout and "nothing was started" in r.stdout
    assert not (tmp_path / "run").exists()


def test_workers_failing_the_same_way_stop_the_job_with_their_traceback(tmp_path: Path) -> None:
    script = "import os\nb = int(os.environ.get('GB', '10'))\nraise ValueError(f'global batch {b} is odd')\n"
    r = run_cli(tmp_path, script, "-n", "3")
    assert r.returncode == 1, r.stdout
    assert "failed the same way before their first step" in r.stdout, r.stdout
    assert "  | ValueError: global batch 10 is odd" in r.stdout
    # It stopped at the repeat: nothing was started after the second failure (a
    # replacement would only fail the same way). run_cli's timeout bounds the wait.
    launcher = [e for e in read_events(tmp_path / "run") if e.get("proc") == "launcher"]
    launcher.sort(key=lambda e: e["mono"])
    failed = [i for i, e in enumerate(launcher) if e["kind"] == "worker_exited" and e["returncode"]]
    assert len(failed) >= 2, launcher
    assert not [e for e in launcher[failed[1] :] if e["kind"] == "worker_spawned"], launcher
    no_process_left(tmp_path / "run")

"""`elastrain slurm render` and `status` without a cluster (about 2 s in all).

The rendered script is run by bash against stand-ins for `scontrol`, `srun`
and `elastrain` (small shell scripts on PATH that record their arguments), so
what it does on a batch node is checked, not only its text. The real-cluster
test is tests/test_slurm.py.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from elastrain.cli import build_parser
from elastrain.slurm.cli import main as slurm_main
from elastrain.slurm.config import SlurmConfig, parse_slurm_time
from elastrain.slurm.render import agent_argv, render
from elastrain.slurm.status import current_members, parse_job_line, query, show


def cfg(**kw: object) -> SlurmConfig:
    base: dict[str, object] = {"script": "train.py", "nodes": 2, "gpus_per_node": 8}
    base.update(kw)
    return SlurmConfig(**base)  # type: ignore[arg-type]


def bash_n(text: str, tmp_path: Path) -> None:
    f = tmp_path / "job.sbatch"
    f.write_text(text)
    r = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"spare_nodes": 2, "time": "1-00:00:00", "partition": "gpu", "ckpt_every": 50},
        {"ckpt_every": 20, "ckpt_format": "dcp"},
        {"gpus_per_node": 0, "workers_per_node": 3, "requeue": False, "exclusive": False},
        {"script_args": ("--name", 'it\'s a "test" $HOME `x`'), "run_dir": "/shared/my runs/a"},
        {"coordinator_host": "10.0.0.5", "http_port": 29400, "store_port": 29401},
    ],
)
def test_bash_accepts_every_rendered_script(kw: dict[str, object], tmp_path: Path) -> None:
    bash_n(render(cfg(**kw)), tmp_path)


def test_the_allocation_holds_spares_and_asks_for_the_notice_and_requeue() -> None:
    text = render(cfg(nodes=3, spare_nodes=2, gpus_per_node=4, time="2:00:00", grace_s=90))
    lines = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "#SBATCH --nodes=5" in lines  # agents' nodes + spares
    assert "#SBATCH --gpus-per-node=4" in lines
    assert "#SBATCH --signal=B:TERM@90" in lines
    assert "#SBATCH --requeue" in lines
    assert "#SBATCH --no-kill" in lines  # a failed node does not end the job
    assert "#SBATCH --time=2:00:00" in lines
    assert "AGENT_NODES=3" in text
    assert "--target 12" in text  # 3 nodes x 4 workers
    assert "--grace 75" in text  # the notice's lead minus the 15 s margin
    assert "#SBATCH --no-requeue" in render(cfg(requeue=False))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"nodes": 0}, "nodes must be >= 1"),
        ({"gpus_per_node": 0}, "--workers-per-node"),
        ({"spare_nodes": -1}, "spare_nodes"),
        ({"min_workers": 17}, "between 1 and the job's 16 workers"),
        ({"job_name": "a b"}, "job name"),
        ({"time": "soon"}, "Slurm's formats"),
        ({"time": "1", "grace_s": 120}, "must be longer than the grace"),
        ({"grace_s": 10, "margin_s": 10}, "must exceed margin_s"),
        ({"partition": "gpu;rm"}, "partition"),
        ({"http_port": 70000}, "port"),
        ({"script": ""}, "training script"),
        ({"ckpt_format": "zip"}, r"--ckpt-format must be one of flat, dcp \(got 'zip'\)"),
        ({"heal_auth": "none"}, r"--heal-auth must be one of \('digest', 'mac'\), got 'none'"),
    ],
)
def test_bad_input_is_refused_with_what_to_change(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        cfg(**kw)


def test_the_agents_get_the_checkpoint_format_only_when_given() -> None:
    argv = agent_argv(cfg(ckpt_every=20, ckpt_format="dcp"))
    assert argv[argv.index("--ckpt-format") + 1] == "dcp"
    assert "--ckpt-format dcp" in render(cfg(ckpt_format="dcp"))
    assert "--ckpt-format flat" in render(cfg(ckpt_format="flat"))
    assert "--ckpt-format" not in agent_argv(cfg()) and "--ckpt-format" not in render(cfg())
    # `elastrain agent` accepts what the script runs.
    ap, _ = build_parser()
    args = ap.parse_args([*argv[1:], "--coordinator", "h:1", "train.py"])
    assert args.cmd == "agent" and args.ckpt_format == "dcp" and args.ckpt_every == 20


def test_the_agents_get_the_heal_auth_only_when_given(capsys) -> None:  # type: ignore[no-untyped-def]
    argv = agent_argv(cfg(heal_auth="mac"))
    assert argv[argv.index("--heal-auth") + 1] == "mac"
    assert "--heal-auth" not in agent_argv(cfg()) and "--heal-auth" not in render(cfg())
    ap, _ = build_parser()
    args = ap.parse_args([*argv[1:], "--coordinator", "h:1", "train.py"])
    assert args.cmd == "agent" and args.heal_auth == "mac"
    rc = slurm_main(["render", "--nodes", "2", "--gpus-per-node", "1", "--heal-auth", "digest",
                     "train.py"])  # fmt: skip
    assert rc == 0 and "--heal-auth digest" in capsys.readouterr().out


def test_slurm_times_parse_in_every_format() -> None:
    assert [parse_slurm_time(t) for t in ("30", "5:30", "1:00:00", "2-3", "1-0:01", "1-0:0:5")] == [
        1800, 330, 3600, 183600, 86460, 86405,
    ]  # fmt: skip


def test_the_cli_writes_the_script_and_reports_errors(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "job.sbatch"
    rc = slurm_main(["render", "--nodes", "2", "--gpus-per-node", "1", "--spare-nodes", "1",
                     "-o", str(out), "train.py", "--", "--lr", "3e-4"])  # fmt: skip
    assert rc == 0
    text = out.read_text()
    assert "#SBATCH --nodes=3" in text and "SCRIPT=(train.py --lr 3e-4)" in text
    assert slurm_main(["render", "--nodes", "2", "--gpus-per-node", "0", "t.py"]) == 2
    assert "--workers-per-node" in capsys.readouterr().err
    rc = slurm_main(["render", "--nodes", "2", "--gpus-per-node", "1", "--ckpt-format", "dcp",
                     "-o", str(out), "train.py"])  # fmt: skip
    assert rc == 0 and "--ckpt-format dcp" in out.read_text()
    with pytest.raises(SystemExit) as e:
        slurm_main(["render", "--nodes", "2", "--gpus-per-node", "1", "--ckpt-format", "zip",
                    "train.py"])  # fmt: skip
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--ckpt-format" in err and "'flat', 'dcp'" in err


# ---- the script, run against stand-ins ----------------------------------------

# scontrol: the allocation is n[1-3], or $FAKE_NODELIST once a node has failed.
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames")
    case "$3" in
      "n[1-3]") printf 'n1\\nn2\\nn3\\n' ;;
      "n[1-2]") printf 'n1\\nn2\\n' ;;
      "n[1,3]") printf 'n1\\nn3\\n' ;;
    esac ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=addr-$3 NodeHostName=$3" ;;
  "-o show") echo "JobId=$3 JobName=elastrain ReqNodeList=(null) NodeList=${FAKE_NODELIST:-n[1-3]}" ;;
  *) echo "$*" >>"$FAKE/scontrol.calls" ;;
esac
"""

# srun: record the node, drop srun's own options, run the command.
FAKE_SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do
  case "$1" in --nodelist=*) echo "${1#--nodelist=}" >>"$FAKE/srun.nodes" ;; esac
  shift
done
exec "$@"
"""

# elastrain: the coordinator prints where it listens and ends on SIGINT (done) or
# SIGTERM (the notice: it tells the agents, which then exit 76 as preempted ones
# do). With $AGENT_FAILS the agent of that name exits $AGENT_FAIL_STATUS at once and
# the others end 0 once the script has said what it did about it. It is Python because bash cannot trap the SIGINT a background job ignores;
# the real coordinator, Python too, installs its handler the same way.
FAKE_ELASTRAIN = """#!/bin/bash
echo "$@" >>"$FAKE/argv"
echo $$ >>"$FAKE/pids"
if [[ $1 == coordinator ]]; then
  exec "$FAKE_PY" -c '
import os, signal, sys, time
def term(*_):
    open(os.path.join(os.environ["FAKE"], "notice"), "w").close()
    sys.exit(0)
signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
signal.signal(signal.SIGTERM, term)
print("{\\"host\\": \\"h\\", \\"port\\": 4242, \\"store_port\\": 4243, \\"pid\\": 1}", flush=True)
while True:
    time.sleep(60)
'
fi
touch "$FAKE/agent.$$"
if [[ -n ${AGENT_WAITS:-} ]]; then
  until [[ -e $FAKE/notice ]]; do sleep 0.05; done
  exit 76
fi
if [[ -n ${AGENT_FAILS:-} ]]; then
  prev=
  for a in "$@"; do [[ $prev == --name ]] && name=$a; prev=$a; done
  [[ $name == "$AGENT_FAILS" ]] && exit "$AGENT_FAIL_STATUS"
  until grep -q "the agent step on" "$FAKE/err" 2>/dev/null; do sleep 0.05; done
fi
exit 0
"""


def _fakes(tmp_path: Path) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN),
                       ("elastrain", FAKE_ELASTRAIN)):  # fmt: skip
        f = bin_dir / name
        f.write_text(text)
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE": str(tmp_path),
        "FAKE_PY": sys.executable,
        "SLURM_JOB_ID": "77",
        "SLURM_JOB_NODELIST": "n[1-3]",
        "SLURMD_NODENAME": "n1",
    }


def _stop_all(proc: subprocess.Popen[str], tmp_path: Path) -> None:
    """Teardown: the script, then every stand-in it started, by PID."""
    proc.kill()
    proc.wait()
    pids = tmp_path / "pids"
    for pid in pids.read_text().split() if pids.exists() else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(tmp_path: Path, env: dict[str, str], **kw: object) -> subprocess.Popen[str]:
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg(run_dir=str(tmp_path / "run"), **kw)))
    return subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip


def test_the_script_starts_a_coordinator_and_one_agent_per_node_leaving_spares(
    tmp_path: Path,
) -> None:
    env = _fakes(tmp_path)
    proc = _start(tmp_path, env, spare_nodes=1, gpus_per_node=2, script_args=("--lr", "a b"))
    try:
        _, err = proc.communicate(timeout=30)
    finally:
        _stop_all(proc, tmp_path)
    assert proc.returncode == 0, err
    assert "training finished" in err
    assert sorted((tmp_path / "srun.nodes").read_text().split()) == ["n1", "n2"]  # n3 is the spare
    argv = (tmp_path / "argv").read_text().splitlines()
    coord = [a for a in argv if a.startswith("coordinator")]
    assert coord == [f"coordinator --bind addr-n1:0 --store-port 0 --run-dir {tmp_path / 'run'} "
                     "--job-id elastrain --target 4 --min 1 --grace 105"]  # fmt: skip
    agents = sorted(a for a in argv if a.startswith("agent"))
    assert len(agents) == 2
    for node, a in zip(("n1", "n2"), agents, strict=True):
        assert "--nproc 2" in a and "--coordinator addr-n1:4242" in a
        assert "--devices 0,1" in a  # one GPU per worker
        assert f"--name {node}-r0 --host addr-{node}" in a
        assert a.endswith("train.py -- --lr a b")
    token = tmp_path / "run" / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600 and len(token.read_text()) == 64
    # The token is only ever in its file: on no command line.
    assert token.read_text() not in (tmp_path / "argv").read_text()
    assert not (tmp_path / "scontrol.calls").exists()  # finished: no requeue


def test_the_notice_reaches_the_coordinator_and_a_preempted_job_requeues_itself(
    tmp_path: Path,
) -> None:
    env = {**_fakes(tmp_path), "AGENT_WAITS": "1"}
    proc = _start(tmp_path, env, nodes=2, gpus_per_node=1)
    try:
        deadline = time.monotonic() + 20
        while len(list(tmp_path.glob("agent.*"))) < 2:
            assert time.monotonic() < deadline, "the agents did not start"
            time.sleep(0.05)  # polling files the script's processes write
        proc.send_signal(signal.SIGTERM)  # what --signal=B:TERM@grace delivers
        _, err = proc.communicate(timeout=30)
    finally:
        _stop_all(proc, tmp_path)
    assert (tmp_path / "notice").exists(), err
    assert proc.returncode == 76, err
    assert (tmp_path / "scontrol.calls").read_text().split() == ["requeue", "77"]


def test_status_parses_slurm_and_the_run_directory(tmp_path: Path) -> None:
    line = "77|RUNNING|1:02|2:00:00|3|n[1-3]|None|/home/u\n"
    job = parse_job_line("77.batch|x|x|x|x|x|x|x\n" + line, "77", "squeue")
    assert job is not None and job.state == "RUNNING" and job.nodelist == "n[1-3]"
    ev = [
        {"kind": "generation_ready", "t": 1.0, "gen": 1, "members": ["a", "b"]},
        {"kind": "generation_ready", "t": 2.0, "gen": 2, "members": ["c", "a"]},
    ]
    assert current_members(ev) == (2, ["a", "c"])
    job2, note = query("77", which=lambda _: None)
    assert job2 is None and "not found here" in note
    calls: list[list[str]] = []

    def fake_run(argv: list[str]) -> tuple[int, str, str]:
        calls.append(argv)
        if argv[0] == "squeue":
            return 1, "", "slurm_load_jobs error: Invalid job id specified"
        return 0, line.replace("RUNNING", "COMPLETED"), ""

    rc, text = show("77", tmp_path / "nothing", run=fake_run, which=lambda c: f"/usr/bin/{c}")
    assert [c[0] for c in calls] == ["squeue", "sacct"]  # sacct answered: no scontrol
    assert "COMPLETED" in text and "no events/" in text and rc == 0


@pytest.mark.parametrize(
    ("fail_status", "nodelist", "spares", "replaced", "why"),
    [
        # The step was killed (`scancel --signal=KILL JOB.STEP`: srun exits 137).
        (137, "n[1-3]", 1, True, "ended with status 137"),
        # Slurm's node failure: the node leaves the allocation and srun exits 0.
        (0, "n[1,3]", 1, True, "ended with status 0, its node removed from the allocation"),
        # No spare node: the status counts, as without one.
        (137, "n[1-3]", 0, False, "ended with status 137"),
    ],
)
def test_a_failed_agent_step_is_replaced_on_the_next_spare_node(
    fail_status: int, nodelist: str, spares: int, replaced: bool, why: str, tmp_path: Path
) -> None:
    env = {**_fakes(tmp_path), "AGENT_FAILS": "n2-r0", "AGENT_FAIL_STATUS": str(fail_status),
           "FAKE_NODELIST": nodelist}  # fmt: skip
    if not spares:
        # Every node of the allocation past the agents' is a spare to the script.
        env["SLURM_JOB_NODELIST"] = env["FAKE_NODELIST"] = "n[1-2]"
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg(run_dir=str(tmp_path / "run"), nodes=2, gpus_per_node=1,
                                 spare_nodes=spares)))  # fmt: skip
    with open(tmp_path / "err", "w") as err_file:
        proc = subprocess.Popen(["bash", str(script)], env=env, cwd=tmp_path, text=True,
                                stdout=subprocess.DEVNULL, stderr=err_file)  # fmt: skip
        try:
            proc.wait(timeout=30)
        finally:
            _stop_all(proc, tmp_path)
    err = (tmp_path / "err").read_text()
    assert f"the agent step on n2 {why}" in err, err
    srun_nodes = (tmp_path / "srun.nodes").read_text().split()
    agents = [a for a in (tmp_path / "argv").read_text().splitlines() if a.startswith("agent")]
    if replaced:
        assert "a replacement agent starts on spare node n3" in err, err
        assert sorted(srun_nodes) == ["n1", "n2", "n3"]
        # The same agent line as the first agents', with the spare's name and address.
        spare = [a for a in agents if "--name n3-r0 " in a]
        assert len(spare) == 1 and "--host addr-n3" in spare[0]
        assert spare[0].replace("n3-r0 --host addr-n3", "n2-r0 --host addr-n2") in agents
        assert proc.returncode == 0, err  # the replaced agent's status does not count
        assert "training finished" in err
    else:
        assert "not replaced (no spare node left)" in err, err
        assert sorted(srun_nodes) == ["n1", "n2"]
        assert proc.returncode == fail_status, err

"""Configuration in one place: the worker's environment read once, the launcher's
overrides applied by one function, each component's section of TrainerConfig,
and `elastrain run`'s defaults taken from LaunchConfig."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from elastrain import env
from elastrain.cli import _add_run_args
from elastrain.launch.config import LaunchConfig
from elastrain.runtime.config import TrainerConfig, WorkerEnv, read_worker_env, worker_setup


def base(**kw: object) -> TrainerConfig:
    return TrainerConfig(global_batch_size=8, micro_batch_size=2, total_steps=10, **kw)  # type: ignore[arg-type]


def test_the_worker_environment_is_read_in_one_place(tmp_path: Path) -> None:
    tok = tmp_path / "token"
    tok.write_text("s3cret\n")
    w = read_worker_env(
        {
            env.COORDINATOR: "127.0.0.1:5",
            env.TOKEN_FILE: str(tok),
            env.MEMBER_ID: "w3",
            env.RUN_DIR: "/r",
            env.ADVERTISE_HOST: "10.0.0.2",
            env.CKPT_DIR: "/r/ck",
            env.RESUME: "latest",
            env.STEPS: "40",
            env.CKPT_EVERY: "5",
            env.CKPT_MTBF: "3600",
        }
    )
    assert w == WorkerEnv(
        coordinator="127.0.0.1:5",
        token="s3cret",
        member="w3",
        run_dir="/r",
        host="10.0.0.2",
        checkpoint_dir="/r/ck",
        resume="latest",
        steps=40,
        checkpoint_every=5,
        checkpoint_mtbf_s=3600.0,
    )
    # The token itself wins over the file; an empty environment is all defaults.
    assert read_worker_env({env.TOKEN: "t", env.TOKEN_FILE: str(tok)}).token == "t"
    assert read_worker_env({}) == WorkerEnv()


def test_a_bad_number_names_the_variable() -> None:
    with pytest.raises(ValueError, match=r"\$ELASTRAIN_STEPS='forty'"):
        read_worker_env({env.STEPS: "forty"})


def test_the_launchers_overrides_win_over_the_script_and_arguments_over_both() -> None:
    w = WorkerEnv(coordinator="a:1", token="t", steps=40, checkpoint_every=5)
    cfg = w.apply(base(checkpoint_every=50))
    assert (cfg.total_steps, cfg.checkpoint_every, cfg.checkpoint_mtbf_s) == (40, 5, None)
    assert WorkerEnv().apply(base()) == base()
    assert w.overridden(coordinator="b:2", member="w9") == dataclasses.replace(
        w, coordinator="b:2", member="w9"
    )
    assert w.overridden() is w


def test_worker_setup_reads_the_process_environment_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(env.STEPS, "7")
    monkeypatch.setenv(env.COORDINATOR, "127.0.0.1:9")
    where, cfg = worker_setup(base(), None, "tok", None, None)
    assert (where.coordinator, where.token, cfg.total_steps) == ("127.0.0.1:9", "tok", 7)


def test_each_component_reads_its_own_section() -> None:
    c = base(
        hang_timeout_floor_s=2.0,
        hang_timeout_ceiling_s=9.0,
        hang_timeout_multiplier=4.0,
        initial_hang_timeout_s=5.0,
        rendezvous_timeout_s=3.0,
        heal_timeout_s=60.0,
        coordinator_timeout_s=4.0,
        checkpoint_every=5,
        checkpoint_keep_last=2,
        checkpoint_fsync=False,
    )
    assert (c.watchdog.floor_s, c.watchdog.ceiling_s, c.watchdog.multiplier) == (2.0, 9.0, 4.0)
    assert c.watchdog.initial_s == 5.0
    assert (c.timeouts.rendezvous_s, c.timeouts.heal_s, c.timeouts.coordinator_s) == (3, 60, 4)
    assert (c.checkpoint.every, c.checkpoint.keep_last, c.checkpoint.fsync) == (5, 2, False)


def test_run_flags_default_to_the_launch_config() -> None:
    ap = argparse.ArgumentParser()
    _add_run_args(ap)
    args = ap.parse_args([])
    defaults = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    assert args.workers == defaults["workers"]
    assert args.min_workers == defaults["min_workers"]
    assert args.replace_delay == defaults["replace_delay_s"]
    assert args.grace == defaults["grace_s"]
    assert args.seed == defaults["seed"]


def test_the_launchers_shard_size_reaches_the_trainer_config() -> None:
    w = read_worker_env({env.SHARD_SIZE: "2"})
    assert w.shard_size == 2 and w.apply(base()).shard_size == 2
    # Not given: the script's own value stands.
    assert WorkerEnv().apply(base(shard_size=4)).shard_size == 4
    with pytest.raises(ValueError, match="shard_size must be >= 1"):
        base(shard_size=0)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["-n", "3", "--shard-size", "2"], "-n 3 is not a multiple of --shard-size 2"),
        (["-n", "4", "--min", "3", "--shard-size", "2"], "--min 3 is not a multiple"),
        (["-n", "2", "--shard-size", "0"], "--shard-size must be >= 1"),
        (["-n", "4", "--reshard-after", "30"], "it needs --shard-size S with S > 1"),
        (["-n", "4", "--shard-size", "2", "--reshard-after", "-1"], "--reshard-after must be"),
        (["-n", "4", "--shard-size", "2", "--memory-per-member", "2G"], "pass --reshard-after"),
        (["-n", "4", "--shard-size", "2", "--state-factor", "0"], "--state-factor must be > 0"),
        (["-n", "2", "--spares", "-1"], "--spares must be >= 0"),
        (["-n", "2", "--spares", "1", "--no-replace"], "would never be refilled"),
        (["-n", "2", "--evict-stragglers"], "add --spares K"),
        (["-n", "2", "--spares", "1", "--evict-threshold", "1"], "must be a factor > 1"),
    ],
)
def test_run_wants_whole_replica_groups_before_starting_anything(
    tmp_path: Path, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrain.cli import main
    from elastrain.exitcodes import RUN_USAGE

    from .conftest import MLP

    run_dir = tmp_path / "run"
    assert main(["run", "--run-dir", str(run_dir), *args, MLP]) == RUN_USAGE
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not run_dir.exists()  # nothing was started


def test_the_fewest_members_default_to_one_replica_group() -> None:
    from .conftest import MLP

    assert LaunchConfig(script=MLP, workers=4, shard_size=2).min_workers == 2
    assert LaunchConfig(script=MLP, workers=4).min_workers == 1
    # An agent runs its node's share of the job: its -n need not be whole groups.
    agent = LaunchConfig(script=MLP, workers=1, shard_size=2, coordinator="h:1", token="t")
    assert agent.min_workers == 1


def test_the_token_comes_from_one_place_for_coordinator_and_workers(tmp_path: Path) -> None:
    from elastrain import env
    from elastrain.runtime.config import read_worker_env

    f = tmp_path / "token"
    f.write_text("s3cret\n")
    assert env.read_token({env.TOKEN_FILE: str(f)}) == "s3cret"
    # The variable wins over the file; whitespace is never part of a token.
    assert env.read_token({env.TOKEN: " abc \n", env.TOKEN_FILE: str(f)}) == "abc"
    assert env.read_token({}) is None
    assert read_worker_env({env.TOKEN_FILE: str(f)}).token == "s3cret"


def test_run_reads_a_memory_budget_with_a_suffix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrain.cli import main

    from .conftest import MLP

    ap = argparse.ArgumentParser()
    _add_run_args(ap)
    assert ap.parse_args(["--memory-per-member", "512M"]).memory_per_member == 512 * 10**6
    assert ap.parse_args(["--memory-per-member", "2Gi"]).memory_per_member == 2 * 2**30
    assert ap.parse_args([]).memory_per_member is None
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        main(["run", "--run-dir", str(run_dir), "--memory-per-member", "2X", MLP])
    assert e.value.code == 2
    assert "'2X' is not a size in bytes: use e.g. 512M, 2G" in capsys.readouterr().err
    assert not run_dir.exists()


def test_the_resharding_policy_reaches_the_coordinator() -> None:
    from elastrain.control.server import parse_args

    from .conftest import MLP

    launch = LaunchConfig(
        script=MLP,
        workers=4,
        shard_size=2,
        reshard_after_s=30.0,
        memory_per_member=2 * 10**9,
        state_factor=5.0,
    )
    _, _, cfg = parse_args(["--target", "4", *launch.coordinator_policy_args()])
    assert (cfg.shard_size, cfg.reshard_after_s, cfg.memory_per_member, cfg.state_factor) == (
        2,
        30.0,
        2 * 10**9,
        5.0,
    )
    # Unset, the coordinator never reshards.
    _, _, cfg = parse_args(["--target", "4", *LaunchConfig(script=MLP).coordinator_policy_args()])
    assert (cfg.shard_size, cfg.reshard_after_s, cfg.memory_per_member) == (1, None, None)
    # The coordinator's own command line takes sizes with suffixes too.
    _, _, cfg = parse_args(
        [
            "--target",
            "4",
            "--shard-size",
            "2",
            "--reshard-after",
            "5",
            "--memory-per-member",
            "16Gi",
        ]
    )
    assert cfg.memory_per_member == 16 * 2**30


def test_an_agent_leaves_the_resharding_policy_to_its_coordinator() -> None:
    from .conftest import MLP

    with pytest.raises(ValueError, match="pass it to `elastrain coordinator`"):
        LaunchConfig(
            script=MLP, workers=2, shard_size=2, coordinator="h:1", token="t", reshard_after_s=5.0
        )


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--reshard-after", "5"], "needs shard_size > 1"),
        (["--shard-size", "2", "--reshard-after", "5", "--memory-per-member", "lots"], "lots"),
        (["--shard-size", "2", "--memory-per-member", "1G"], "set reshard_after_s too"),
    ],
)
def test_the_coordinator_refuses_a_bad_resharding_policy(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrain.control.server import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--target", "4", *argv])
    assert e.value.code == 2
    assert needle in capsys.readouterr().err

"""Issue 19 item 5: `elastrain run --config job.toml` -- every flag has a key, the
command line overrides the file, the file overrides the defaults; unknown keys and
wrong types are errors that name the key."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from elastrain import cli
from elastrain.launch.config import LaunchConfig
from elastrain.launch.config_file import ConfigFileError, file_defaults, flag_keys

from .conftest import MLP


def parsed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, toml: str, *argv: str, cmd: str = "run"
) -> argparse.Namespace:
    """What `elastrain CMD --config FILE ARGV` hands the command, with FILE holding `toml`."""
    path = tmp_path / "job.toml"
    path.write_text(toml)
    got: list[argparse.Namespace] = []
    monkeypatch.setattr(cli, f"cmd_{cmd}", lambda a: got.append(a) or 0)
    assert cli.main([cmd, "--config", str(path), *argv]) == 0
    return got[0]


def test_the_command_line_overrides_the_file_and_the_file_the_defaults(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    toml = (
        f'script = "{MLP}"\nworkers = 3\nreplace_delay = 2\ngrace = 7\n'
        'fault = ["kill@15", "hang@30/6"]\n'
        'shard-size = 2\nreshard_after = 30\nmemory-per-member = "2G"\n'
    )
    args = parsed(monkeypatch, tmp_path, toml, "-n", "4", "--fault", "kill@4", MLP, "--", "--x")
    cfg = cli._launch_config(args, args.script, args.script_args)
    assert isinstance(cfg, LaunchConfig)
    assert cfg.workers == 4  # the flag, over the file's 3
    assert [(f.kind, f.at_step) for f in cfg.faults] == [("kill", 4)]  # replaced, not added to
    assert cfg.replace_delay_s == 2.0 and cfg.grace_s == 7.0  # the file, over the defaults
    assert cfg.memory_per_member == 2 * 10**9  # the flag's own suffixes
    assert cfg.seed == LaunchConfig(script=MLP).seed  # neither: the default
    assert cfg.script_args == ["--x"]
    # Without flags the file's values stand.
    args = parsed(monkeypatch, tmp_path, toml)
    assert (args.script, args.workers, args.fault) == (MLP, 3, ["kill@15", "hang@30/6"])


def value_for(action: argparse.Action) -> tuple[Any, Any]:
    """A TOML value for the flag of `action`, and what the command should get."""
    if action.nargs == 0:
        return True, True
    if action.nargs == argparse.REMAINDER or isinstance(action.default, list):
        return ["a", "b"], ["a", "b"]
    if action.choices is not None:
        last = list(action.choices)[-1]
        return last, last
    if action.type is int:
        return 7, 7
    if action.type is float:
        return 3, 3.0
    if action.type is None:
        return "some-text", "some-text"
    if action.dest == "devices":
        return "0,1,2,3", ("0", "1", "2", "3")
    return "2Ki", 2048  # --memory-per-member, a size


@pytest.mark.parametrize("cmd", ["run", "agent"])
def test_every_flag_has_a_key_with_dashes_or_underscores(cmd: str) -> None:
    sub = cli.build_parser()[1][cmd]
    keys = flag_keys(sub)
    for action in sub._actions:
        if isinstance(action, argparse._HelpAction) or "--config" in action.option_strings:
            continue
        name = next((o for o in action.option_strings if o.startswith("--")), action.dest)
        key = name.lstrip("-")
        assert keys[key.replace("_", "-")] is action, key
        given, want = value_for(action)
        for spelling in (key.replace("_", "-"), key.replace("-", "_")):
            assert file_defaults({spelling: given}, sub, "job.toml") == {action.dest: want}


@pytest.mark.parametrize(
    "toml, needle",
    [
        ("replace-dealy = 2", "unknown key 'replace-dealy' (did you mean 'replace-delay'?)"),
        ("ckpt_evry = 5", "unknown key 'ckpt_evry' (did you mean 'ckpt-every'?)"),
        ("zzz = 1", "unknown key 'zzz' (see --help for the flags)"),
        ('workers = "4"', "'workers' must be an integer, got a string ('4')"),
        ("grace = true", "'grace' must be a number, got a boolean (True)"),
        ('fault = "kill@15"', "'fault' must be an array of strings, got a string"),
        ("plain = 1", "'plain' must be a boolean (true or false), got an integer (1)"),
        ('console = "some"', "'console' must be one of 'leader', 'all', 'none', got 'some'"),
        ('memory-per-member = "2X"', "'memory-per-member': '2X' is not a size in bytes"),
        ("[workers]\nn = 2", "'workers' must be an integer, got a table"),
        ("grace = 1\ngrace_ = 2", "unknown key 'grace_'"),
        ("replace-delay = 1\nreplace_delay = 2", "'replace_delay' sets the same flag as"),
        ('config = "other.toml"', "a config file cannot name another"),
        ("workers = ", "not valid TOML"),
    ],
)
def test_bad_config_files_are_errors_naming_the_key(
    tmp_path: Path, toml: str, needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(toml + "\n")
    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--config", str(path), "--run-dir", str(run_dir), MLP])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"elastrain run: error: {path}" in err and needle in err, err
    assert "Traceback" not in err
    assert not run_dir.exists()  # nothing was started


def test_a_flag_of_another_command_is_an_unknown_key() -> None:
    agent = cli.build_parser()[1]["agent"]
    with pytest.raises(ConfigFileError, match="unknown key 'hosts'"):
        file_defaults({"hosts": 2}, agent, "node.toml")  # --hosts is run's alone


def test_an_agent_takes_its_coordinator_from_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parsed(
        monkeypatch, tmp_path, f'coordinator = "10.0.0.1:29400"\nname = "node7"\nscript = "{MLP}"',
        cmd="agent",
    )  # fmt: skip
    assert (args.coordinator, args.name, args.script) == ("10.0.0.1:29400", "node7", MLP)
    with pytest.raises(SystemExit):
        cli.main(["agent", MLP])
    assert "--coordinator HOST:PORT is required" in capsys.readouterr().err

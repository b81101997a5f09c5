"""`elastrain run --config job.toml`: a job's flags in a TOML file.

Three layers, lowest first: the flags' defaults (`LaunchConfig`'s), the file,
the command line. The file's keys are read off the command's own argparse
actions, so every flag has a key the day it is added and nothing here lists
them: a key is a flag's long name without its dashes (`replace-delay`, or
`replace_delay`: dashes and underscores are the same), `script` and
`script-args` are the positionals. The file layer is the parser's defaults
(`argparse.ArgumentParser.set_defaults`), so a flag given on the command line
replaces the file's value like it replaces a default; `AppendReplacingDefault`
gives repeatable flags (`--fault`) the same rule instead of argparse's
appending to the default.

TOML is read by `tomllib`; this module only maps its table onto the flags and
checks it: an unknown key is an error naming the closest valid one, a value of
the wrong type an error naming the key and the type it wants.
"""

from __future__ import annotations

import argparse
import difflib
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CONFIG_FLAG = "--config"


class ConfigFileError(ValueError):
    """A config file that cannot be read or does not fit the command's flags."""


class AppendReplacingDefault(argparse.Action):
    """A repeatable flag (`action="append"`) whose default -- a config file's
    list -- is replaced by the flags given on the command line, not extended
    (argparse's `append` copies the default and adds to it)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        items = getattr(namespace, self.dest, None)
        # argparse puts the default itself in the namespace: still it, this is
        # the first occurrence on the command line.
        if items is self.default or items is None:
            items = []
        setattr(namespace, self.dest, [*items, values])


def _key(name: str) -> str:
    return name.lstrip("-").replace("_", "-")


def flag_keys(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Config key -> the action it sets: every long flag name (aliases too) and
    every positional of `parser`; not -h nor --config itself."""
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        names = [o for o in action.option_strings if o.startswith("--")] or [action.dest]
        for name in names:
            if name != CONFIG_FLAG:
                out[_key(name)] = action
    return out


def _kind(value: object) -> str:
    """A TOML value's type in the words of the error messages."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


def _value(key: str, action: argparse.Action, value: object, source: str) -> object:
    """`value` as the action would have stored it from the command line, or a
    ConfigFileError naming the key and the type it wants."""

    def wrong(want: str) -> ConfigFileError:
        return ConfigFileError(f"{source}: {key!r} must be {want}, got {_kind(value)} ({value!r})")

    if action.nargs == 0:  # store_true: the flag's presence
        if not isinstance(value, bool):
            raise wrong("a boolean (true or false)")
        return value
    if isinstance(action, AppendReplacingDefault | argparse._AppendAction) or (
        action.nargs == argparse.REMAINDER
    ):
        if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise wrong("an array of strings")
        return list(value)
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        out: object = value
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise wrong("a number")
        out = float(value)
    elif action.type is None:
        if not isinstance(value, str):
            raise wrong("a string")
        out = value
    else:  # a converter of the flag's text (a size with a suffix, say)
        if isinstance(value, bool) or not isinstance(value, int | str):
            raise wrong(f"a string or an integer ({action.metavar or action.dest})")
        convert: Any = action.type
        try:
            out = convert(str(value))
        except (argparse.ArgumentTypeError, ValueError) as e:
            raise ConfigFileError(f"{source}: {key!r}: {e}") from None
    if action.choices is not None and out not in action.choices:
        options = ", ".join(repr(c) for c in action.choices)
        raise ConfigFileError(f"{source}: {key!r} must be one of {options}, got {value!r}")
    return out


def file_defaults(
    table: Mapping[str, object], parser: argparse.ArgumentParser, source: str
) -> dict[str, object]:
    """The parser defaults (dest -> value) that a config file's top-level table
    sets. Raises ConfigFileError for an unknown key (naming the closest valid
    one), a key given twice (dashes and underscores), or a wrong type."""
    keys = flag_keys(parser)
    out: dict[str, object] = {}
    seen: dict[str, str] = {}
    for raw, value in table.items():
        key = _key(raw)
        if key == _key(CONFIG_FLAG):
            raise ConfigFileError(f"{source}: 'config': a config file cannot name another")
        action = keys.get(key)
        if action is None:
            close = difflib.get_close_matches(key, list(keys), n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see --help for the flags"
            raise ConfigFileError(f"{source}: unknown key {raw!r} ({hint})")
        if action.dest in seen:
            raise ConfigFileError(
                f"{source}: {raw!r} sets the same flag as {seen[action.dest]!r}: give it once"
            )
        seen[action.dest] = raw
        out[action.dest] = _value(raw, action, value, source)
    return out


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The TOML file's top-level table; ConfigFileError if it is missing or not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{path}: not valid TOML: {e}") from None


def apply_config_file(parser: argparse.ArgumentParser, path: str | Path) -> None:
    """Make the config file at `path` the defaults of `parser` (one command's
    parser): parse the command line again afterwards and its flags win."""
    parser.set_defaults(**file_defaults(read_config_file(path), parser, str(path)))

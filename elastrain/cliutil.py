"""What the subcommand CLIs (`elastrain k8s`, `elastrain slurm`) share: their error
line and how they write a generated file."""

from __future__ import annotations

import argparse
import os
import sys

from elastrain.checkpoint.config import CheckpointFormat


def error(prog: str, msg: str) -> int:
    """Print ``<prog>: error: <msg>`` on stderr; return the usage-error exit status."""
    print(f"{prog}: error: {msg}", file=sys.stderr)
    return 2


def write_output(path: str | None, text: str, mode: int) -> bool:
    """Write ``text`` to ``path``, created with ``mode`` from the start (a file holding
    a secret is never readable by others, even briefly), or to stdout when ``path``
    is None. Returns whether a file was written."""
    if path is None:
        sys.stdout.write(text)
        return False
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def add_ckpt_format(parser: argparse.ArgumentParser) -> None:
    """The renderers' ``--ckpt-format``: what the rendered job's workers write."""
    parser.add_argument(
        "--ckpt-format",
        choices=[f.value for f in CheckpointFormat],
        default=None,
        help="how the workers write checkpoints: flat or dcp (torch.distributed.checkpoint; "
        "docs/guide/checkpoints.md) (default: the script's, flat)",
    )

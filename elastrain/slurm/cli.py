"""`elastrain slurm render|status` (see docs/guide/slurm.md).

elastrain slurm render --nodes 4 --gpus-per-node 8 --spare-nodes 1 --time 12:00:00 \\
    -o job.sbatch train.py -- --lr 3e-4
sbatch job.sbatch
elastrain slurm status 12345 --run-dir runs/elastrain
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from elastrain.cliutil import add_ckpt_format, error, write_output
from elastrain.launch.config import HEAL_AUTHS

PROG = "elastrain slurm"


def _err(msg: str) -> int:
    return error(PROG, msg)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="write the job's sbatch script")
    r.add_argument("--nodes", type=int, required=True, help="nodes that run an agent")
    r.add_argument(
        "--gpus-per-node", type=int, required=True, metavar="G", help="GPUs per node (0: none)"
    )
    r.add_argument(
        "--workers-per-node",
        type=int,
        default=None,
        metavar="W",
        help="workers per agent (default: G, one per GPU; required with --gpus-per-node 0)",
    )
    r.add_argument(
        "--spare-nodes",
        type=int,
        default=0,
        metavar="K",
        help="extra nodes held in the allocation without an agent; a lost agent node's "
        "replacement starts on one (default 0)",
    )
    r.add_argument("--min", type=int, default=1, dest="min_workers", help="fewest members (1)")
    r.add_argument("--time", default=None, help="time limit (sbatch --time)")
    r.add_argument("--partition", default=None, help="partition (sbatch --partition)")
    r.add_argument(
        "--grace",
        type=int,
        default=120,
        metavar="S",
        help="seconds before the time limit for the notice: emergency checkpoint, "
        "exit, requeue (default 120)",
    )
    r.add_argument(
        "--margin",
        type=int,
        default=15,
        metavar="S",
        help="part of --grace kept for exiting and requeueing (default 15)",
    )
    r.add_argument("--job-name", default="elastrain", help="job name (default elastrain)")
    r.add_argument(
        "--run-dir",
        default=None,
        help="run directory on shared storage (default runs/JOB_NAME in the submit directory)",
    )
    r.add_argument(
        "--ckpt-every", type=int, default=None, metavar="STEPS", help="checkpoint every STEPS"
    )
    add_ckpt_format(r)
    r.add_argument(
        "--heal-auth",
        choices=HEAL_AUTHS,
        default=None,
        help="how the workers' heals vouch for the state they install, as elastrain run "
        "--heal-auth: digest or mac (docs/design/trust.md; default: the script's, digest)",
    )
    r.add_argument(
        "--no-requeue", action="store_true", help="no --requeue, no requeue after the notice"
    )
    r.add_argument(
        "--shared-nodes", action="store_true", help="do not ask for whole nodes (--exclusive)"
    )
    r.add_argument(
        "--elastrain",
        default="elastrain",
        metavar="CMD",
        help="how the nodes run elastrain, e.g. '/shared/venv/bin/python -m elastrain.cli' "
        "(default elastrain)",
    )
    r.add_argument(
        "--coordinator-host",
        default=None,
        help="address the coordinator binds and agents use (default: the batch node's NodeAddr)",
    )
    r.add_argument("--port", type=int, default=0, help="coordinator HTTP port (default: free)")
    r.add_argument("--store-port", type=int, default=0, help="TCPStore port (default: free)")
    r.add_argument("-o", "--output", default=None, help="the script's file (default stdout)")
    r.add_argument("script", help="the training script")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="after --: its arguments")

    s = sub.add_parser("status", help="a job's Slurm state, members and goodput")
    s.add_argument("job_id", metavar="JOBID")
    s.add_argument("--run-dir", default=None, help="the job's run directory")
    return ap


def cmd_render(args: argparse.Namespace) -> int:
    from elastrain.slurm.config import SlurmConfig
    from elastrain.slurm.render import render

    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    try:
        elastrain = tuple(shlex.split(args.elastrain))
        cfg = SlurmConfig(
            script=args.script,
            script_args=tuple(script_args),
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            workers_per_node=args.workers_per_node,
            spare_nodes=args.spare_nodes,
            min_workers=args.min_workers,
            job_name=args.job_name,
            run_dir=args.run_dir,
            time=args.time,
            partition=args.partition,
            grace_s=args.grace,
            margin_s=args.margin,
            ckpt_every=args.ckpt_every,
            ckpt_format=args.ckpt_format,
            heal_auth=args.heal_auth,
            requeue=not args.no_requeue,
            exclusive=not args.shared_nodes,
            elastrain=elastrain,
            coordinator_host=args.coordinator_host,
            http_port=args.port,
            store_port=args.store_port,
        )
    except ValueError as e:
        return _err(str(e))
    text = render(cfg)
    if write_output(args.output, text, 0o755):
        print(f"wrote {args.output}: submit it with `sbatch {args.output}`", file=sys.stderr)
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from elastrain.slurm.status import show

    if not args.job_id.replace("_", "").isdigit():
        return _err(f"JOBID must be a Slurm job id such as 12345 (got {args.job_id!r})")
    rc, text = show(args.job_id, Path(args.run_dir) if args.run_dir else None)
    print(text)
    return rc


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "render":
        return cmd_render(args)
    return cmd_status(args)


if __name__ == "__main__":
    sys.exit(main())

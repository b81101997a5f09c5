"""elastrain's command line: run, demo, coordinator, report, sim, chaos soak.

elastrain demo                                # the elastic demo (about 2 minutes)
elastrain demo --sharded                      # 2x2 shards: heal one shard, 1x3, back
elastrain demo --jax                          # 2 JAX replicas x 2 processes: kill, rebuild, heal
elastrain run -n 4 --min 2 --replace-delay 2 train.py -- --my-arg 1
elastrain run -n 4 --shard-size 2 train.py       # 2 replica groups x 2 shards
elastrain run -n 4 --shard-size 2 --reshard-after 30 train.py   # 3 left: 1x3, then back
elastrain run -n 4 --ckpt-every 50 --run-dir runs/my-job train.py   # again: resumes
elastrain coordinator --bind 127.0.0.1:0 --target 4
elastrain report runs/my-job [-o report.html]    # self-contained HTML + terminal summary
elastrain export runs/my-job --format hf --hf-config cfg/ -o out/   # also safetensors, dcp
elastrain sim --preset llama3-16k
elastrain k8s render --workers 4 --image IMG -o job.yaml   # also: k8s status, k8s chaos
elastrain slurm render --nodes 4 --gpus-per-node 8 -o job.sbatch train.py   # also: slurm status
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import sys
from pathlib import Path
from typing import Any

from elastrain.checkpoint.config import CheckpointFormat


def _default(name: str) -> Any:
    """`LaunchConfig`'s default for field `name`: the flags' defaults come from the
    config dataclass, never retyped here."""
    from elastrain.launch.config import LaunchConfig

    f = next(f for f in dataclasses.fields(LaunchConfig) if f.name == name)
    assert f.default is not dataclasses.MISSING, name
    return f.default


def _size(text: str) -> int:
    """argparse type: a byte count with a suffix (`parse_bytes`); a bad one is a
    usage error naming what is accepted."""
    from elastrain.control.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _devices_arg(text: str) -> tuple[str, ...] | str:
    from elastrain.launch.devices import parse_devices

    try:
        return parse_devices(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_run_args(ap: argparse.ArgumentParser) -> None:
    from elastrain.launch.config import HEAL_AUTHS
    from elastrain.launch.config_file import CONFIG_FLAG, AppendReplacingDefault

    ap.add_argument(
        CONFIG_FLAG,
        default=None,
        metavar="FILE",
        help="read flags from a TOML file: every flag is a key (replace-delay = 2, "
        'fault = ["kill@15"], script = "train.py"); flags given here override it '
        "(docs/guide/config.md)",
    )
    ap.add_argument(
        "-n",
        "--workers",
        "--nproc",
        type=int,
        default=_default("workers"),
        help=f"workers to keep running (default {_default('workers')})",
    )
    ap.add_argument(
        "--min",
        type=int,
        default=_default("min_workers"),
        dest="min_workers",
        help="fewest members that may train; fewer pauses the job "
        "(default: one replica group, --shard-size members; 1 unsharded)",
    )
    ap.add_argument(
        "--devices",
        type=_devices_arg,
        default="auto",
        metavar="LIST",
        help="local accelerators, one per worker (e.g. 0,1,2,3): each worker gets "
        "CUDA_VISIBLE_DEVICES, LOCAL_RANK and LOCAL_WORLD_SIZE; a replacement keeps its "
        "predecessor's device unless that device failed (exit 74), then takes a free one. "
        "auto (default): this node's GPUs ($CUDA_VISIBLE_DEVICES, else the driver's list) "
        "when there is one per worker, else no placement",
    )
    ap.add_argument(
        "--no-prefork",
        action="store_true",
        help="start each worker as a fresh Python instead of forking it from a server "
        "that imported torch once (the default saves each start and replacement ~1.5 s)",
    )
    ap.add_argument(
        "--spares",
        type=int,
        default=_default("spares"),
        metavar="K",
        help="hot spares: K more workers that start, register and wait outside the job; "
        "a death promotes one at once, and the replacement refills the pool; in a "
        "sharded job the spare takes the dead rank's slot and heals only its shard "
        "(default 0)",
    )
    ap.add_argument(
        "--evict-stragglers",
        action="store_true",
        help="a member computing --evict-threshold times slower than its peers for 20 "
        "steps in a row leaves, and a hot spare takes its place (needs --spares)",
    )
    ap.add_argument(
        "--evict-threshold",
        type=float,
        default=_default("evict_threshold"),
        metavar="F",
        help="--evict-stragglers: compute time per sample over the peers' median from "
        "which a member straggles (default 1.5)",
    )
    ap.add_argument(
        "--replace-delay",
        type=float,
        default=_default("replace_delay_s"),
        metavar="S",
        help="seconds before a dead worker is replaced (stands in for pod scheduling)",
    )
    ap.add_argument("--no-replace", action="store_true", help="do not replace dead workers")
    ap.add_argument(
        "--max-same-error",
        type=int,
        default=_default("max_same_error"),
        metavar="N",
        help="stop the job (exit 1) when N worker exits raised the same exception at the same "
        "script line within --replacement-window: a bug in the script, not a hardware "
        "failure (default 2; 0: never stop for it)",
    )
    ap.add_argument(
        "--max-replacements",
        type=int,
        default=_default("max_replacements"),
        metavar="K",
        help="restart budget: stop the job (exit 1) rather than replace more than K failed "
        "workers within --replacement-window (default 20; 0: no budget)",
    )
    ap.add_argument(
        "--replacement-window",
        type=float,
        default=_default("replacement_window_s"),
        metavar="S",
        help="seconds over which --max-replacements and --max-same-error count (default 3600)",
    )
    ap.add_argument("--run-dir", default=None, help="run directory (default runs/<job-id>)")
    ap.add_argument("--steps", type=int, default=None, help="override the script's total steps")
    ap.add_argument(
        "--shard-size",
        type=int,
        default=None,
        metavar="S",
        help="members per replica group, each holding one shard of the model: -n 4 "
        "--shard-size 2 is 2 replicas x 2 shards (overrides the script's "
        "TrainerConfig.shard_size; -n and --min must be multiples of S)",
    )
    ap.add_argument(
        "--replica-procs",
        type=int,
        default=1,
        metavar="K",
        help="JAX: processes per replica; -n 4 --replica-procs 2 is 2 replicas of 2 "
        "processes, the model sharded over each replica's mesh (jax.distributed), "
        "elastic across replicas (docs/guide/jax.md)",
    )
    ap.add_argument(
        "--reshard-after",
        type=float,
        default=_default("reshard_after_s"),
        metavar="S",
        help="with --shard-size: when a replica group has had a vacancy for S seconds and "
        "no replacement came, regroup the members in memory to a shard size that makes "
        "whole groups (3 members of -n 4 --shard-size 2 as 1x3), and back when "
        "replacements return (default: never)",
    )
    ap.add_argument(
        "--memory-per-member",
        type=_size,
        default=_default("memory_per_member"),
        metavar="BYTES",
        help="bytes of training state one member can hold (512M, 2G, 16Gi, ...): a reshard "
        "whose shards would not fit is refused and the job keeps its layout "
        "(default: no limit; needs --reshard-after)",
    )
    ap.add_argument(
        "--state-factor",
        type=float,
        default=_default("state_factor"),
        metavar="F",
        help="bytes of training state per byte of parameters, for --memory-per-member "
        f"(default {_default('state_factor'):g}: parameter, gradient, two Adam moments)",
    )
    ap.add_argument(
        "--fault",
        action=AppendReplacingDefault,
        default=[],
        metavar="SPEC",
        help="inject a fault: KIND@WHEN[:MEMBER][/ARG], e.g. kill@15, hang@30/6, "
        "kill@every45s~15s, slow@20:w1/0.2x30, kill-all@50, kill-coordinator@20, "
        "corrupt-ckpt@60, truncate-ckpt@60, fill-disk@70/10, cut@30/8 (with --hosts; see "
        "elastrain.chaos.schedule); repeatable",
    )
    ap.add_argument(
        "--faults-file",
        default=None,
        metavar="FILE",
        help="faults to inject, one spec per line (# comments)",
    )
    ap.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="checkpoint every STEPS committed steps into <run-dir>/checkpoints "
        "(overrides the script; 0: no periodic checkpoints)",
    )
    ap.add_argument(
        "--ckpt-mtbf",
        type=float,
        default=None,
        metavar="S",
        help="job MTBF in seconds: choose the checkpoint interval automatically "
        "(Young/Daly, from the measured save cost)",
    )
    ap.add_argument(
        "--ckpt-format",
        choices=[f.value for f in CheckpointFormat],
        default=None,
        help="how a replicated torch job writes its checkpoints: flat (elastrain's striped "
        "files) or dcp (torch.distributed.checkpoint format, loadable with torch's dcp.load; "
        "docs/guide/checkpoints.md); overrides the script (default: the script's, flat; sharded jobs "
        "always write dcp)",
    )
    ap.add_argument(
        "--heal-auth",
        choices=HEAL_AUTHS,
        default=None,
        help="how a heal vouches for the state it installs: digest (the default: the "
        "payload goes bare over the generation's group, as gradients do, and is installed "
        "only if its state digest equals the root's, sent sealed under the job "
        "token) or mac (every stripe also sealed with Poly1305, for a data plane that is "
        "not trusted at all); overrides the script (docs/design/trust.md)",
    )
    ap.add_argument(
        "--resume-from",
        default=None,
        metavar="DIR",
        help="start from a torch.distributed.checkpoint directory a plain DDP/FSDP2 job "
        "saved as {'model': ..., 'optim': ..., 'step': N} (get_state_dict's names; "
        "docs/guide/checkpoints.md)",
    )
    ap.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="N",
        help="the steps --resume-from was trained for, if it has no 'step' entry",
    )
    ap.add_argument(
        "--grace",
        type=float,
        default=_default("grace_s"),
        metavar="S",
        help="on SIGTERM: seconds for the emergency checkpoint and a clean exit "
        f"(default {_default('grace_s'):g})",
    )
    ap.add_argument(
        "--seed", type=int, default=_default("seed"), help="seed of the fault schedule's choices"
    )
    ap.add_argument(
        "--group-readable",
        action="store_true",
        help="run directory 0750 and its files 0640 (a shared filesystem where a group "
        "must read checkpoints and logs); default 0700 and 0600",
    )
    ap.add_argument(
        "--plain", action="store_true", help="plain progress lines instead of a live panel"
    )
    ap.add_argument(
        "--console",
        choices=("leader", "all", "none"),
        default="leader",
        help="workers' output on the console: the leader's (rank 0 of the current "
        "generation; default), every member's prefixed with [member] (like torchrun "
        "--tee), or none; all of it is in <run-dir>/logs/<member>.log either way",
    )


def _devices(args: argparse.Namespace) -> tuple[str, ...] | None:
    """--devices as LaunchConfig takes it: "auto" resolved on this node."""
    from elastrain.launch.devices import AUTO, auto_devices, detect_devices

    if args.devices != AUTO:
        return tuple(args.devices)
    devices, note = auto_devices(detect_devices(), args.workers + args.spares)
    if note:
        print(f"elastrain: {note}", file=sys.stderr)
    return devices


def _agent_token(args: argparse.Namespace) -> str:
    from elastrain import env

    path = args.token_file or os.environ.get(env.TOKEN_FILE)
    if path:
        return Path(path).read_text().strip()
    tok = os.environ.get(env.TOKEN, "").strip()
    if not tok:
        raise ValueError(f"no job token: pass --token-file FILE or set {env.TOKEN}")
    return tok


def _launch_config(args: argparse.Namespace, script: str, script_args: list[str]) -> object:
    from elastrain.chaos.injector import register
    from elastrain.chaos.schedule import parse_fault, read_faults_file
    from elastrain.launch.launcher import LaunchConfig

    register()  # the launcher's --fault and --hosts come from chaos, through its fault seam
    faults = [parse_fault(f) for f in args.fault]
    if args.faults_file:
        faults += read_faults_file(args.faults_file)
    return LaunchConfig(
        script=script,
        script_args=script_args,
        workers=args.workers,
        min_workers=args.min_workers,
        spares=args.spares,
        evict_stragglers=args.evict_stragglers,
        evict_threshold=args.evict_threshold,
        replace_delay_s=args.replace_delay,
        max_same_error=args.max_same_error,
        max_replacements=args.max_replacements,
        replacement_window_s=args.replacement_window,
        replace=not args.no_replace,
        run_dir=args.run_dir,
        steps=args.steps,
        shard_size=args.shard_size,
        replica_procs=args.replica_procs,
        reshard_after_s=args.reshard_after,
        memory_per_member=args.memory_per_member,
        state_factor=args.state_factor,
        faults=faults,
        seed=args.seed,
        checkpoint_every=args.ckpt_every,
        checkpoint_mtbf_s=args.ckpt_mtbf,
        checkpoint_format=args.ckpt_format,
        heal_auth=args.heal_auth,
        resume_from=args.resume_from,
        resume_step=args.resume_step,
        grace_s=args.grace,
        hosts=getattr(args, "hosts", 0),
        devices=_devices(args),
        prefork=not args.no_prefork,
        group_readable=args.group_readable,
        tensorboard=getattr(args, "tensorboard", None),
        **(
            {
                "coordinator": args.coordinator,
                "token": _agent_token(args),
                "name": args.name,
                "advertise_host": args.host,
            }
            if getattr(args, "coordinator", None)
            else {}
        ),
    )


def _run_job(cfg: object, plain: bool, total: int | None, console: str = "leader") -> object:
    from elastrain.launch.console import ConsoleMode, LogFollower
    from elastrain.launch.launcher import LaunchConfig, Launcher
    from elastrain.launch.progress import Progress

    assert isinstance(cfg, LaunchConfig)
    with Progress(total, plain=plain or None) as prog:
        follower: LogFollower | None = None

        def on_status(status: dict[str, object]) -> None:
            prog.update(status)
            if follower is not None:
                follower.update(status)

        launcher = Launcher(cfg, on_status=on_status)
        prog.note(f"run directory: {launcher.run_dir}")
        prog.attach(launcher.run_dir)
        follower = LogFollower(launcher.run_dir, ConsoleMode(console))
        follower.start()
        try:
            result = launcher.run()
        finally:
            follower.close()
    return result


def _summary(result: object) -> None:
    """The end of `elastrain run`: status, step count, the message, and the same
    worker, recovery and joiner tables `elastrain demo` prints."""
    from elastrain.launch.launcher import RunResult
    from elastrain.observe.events import read_events
    from elastrain.observe.summary import committed_steps, format_run_tables

    assert isinstance(result, RunResult)
    ev = read_events(result.run_dir)
    # The status poll may lag the last commit (an emergency checkpoint's step, say).
    steps = max(result.steps, committed_steps(ev))
    print(f"\njob {result.status}: {steps} steps committed; run directory {result.run_dir}")
    if result.resumed_from is not None:
        print(f"resumed from the checkpoint of {result.resumed_from} committed steps")
    if result.message:
        print(result.message)
    print()
    print(format_run_tables(ev))
    print(f"\nreport: elastrain report {result.run_dir}")


def exit_status(status: str, message: str, ok: tuple[str, ...]) -> int:
    """`elastrain run`'s exit status for a job's outcome (elastrain.exitcodes, RUN_*)."""
    from elastrain.exitcodes import RUN_DONE, RUN_FAILED, RUN_INTERRUPTED, RUN_PREEMPTED
    from elastrain.launch.resume import NO_CHECKPOINT

    if status in ok:
        return RUN_DONE
    if status == "preempted":
        return RUN_FAILED if NO_CHECKPOINT in message else RUN_PREEMPTED
    if status == "interrupted":
        return RUN_INTERRUPTED
    return RUN_FAILED


def _launch(args: argparse.Namespace, cmd: str, ok: tuple[str, ...]) -> int:
    """`elastrain run` and `elastrain agent`: build the config, run, summarise."""
    script_args = list(args.script_args)
    if script_args and script_args[0] == "--":
        script_args = script_args[1:]
    from elastrain.exitcodes import RUN_USAGE
    from elastrain.launch.preflight import check_script

    try:
        cfg = _launch_config(args, args.script, script_args)
    except (ValueError, OSError) as e:
        print(f"elastrain {cmd}: error: {e}", file=sys.stderr)
        return RUN_USAGE
    problems = check_script(args.script, args.workers)
    if problems:
        for p in problems:
            print(f"elastrain {cmd}: error: {p}", file=sys.stderr)
        print(f"elastrain {cmd}: nothing was started", file=sys.stderr)
        return RUN_USAGE
    from elastrain.launch.lock import RunDirLocked

    try:
        result = _run_job(cfg, args.plain, args.steps, getattr(args, "console", "leader"))
    except RunDirLocked as e:
        print(f"elastrain {cmd}: error: {e}", file=sys.stderr)
        return RUN_USAGE
    _summary(result)
    return exit_status(getattr(result, "status", ""), getattr(result, "message", ""), ok)


def cmd_run(args: argparse.Namespace) -> int:
    return _launch(args, "run", ("done",))


def cmd_agent(args: argparse.Namespace) -> int:
    """One per node: runs and replaces this node's workers of a job whose
    coordinator runs elsewhere (`elastrain coordinator`); a drained node is a success."""
    return _launch(args, "agent", ("done", "drained"))


def cmd_demo(args: argparse.Namespace) -> int:
    from elastrain.demo.show import run_demo

    if args.sharded and args.jax:
        print("elastrain demo: --sharded or --jax, not both", file=sys.stderr)
        return 2
    if args.spares and (args.sharded or args.jax):
        which = "--sharded" if args.sharded else "--jax"
        print(f"elastrain demo: --spares is for the replicated demo, not {which}", file=sys.stderr)
        return 2
    if args.jax:
        from elastrain.demo.jax_replicas import STEPS, run_jax_demo

        return run_jax_demo(steps=args.steps or STEPS, run_dir=args.run_dir, plain=args.plain)
    steps = args.steps if args.steps is not None or args.sharded else 80
    return run_demo(
        steps=steps,
        run_dir=args.run_dir,
        plain=args.plain,
        sharded=args.sharded,
        spares=args.spares,
    )


def cmd_report(args: argparse.Namespace) -> int:
    from elastrain.observe.report import format_summary, write_report

    run_dir = Path(args.run_dir)
    if not (run_dir / "events").is_dir():
        print(f"elastrain report: {run_dir} has no events/ (not a run directory)", file=sys.stderr)
        return 2
    try:
        path, rep = write_report(
            run_dir, args.output, peak_tflops=args.peak_tflops, grid_gco2_per_kwh=args.grid
        )
    except ValueError as e:
        print(f"elastrain report: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        from elastrain.observe.report import report_json

        Path(args.json).write_text(json.dumps(report_json(rep), indent=1, sort_keys=True) + "\n")
    print(format_summary(rep))
    print(f"\nreport: {path}" + (f" (and {args.json})" if args.json else ""))
    return 0


class _ExportProgress:
    """`elastrain export`'s progress on stderr: bytes written, at most once a
    second, and the last one always."""

    def __init__(self) -> None:
        import time

        self._clock = time.monotonic
        self._last = self._clock()

    def __call__(self, done: int, total: int) -> None:
        from elastrain.checkpoint.export import format_bytes

        now = self._clock()
        if done < total and now - self._last < 1.0:
            return
        self._last = now
        pct = 100.0 * done / total if total else 100.0
        print(
            f"elastrain export: {format_bytes(done)} of {format_bytes(total)} written ({pct:.0f}%)",
            file=sys.stderr,
            flush=True,
        )


def cmd_export(args: argparse.Namespace) -> int:
    from elastrain.checkpoint import CheckpointError
    from elastrain.checkpoint.export import export_model, format_bytes

    def on_skip(step: int, path: Path, reason: str) -> None:
        print(
            f"elastrain export: warning: checkpoint step {step} fails verification: {reason}; "
            "trying the previous one",
            file=sys.stderr,
            flush=True,
        )

    try:
        res = export_model(
            args.run_dir,
            args.format,
            args.output,
            hf_config=args.hf_config,
            progress=_ExportProgress(),
            on_skip=on_skip,
        )
    except (CheckpointError, OSError) as e:
        print(f"elastrain export: error: {e}", file=sys.stderr)
        return 2
    stripped = f", prefix {res.stripped_prefix!r} stripped" if res.stripped_prefix else ""
    if res.left_out:
        stripped += f", {res.left_out} tensors of the wrapper left out"
    print(
        f"exported the model of checkpoint step {res.step} ({res.source}): {res.tensors} "
        f"tensors, {format_bytes(res.nbytes)}, {args.format} in {res.output}{stripped}"
    )
    return 0


def cmd_coordinator(argv: list[str]) -> int:
    from elastrain.control.server import main

    return main(argv)


def _with_config_file(
    ap: argparse.ArgumentParser,
    sub: argparse.ArgumentParser,
    args: argparse.Namespace,
    argv: list[str],
) -> argparse.Namespace:
    """`elastrain run`'s and `elastrain agent`'s arguments with --config FILE's
    keys as the defaults that the command line overrides (parsed again with
    them), then the checks of what the file may have given instead of a flag."""
    from elastrain.launch.config_file import ConfigFileError, apply_config_file

    if args.config is not None:
        try:
            apply_config_file(sub, args.config)
        except ConfigFileError as e:
            sub.error(str(e))
        args = ap.parse_args(argv)
    if args.script is None:
        sub.error("no training script: give it after the flags or as `script` in --config FILE")
    if not Path(args.script).is_file():
        hint = ""
        if args.script.startswith("-"):
            # argparse gave the first script argument the script's place.
            hint = (
                " (script arguments on the command line need the script before them: "
                "`--config FILE train.py -- ARGS`, or `script-args` in the file)"
            )
        sub.error(f"training script not found: {args.script}{hint}")
    if args.cmd == "agent" and not args.coordinator:
        sub.error("--coordinator HOST:PORT is required (or `coordinator` in --config FILE)")
    return args


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """elastrain's argument parser and its `run` and `agent` subparsers (the
    commands that take --config FILE)."""
    ap = argparse.ArgumentParser(
        prog="elastrain", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a training script elastically on this machine")
    _add_run_args(r)
    r.add_argument(
        "--hosts",
        type=int,
        default=0,
        metavar="N",
        help="spread the workers over N simulated hosts (network namespaces; root and "
        "iproute2) so that cut faults can partition one, e.g. --hosts 3 --fault cut@30/8",
    )
    r.add_argument(
        "--tensorboard",
        default=None,
        metavar="DIR",
        help="write the job's loss, step time, samples/s, goodput, energy and the "
        "script's trainer.log scalars as TensorBoard event files into DIR "
        "(pip install 'elastrain[tensorboard]')",
    )
    r.add_argument("script", nargs="?", help="the training script (or `script` in --config)")
    r.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="arguments for the script (after --)"
    )
    a = sub.add_parser(
        "agent", help="run this node's workers of a job whose coordinator runs elsewhere"
    )
    _add_run_args(a)
    a.add_argument("--coordinator", default=None, metavar="HOST:PORT", help="required")
    a.add_argument(
        "--token-file", default=None, help="file with the job token (or $ELASTRAIN_TOKEN)"
    )
    a.add_argument(
        "--name",
        default=socket.gethostname().split(".")[0],
        help="this node's name, the prefix of its member ids (default: the host name)",
    )
    a.add_argument("--host", default=None, help="the address this node's workers give their peers")
    a.add_argument("script", nargs="?", help="the training script (or `script` in --config)")
    a.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    d = sub.add_parser(
        "demo", help="the elastic demo: kill, replace, hang; PIDs and recovery phases"
    )
    d.add_argument(
        "--steps",
        type=int,
        default=None,
        help="steps to train (default 80; --sharded 75; --jax 30)",
    )
    d.add_argument(
        "--sharded",
        action="store_true",
        help="2 replica groups x 2 shards: a kill healed shard-only, a reshard to 1x3 in "
        "memory and back to 2x2",
    )
    d.add_argument(
        "--jax",
        action="store_true",
        help="2 JAX replicas x 2 processes: a kill, the other replica goes on, the lost one "
        "rebuilt and healed shard by shard from its twins (needs elastrain[jax])",
    )
    d.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="K hot spares wait beside the 4 workers: the kill promotes one at once",
    )
    d.add_argument("--run-dir", default=None)
    d.add_argument("--plain", action="store_true")
    sub.add_parser("coordinator", help="run a standalone coordinator (see --help after it)")
    sub.add_parser(
        "chaos", help="chaos soak: train under random faults, check invariants (chaos soak --help)"
    )
    sub.add_parser("k8s", help="Kubernetes: render manifests, job status, pod chaos (k8s --help)")
    sub.add_parser("slurm", help="Slurm: render an sbatch script, job status (slurm --help)")
    rp = sub.add_parser("report", help="write a run's HTML report and print its summary")
    rp.add_argument("run_dir", help="the run directory (holds events/)")
    rp.add_argument("-o", "--output", default=None, help="HTML file (default RUN_DIR/report.html)")
    rp.add_argument(
        "--json",
        default=None,
        metavar="FILE",
        help="also write the ledger as JSON: our buckets in member-seconds and the same "
        "under ml-goodput-measurement's names (goodput_time, badput_time by BadputType)",
    )
    rp.add_argument(
        "--peak-tflops",
        type=float,
        default=None,
        help="peak TFLOPS per device for MFU (default: the device table or the CPU estimate)",
    )
    rp.add_argument(
        "--grid",
        type=float,
        default=None,
        metavar="GCO2_PER_KWH",
        help="grid carbon intensity in gCO2e/kWh (default $ELASTRAIN_GRID_GCO2_PER_KWH or 400)",
    )
    ex = sub.add_parser(
        "export",
        help="write the model of a run's newest verified checkpoint as hf, safetensors or dcp",
    )
    ex.add_argument("run_dir", help="the run directory (holds checkpoints/)")
    ex.add_argument(
        "--format",
        required=True,
        metavar="FORMAT",
        help="hf (model.safetensors + config.json for from_pretrained), safetensors "
        "(model.safetensors, state_dict names) or dcp (torch.distributed.checkpoint, key "
        '"model") (docs/guide/checkpoints.md)',
    )
    ex.add_argument("-o", "--output", required=True, help="a new or empty directory")
    ex.add_argument(
        "--hf-config",
        default=None,
        metavar="DIR_OR_FILE",
        help="with --format hf: the model's config.json, or the directory "
        "model.config.save_pretrained wrote",
    )
    s = sub.add_parser("sim", help="simulate failures and goodput at cluster scale")
    try:
        from elastrain.sim.cli import add_arguments as sim_args

        sim_args(s)
    except ImportError:
        pass
    return ap, {"run": r, "agent": a}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "coordinator":
        return cmd_coordinator(argv[1:])
    if argv[:2] == ["chaos", "soak"]:
        from elastrain.chaos.soak import main as soak_main

        return soak_main(argv[2:])
    if argv[:1] == ["k8s"]:
        from elastrain.k8s.cli import main as k8s_main

        return k8s_main(argv[1:])
    if argv[:1] == ["slurm"]:
        from elastrain.slurm.cli import main as slurm_main

        return slurm_main(argv[1:])
    ap, launching = build_parser()
    args = ap.parse_args(argv)
    if args.cmd in ("run", "agent"):
        args = _with_config_file(ap, launching[args.cmd], args, argv)
        return cmd_run(args) if args.cmd == "run" else cmd_agent(args)
    if args.cmd == "demo":
        return cmd_demo(args)
    if args.cmd == "report":
        return cmd_report(args)
    if args.cmd == "export":
        return cmd_export(args)
    if args.cmd == "sim":
        from elastrain.sim.cli import run as sim_run

        return sim_run(args)
    if args.cmd == "chaos":
        ap.error("usage: elastrain chaos soak --duration D [options] (see --help)")
    ap.error(f"unknown command {args.cmd}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

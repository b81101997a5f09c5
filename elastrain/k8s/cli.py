"""`elastrain k8s render|status|chaos` (see docs/guide/kubernetes.md).

elastrain k8s render --workers 4 --image REG/train:1 -o job.yaml -- python train.py --lr 3e-4
elastrain k8s render --workers 8 --image IMG --gpus-per-worker 8 --queue team-a \\
    --priority high --coordinator jobset --kueue-setup --ckpt-pvc ckpt --ckpt-every 200
elastrain k8s status --name elastrain
elastrain k8s chaos --name elastrain --random          # delete a random worker pod
elastrain k8s chaos --kill-pod elastrain-workers-0-2-x7k2p --grace-period 0
"""

from __future__ import annotations

import argparse
import secrets
import sys
from pathlib import Path

from elastrain.cliutil import add_ckpt_format, error, write_output
from elastrain.launch.config import HEAL_AUTHS

PROG = "elastrain k8s"


def _err(msg: str) -> int:
    return error(PROG, msg)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("render", help="write the job's manifests (YAML) for kubectl apply")
    r.add_argument("--workers", type=int, default=2, help="worker pods (default 2)")
    r.add_argument(
        "--spares",
        type=int,
        default=0,
        metavar="K",
        help="hot spare pods beyond --workers: registered standbys that take a dead "
        "worker's place at once (default 0)",
    )
    r.add_argument(
        "--min",
        type=int,
        default=1,
        dest="min_workers",
        help="fewest members that may train (default 1)",
    )
    r.add_argument(
        "--image", required=True, help="container image with elastrain, torch and the script"
    )
    r.add_argument(
        "--gpus-per-worker",
        type=int,
        default=0,
        metavar="G",
        help="nvidia.com/gpu per worker (default 0)",
    )
    r.add_argument("--cpu", default="1", help="CPU request per worker (default 1)")
    r.add_argument(
        "--memory", default="2Gi", help="memory request and limit per worker (default 2Gi)"
    )
    r.add_argument(
        "--name", default="elastrain", help="job name, prefix of every object (default elastrain)"
    )
    r.add_argument(
        "--namespace", default=None, help="namespace of the objects (default: kubectl's)"
    )
    r.add_argument(
        "--coordinator",
        choices=("deployment", "jobset"),
        default="deployment",
        help="run the coordinator as a Deployment (default) or inside the JobSet "
        "(with Kueue: admitted and preempted with the workers)",
    )
    r.add_argument("--queue", default=None, metavar="Q", help="Kueue LocalQueue name")
    r.add_argument("--priority", default=None, metavar="P", help="Kueue WorkloadPriorityClass name")
    r.add_argument(
        "--kueue-setup",
        action="store_true",
        help="also write the LocalQueue and an example ClusterQueue, ResourceFlavor (and priority class)",
    )
    r.add_argument(
        "--cluster-queue", default="elastrain-cluster-queue", help="example ClusterQueue name"
    )
    r.add_argument(
        "--ckpt-pvc",
        default=None,
        metavar="NAME",
        help="ReadWriteMany PVC for checkpoints and the run directory",
    )
    r.add_argument(
        "--ckpt-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="checkpoint every STEPS steps (needs --ckpt-pvc)",
    )
    add_ckpt_format(r)
    r.add_argument(
        "--heal-auth",
        choices=HEAL_AUTHS,
        default=None,
        help="how the workers' heals vouch for the state they install, as elastrain run "
        "--heal-auth: digest (the installed state's digest against the root's, sealed under "
        "the job token) or mac (every stripe sealed too); docs/design/trust.md (default: the "
        "script's, digest)",
    )
    r.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds for the emergency checkpoint (default 30)",
    )
    r.add_argument(
        "--prestop",
        type=int,
        default=10,
        metavar="S",
        help="worker preStop sleep in seconds (default 10)",
    )
    r.add_argument(
        "--retries-per-worker", type=int, default=6, help="Job backoffLimitPerIndex (default 6)"
    )
    r.add_argument(
        "--max-restarts", type=int, default=0, help="JobSet failurePolicy.maxRestarts (default 0)"
    )
    r.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra worker environment; repeatable",
    )
    r.add_argument(
        "--token-file", default=None, help="job token file (default: a new random token)"
    )
    r.add_argument(
        "-o", "--output", default=None, help="YAML file, written mode 0600 (default stdout)"
    )
    r.add_argument(
        "--validate",
        action="store_true",
        help="validate offline before writing (needs the dev extra)",
    )
    r.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        help="after --: the worker's command (default python train.py)",
    )

    for name, help_ in (
        ("status", "show the job's JobSet, Jobs and pods (current kubeconfig context)"),
        ("chaos", "delete or evict a pod of the job (current kubeconfig context)"),
    ):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--name", default="elastrain", help="job name (default elastrain)")
        s.add_argument("-n", "--namespace", default=None, help="namespace (default: the context's)")
        s.add_argument("--context", default=None, help="kubeconfig context (default: current)")
        if name == "chaos":
            g = s.add_mutually_exclusive_group(required=True)
            g.add_argument("--kill-pod", metavar="POD", help="the pod to kill")
            g.add_argument("--random", action="store_true", help="a random running worker pod")
            s.add_argument("--seed", type=int, default=None, help="seed of --random's choice")
            s.add_argument(
                "--grace-period",
                type=int,
                default=None,
                metavar="S",
                help="delete grace period (0: at once)",
            )
            s.add_argument(
                "--evict", action="store_true", help="use the Eviction API (as a node drain does)"
            )
    return ap


def cmd_render(args: argparse.Namespace) -> int:
    from elastrain.k8s.config import K8sConfig
    from elastrain.k8s.render import render, to_yaml

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    env = []
    for kv in args.env:
        k, sep, v = kv.partition("=")
        if not sep:
            return _err(f"--env {kv!r}: use NAME=VALUE")
        env.append((k, v))
    if args.token_file:
        try:
            token = Path(args.token_file).read_text().strip()
        except OSError as e:
            return _err(f"--token-file: {e}")
    else:
        token = secrets.token_urlsafe(32)
    try:
        cfg = K8sConfig(
            name=args.name,
            namespace=args.namespace,
            image=args.image,
            command=tuple(command) or ("python", "train.py"),
            workers=args.workers,
            spares=args.spares,
            min_workers=args.min_workers,
            gpus_per_worker=args.gpus_per_worker,
            cpu=args.cpu,
            memory=args.memory,
            coordinator=args.coordinator,
            queue=args.queue,
            priority=args.priority,
            kueue_setup=args.kueue_setup,
            cluster_queue=args.cluster_queue,
            ckpt_pvc=args.ckpt_pvc,
            ckpt_every=args.ckpt_every,
            ckpt_format=args.ckpt_format,
            heal_auth=args.heal_auth,
            grace_s=args.grace,
            prestop_s=args.prestop,
            retries_per_worker=args.retries_per_worker,
            max_restarts=args.max_restarts,
            env=tuple(env),
            token=token,
        )
    except ValueError as e:
        return _err(str(e))
    objs = render(cfg)
    if args.validate:
        try:
            from elastrain.k8s.validate import validate
        except ImportError as e:
            return _err(f"--validate needs the dev extra ({e})")
        errors = validate(objs)
        if errors:
            for line in errors:
                print(f"{PROG}: invalid: {line}", file=sys.stderr)
            return 1
    try:
        text = to_yaml(objs)
    except ImportError:
        return _err("writing YAML needs PyYAML: pip install 'elastrain[k8s]'")
    # The Secret holds the job token: the file is for its owner only.
    if write_output(args.output, text, 0o600):
        print(f"wrote {len(objs)} objects to {args.output}", file=sys.stderr)
    return 0


def cmd_cluster(args: argparse.Namespace) -> int:
    from elastrain.k8s import cluster

    try:
        cl = cluster.connect(args.context, args.namespace)
        if args.cmd == "status":
            print(cluster.status(cl, args.name))
        else:
            print(
                cluster.kill_pod(
                    cl,
                    args.name,
                    None if args.random else args.kill_pod,
                    seed=args.seed,
                    grace_period_s=args.grace_period,
                    evict=args.evict,
                )
            )
    except cluster.ClusterError as e:
        return _err(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "render":
        return cmd_render(args)
    return cmd_cluster(args)


if __name__ == "__main__":
    sys.exit(main())

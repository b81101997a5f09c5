"""The sbatch script of one elastrain job: a pure function of a `SlurmConfig`.

`render(cfg)` returns the script's text. Nothing here talks to Slurm; the
script itself does, on the batch node, when the job runs:

1. a job token in `<run-dir>/token` (mode 0600, made at run time, kept across
   requeues), so the token is neither in the script nor on a command line;
2. `elastrain coordinator` on the batch node (the allocation's first node),
   whose address is read back from its first output line;
3. one `elastrain agent --nproc G` per node on the first `nodes` nodes, each
   its own `srun` step (one node's step can end without the others'); the
   `spare_nodes` nodes after them are held idle;
4. when an agent's step ends and its agent did not (a status other than 0 and
   the preempted status, or its node left the allocation: Slurm's node failure,
   after which srun exits 0) while other agents run and no notice was given, a
   replacement agent starts on the next unused spare node, through the same
   `srun` line; its workers are healed by the survivors. `#SBATCH --no-kill`
   keeps the allocation (and the other steps) when a node fails;
5. on SIGTERM (`--signal=B:TERM@grace`: only the batch shell gets it) the
   coordinator is sent SIGTERM, which is the whole job's preemption notice
   (every member takes one emergency checkpoint and exits); once the agents
   have ended the script requeues the job (`scontrol requeue`) and the rerun
   resumes from the run directory's newest checkpoint (agents' workers load
   the newest checkpoint that verifies, `ELASTRAIN_RESUME=latest`).

The reasons are in docs/guide/slurm.md.
"""

from __future__ import annotations

import shlex

from elastrain import env
from elastrain.exitcodes import RUN_FAILED, RUN_PREEMPTED
from elastrain.slurm.config import SlurmConfig

TOKEN_FILE = "token"
"""The job token's file in the run directory (what the local launcher uses too)."""


def _q(argv: tuple[str, ...] | list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def directives(cfg: SlurmConfig) -> list[str]:
    """The `#SBATCH` lines: the allocation, the notice and the requeue."""
    out = [
        f"--job-name={cfg.job_name}",
        f"--nodes={cfg.total_nodes}",
        "--ntasks-per-node=1",
    ]
    if cfg.exclusive:
        out.append("--exclusive")
    if cfg.gpus_per_node > 0:
        out.append(f"--gpus-per-node={cfg.gpus_per_node}")
    if cfg.time is not None:
        out.append(f"--time={cfg.time}")
    if cfg.partition is not None:
        out.append(f"--partition={cfg.partition}")
    # B: the batch shell alone gets the notice; it tells the coordinator, which
    # tells the members. Signalling the steps too would reach the agents first,
    # and an agent's SIGTERM means "this node is leaving" (a drain, no checkpoint).
    out.append(f"--signal=B:TERM@{cfg.grace_s}")
    out.append("--requeue" if cfg.requeue else "--no-requeue")
    # Without it Slurm ends (and requeues) the whole job when one of its nodes fails;
    # with it the failed node leaves the allocation, only its step is killed, and the
    # script replaces its agent on a spare node.
    out.append("--no-kill")
    # A requeued job writes to the same output file: keep the first run's lines.
    out.append("--open-mode=append")
    return [f"#SBATCH {d}" for d in out]


def agent_argv(cfg: SlurmConfig) -> list[str]:
    """`elastrain agent`'s fixed arguments (the per-node ones are added by the script)."""
    argv = [
        *cfg.elastrain,
        "agent",
        "--nproc",
        str(cfg.procs_per_node),
        "--run-dir",
        "$RUN_DIR",
        "--token-file",
        "$RUN_DIR/" + TOKEN_FILE,
        "--grace",
        str(cfg.coordinator_grace_s),
        "--plain",
    ]
    if cfg.ckpt_every is not None:
        argv += ["--ckpt-every", str(cfg.ckpt_every)]
    if cfg.ckpt_format is not None:
        argv += ["--ckpt-format", str(cfg.ckpt_format)]
    if cfg.heal_auth is not None:
        argv += ["--heal-auth", str(cfg.heal_auth)]
    if cfg.gpus_per_node and cfg.procs_per_node <= cfg.gpus_per_node:
        # One GPU per worker, the node's spare GPUs taking over from a failed one
        # (the step sees the allocation's GPUs as 0..G-1).
        argv += ["--devices", ",".join(str(i) for i in range(cfg.gpus_per_node))]
    return argv


def coordinator_argv(cfg: SlurmConfig) -> list[str]:
    """`elastrain coordinator`'s arguments, `$COORD_HOST` bound at run time."""
    return [
        *cfg.elastrain,
        "coordinator",
        "--bind",
        f"$COORD_HOST:{cfg.http_port}",
        "--store-port",
        str(cfg.store_port),
        "--run-dir",
        "$RUN_DIR",
        "--job-id",
        cfg.job_name,
        "--target",
        str(cfg.workers),
        "--min",
        str(cfg.min_workers),
        "--grace",
        str(cfg.coordinator_grace_s),
    ]


def _shell_words(argv: list[str]) -> str:
    """Quote `argv` for bash, leaving the `$RUN_DIR`/`$COORD_HOST` references expandable
    (inside double quotes, so a run directory with spaces stays one word)."""
    out = []
    for a in argv:
        if a.startswith("$RUN_DIR") or a.startswith("$COORD_HOST"):
            out.append(f'"{a}"')
        else:
            out.append(shlex.quote(a))
    return " ".join(out)


def render(cfg: SlurmConfig) -> str:
    """The sbatch script (bash) for `cfg`."""
    header = [
        "#!/bin/bash",
        *directives(cfg),
        f"# elastrain job {cfg.job_name}: written by `elastrain slurm render`.",
        f"# {cfg.nodes} agent node(s) x {cfg.procs_per_node} worker(s), "
        f"{cfg.spare_nodes} spare node(s); run directory {cfg.job_dir}.",
        "# Submit with `sbatch THIS_FILE`; see docs/guide/slurm.md.",
    ]
    coord_host = (
        shlex.quote(cfg.coordinator_host)
        if cfg.coordinator_host
        else '"$(node_addr "$SLURMD_NODENAME")"'
    )
    gpus = f" --gpus-per-node={cfg.gpus_per_node}" if cfg.gpus_per_node > 0 else ""
    requeue = "1" if cfg.requeue else "0"
    body = f"""
set -u
: "${{SLURM_JOB_ID:?run this script with sbatch}}"
# The wait loop needs `wait -n -p` (bash 5.1).
if (( BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501 )); then
    echo "elastrain-slurm: bash $BASH_VERSION is too old: the script needs bash >= 5.1" >&2
    exit 1
fi

RUN_DIR={shlex.quote(cfg.job_dir)}
AGENT_NODES={cfg.nodes}
REQUEUE_ON_NOTICE={requeue}
RESTART=${{SLURM_RESTART_COUNT:-0}}
LOGS=$RUN_DIR/logs
SCRIPT=({_q([cfg.script, *cfg.script_args])})

say() {{ echo "elastrain-slurm: $*" >&2; }}

# The address other nodes reach a node at: its NodeAddr as Slurm knows it.
node_addr() {{
    scontrol show node "$1" | grep -o 'NodeAddr=[^ ]*' | head -n 1 | cut -d= -f2
}}

mkdir -p "$LOGS" || exit 1
# The job token: made here at run time with owner-only permissions and kept
# across requeues; processes read it from the file ({env.TOKEN_FILE}).
if [[ ! -s $RUN_DIR/{TOKEN_FILE} ]]; then
    (umask 077 && od -An -tx1 -N32 /dev/urandom | tr -d ' \\n' >"$RUN_DIR/{TOKEN_FILE}.$$" \\
        && mv "$RUN_DIR/{TOKEN_FILE}.$$" "$RUN_DIR/{TOKEN_FILE}") || exit 1
fi
export {env.TOKEN_FILE}=$RUN_DIR/{TOKEN_FILE}

mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if (( ${{#NODES[@]}} < AGENT_NODES )); then
    say "the allocation has ${{#NODES[@]}} node(s), the job needs $AGENT_NODES"
    exit 1
fi
SPARES=("${{NODES[@]:AGENT_NODES}}")
say "job $SLURM_JOB_ID run $RESTART: agents on ${{NODES[*]:0:AGENT_NODES}}; spare: ${{SPARES[*]}}"

# The whole job's preemption notice (Slurm's --signal, before the time limit):
# SIGTERM to the coordinator makes every member take an emergency checkpoint and exit.
NOTICE=0
INTERRUPTED=0
COORD_PID=
on_notice() {{
    INTERRUPTED=1
    if (( NOTICE == 0 )); then
        NOTICE=1
        say "SIGTERM: emergency checkpoint, then exit"
        [[ -n $COORD_PID ]] && kill -TERM "$COORD_PID" 2>/dev/null
    fi
}}
trap on_notice TERM

COORD_HOST={coord_host}
if [[ -z $COORD_HOST ]]; then
    say "no NodeAddr for $SLURMD_NODENAME (scontrol show node); render with --coordinator-host"
    exit 1
fi
COORD_INFO=$LOGS/coordinator.$SLURM_JOB_ID.$RESTART.json
rm -f "$COORD_INFO"
# Its stdout is read for where it listens: keep events off it.
env -u {env.EVENTS_STDOUT} {_shell_words(coordinator_argv(cfg))} \\
    >"$COORD_INFO" 2>>"$LOGS/coordinator.log" &
COORD_PID=$!
# Its first output line says where it listens.
until [[ -s $COORD_INFO ]]; do
    if ! kill -0 "$COORD_PID" 2>/dev/null; then
        say "the coordinator did not start; see $LOGS/coordinator.log"
        exit 1
    fi
    sleep 0.2
done
if ! [[ $(head -n 1 "$COORD_INFO") =~ \\"port\\":\\ *([0-9]+) ]]; then
    say "unexpected coordinator output in $COORD_INFO"
    kill -INT "$COORD_PID"
    exit 1
fi
COORD=$COORD_HOST:${{BASH_REMATCH[1]}}
say "coordinator $COORD (pid $COORD_PID)"

# One step per agent: a node's step can end (its node failed) while the others go on.
# AGENT_NODE maps each running step's srun pid to its node.
declare -A AGENT_NODE=()
start_agent() {{
    local node=$1
    # Member ids are <node>-r<restart>-w<i>: a requeued run's members are new members.
    srun --nodes=1 --ntasks=1 --nodelist="$node"{gpus} --kill-on-bad-exit=0 \\
        --output="$LOGS/agent-$node.$SLURM_JOB_ID.$RESTART.out" \\
        {_shell_words(agent_argv(cfg))} \\
        --coordinator "$COORD" --name "$node-r$RESTART" --host "$(node_addr "$node")" \\
        "${{SCRIPT[0]}}" -- "${{SCRIPT[@]:1}}" </dev/null &
    AGENT_NODE[$!]=$node
}}

# Whether NODE is still in the job's allocation: Slurm removes a failed node from a
# --no-kill job (and kills its steps; their srun exits 0). Unknown counts as yes.
in_allocation() {{
    local list
    list=$(scontrol -o show job "$SLURM_JOB_ID" | grep -o ' NodeList=[^ ]*' | head -n 1 | cut -d= -f2)
    [[ -z $list ]] || scontrol show hostnames "$list" | grep -qxF -- "$1"
}}

for node in "${{NODES[@]:0:AGENT_NODES}}"; do
    start_agent "$node"
done

# Wait for whichever agent step ends first. A wait cut short by the notice's trap
# reports no pid and is waited again. A step whose agent did not end by itself
# (a status other than 0 and {RUN_PREEMPTED}, or its node left the allocation) is
# replaced on the next unused spare node while other agents run and no notice was
# given; its status then does not count. With no spare left it counts (a lost node
# as {RUN_FAILED}).
STATUS=0
NEXT_SPARE=0
while (( ${{#AGENT_NODE[@]}} )); do
    INTERRUPTED=0
    wait -n -p ended "${{!AGENT_NODE[@]}}"
    rc=$?
    if [[ -z ${{ended:-}} ]]; then
        (( INTERRUPTED )) && continue
        say "wait failed with status $rc"
        (( rc > STATUS )) && STATUS=$rc
        break
    fi
    node=${{AGENT_NODE[$ended]}}
    unset "AGENT_NODE[$ended]"
    lost=
    if (( rc != 0 && rc != {RUN_PREEMPTED} )); then
        lost="ended with status $rc"
    elif (( rc == 0 && !NOTICE )) && ! in_allocation "$node"; then
        lost="ended with status 0, its node removed from the allocation (a node failure)"
        rc={RUN_FAILED}
    fi
    if [[ -n $lost ]]; then
        if (( NOTICE )); then
            why="after the notice"
        elif (( ${{#AGENT_NODE[@]}} == 0 )); then
            why="no other agent is running"
        elif (( NEXT_SPARE >= ${{#SPARES[@]}} )); then
            why="no spare node left"
        else
            spare=${{SPARES[NEXT_SPARE]}}
            NEXT_SPARE=$((NEXT_SPARE + 1))
            say "the agent step on $node $lost: a replacement agent starts on spare node $spare"
            start_agent "$spare"
            continue
        fi
        say "the agent step on $node $lost: not replaced ($why)"
    fi
    (( rc > STATUS )) && STATUS=$rc
done

# Done (or failed): stop the coordinator at once. After a notice it ends by itself
# once its members are gone (or its grace is over).
(( NOTICE )) || kill -INT "$COORD_PID" 2>/dev/null
while :; do
    INTERRUPTED=0
    wait "$COORD_PID"
    (( INTERRUPTED )) || break
done

if (( STATUS == 0 )); then
    say "training finished"
    exit 0
fi
# After the notice any unfinished job is requeued: an agent reports {RUN_PREEMPTED} when it saw
# the emergency checkpoint committed, but one whose workers exited before another
# node's worker committed it reports a failure; the rerun resumes from the newest
# checkpoint that verifies either way.
if (( NOTICE && REQUEUE_ON_NOTICE )); then
    if (( STATUS == {RUN_PREEMPTED} )); then
        say "emergency checkpoint committed: requeueing job $SLURM_JOB_ID to resume from it"
    else
        say "requeueing job $SLURM_JOB_ID to resume from its newest checkpoint"
    fi
    scontrol requeue "$SLURM_JOB_ID"
fi
say "agents exited with status $STATUS"
exit "$STATUS"
"""
    return "\n".join(header) + "\n" + body

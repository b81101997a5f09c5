"""Kubernetes manifests of one elastrain job: pure functions of a `K8sConfig`.

`render(cfg)` returns the objects as plain dicts, in the order `kubectl apply`
should see them (cluster-scoped Kueue objects, then the Secret, the Service,
the coordinator, the JobSet). `to_yaml` joins them into one multi-document
file. Nothing here talks to a cluster; the reasons for each field are in
docs/guide/kubernetes.md ("Why an Indexed Job in a JobSet").

The failure policy of the workers, in one sentence: the workers are one
Indexed Job (one index per worker) with `backoffLimitPerIndex`, so a failed
pod is replaced for its own index while the other pods keep running; the
JobSet around it restarts (or fails) the whole set only when that Job fails,
which takes more than `workers - min_workers` indexes lost for good.
"""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

from elastrain import env
from elastrain.exitcodes import EXIT_LEFT, EXIT_PREEMPTED, EXIT_REFUSED, EXIT_STATE_LOST
from elastrain.k8s.config import K8sConfig
from elastrain.k8s.hardening import TOKEN_MODE, harden, network_policies
from elastrain.quantity import format_quantity, parse_quantity

Obj = dict[str, Any]

JOBSET_API = "jobset.x-k8s.io/v1alpha2"
KUEUE_API = "kueue.x-k8s.io/v1beta2"
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
GPU_RESOURCE = "nvidia.com/gpu"

WORKERS = "workers"
"""Name of the workers' replicated job in the JobSet."""
COORDINATOR = "coordinator"
"""Name of the coordinator's container, component label and (jobset mode) replicated job."""

TOKEN_DIR = "/var/run/elastrain"
TOKEN_KEY = "token"
DATA_DIR = "/elastrain"
"""Mount point of the run directory (an emptyDir, or the checkpoint PVC)."""

MAX_INT32 = 2**31 - 1
EXIT_SIGTERM = 143
"""128 + SIGTERM: a process that died of SIGTERM before installing its handler."""

# The exec probe of the coordinator: /v1/status needs the job token, so the
# probe reads it from the mounted file, inside the pod (stdlib only, ~50 ms).
PROBE = (
    "import os,urllib.request as u;"
    f"t=open(os.environ['{env.TOKEN_FILE}']).read().strip();"
    "u.urlopen(u.Request('http://'+os.environ['POD_IP']+':'+os.environ['ELASTRAIN_HTTP_PORT']"
    "+'/v1/status',headers={'Authorization':'Bearer '+t}),timeout=4).read()"
)


def labels(cfg: K8sConfig, component: str | None = None) -> dict[str, str]:
    """The labels of every object of the job; `component` narrows to coordinator or worker."""
    out = {
        "app.kubernetes.io/name": "elastrain",
        "app.kubernetes.io/instance": cfg.name,
        "app.kubernetes.io/managed-by": "elastrain-k8s-render",
    }
    if component:
        out["app.kubernetes.io/component"] = component
    return out


def selector(cfg: K8sConfig, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": cfg.name, "app.kubernetes.io/component": component}


def _meta(cfg: K8sConfig, name: str, component: str | None = None, **extra: str) -> Obj:
    m: Obj = {"name": name, "labels": {**labels(cfg, component), **extra}}
    if cfg.namespace:
        m["namespace"] = cfg.namespace
    return m


def token_secret_name(cfg: K8sConfig) -> str:
    return f"{cfg.name}-token"


def service_name(cfg: K8sConfig) -> str:
    return f"{cfg.name}-coordinator"


def coordinator_address(cfg: K8sConfig) -> str:
    """ELASTRAIN_COORDINATOR of the workers: the Service's name and HTTP port."""
    return f"{service_name(cfg)}:{cfg.http_port}"


def run_dir(cfg: K8sConfig) -> str:
    return f"{DATA_DIR}/{cfg.name}/run" if cfg.ckpt_pvc else f"{DATA_DIR}/run"


def ckpt_dir(cfg: K8sConfig) -> str | None:
    return f"{DATA_DIR}/{cfg.name}/checkpoints" if cfg.ckpt_pvc else None


# ---- pieces -----------------------------------------------------------------


def _volumes(cfg: K8sConfig, shm: bool) -> tuple[list[Obj], list[Obj]]:
    vols: list[Obj] = [
        {
            "name": "token",
            "secret": {
                "secretName": token_secret_name(cfg),
                "items": [{"key": TOKEN_KEY, "path": TOKEN_KEY}],
                "defaultMode": TOKEN_MODE,
            },
        },
        (
            {"name": "data", "persistentVolumeClaim": {"claimName": cfg.ckpt_pvc}}
            if cfg.ckpt_pvc
            else {"name": "data", "emptyDir": {}}
        ),
    ]
    mounts: list[Obj] = [
        {"name": "token", "mountPath": TOKEN_DIR, "readOnly": True},
        {"name": "data", "mountPath": DATA_DIR},
    ]
    if shm:
        vols.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": cfg.shm_size}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return vols, mounts


def _field_env(name: str, path: str) -> Obj:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _token_env() -> Obj:
    return {"name": env.TOKEN_FILE, "value": f"{TOKEN_DIR}/{TOKEN_KEY}"}


def coordinator_pod(cfg: K8sConfig, in_job: bool) -> Obj:
    """The coordinator's pod template (Deployment, or the JobSet's coordinator job).

    In a Job the entry point is `elastrain.k8s.coordinator`, which turns the
    server's exit 0 after SIGTERM into 143: a Job must never count its
    coordinator as "succeeded" (it would not be replaced).
    """
    vols, mounts = _volumes(cfg, shm=False)
    module = "elastrain.k8s.coordinator" if in_job else "elastrain.control.server"
    args = [
        "--bind",
        f"$(POD_IP):{cfg.http_port}",
        "--store-port",
        str(cfg.store_port),
        "--run-dir",
        run_dir(cfg),
        "--job-id",
        cfg.name,
        "--target",
        str(cfg.workers),
        "--min",
        str(cfg.min_workers),
        "--grace",
        f"{cfg.grace_s:g}",
    ]
    probe = {"exec": {"command": ["python", "-c", PROBE]}, "timeoutSeconds": 5}
    container: Obj = {
        "name": COORDINATOR,
        "image": cfg.image,
        "command": ["python", "-m", module],
        "args": args,
        "env": [
            _field_env("POD_IP", "status.podIP"),
            {"name": "ELASTRAIN_HTTP_PORT", "value": str(cfg.http_port)},
            _token_env(),
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ],
        "ports": [
            {"name": "http", "containerPort": cfg.http_port, "protocol": "TCP"},
            {"name": "store", "containerPort": cfg.store_port, "protocol": "TCP"},
        ],
        "resources": {
            "requests": {"cpu": cfg.coordinator_cpu, "memory": cfg.coordinator_memory},
            "limits": {"memory": cfg.coordinator_memory},
        },
        # `import torch` takes a while: the startup probe covers it (up to 5 min),
        # then liveness restarts a coordinator that stopped answering (soft state:
        # the workers re-register) and readiness gates the Service endpoint.
        "startupProbe": {
            "tcpSocket": {"port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 60,
        },
        "readinessProbe": {**probe, "periodSeconds": 5, "failureThreshold": 2},
        "livenessProbe": {**probe, "periodSeconds": 15, "failureThreshold": 4},
        "volumeMounts": mounts,
    }
    spec: Obj = {
        # SIGTERM to the coordinator is the whole job's preemption notice: it asks
        # every member for an emergency checkpoint and waits up to --grace.
        "terminationGracePeriodSeconds": cfg.termination_grace_s,
        "containers": [container],
        "volumes": vols,
    }
    if in_job:
        spec["restartPolicy"] = "Never"
    return {"metadata": {"labels": labels(cfg, COORDINATOR)}, "spec": harden(spec)}


def worker_env(cfg: K8sConfig) -> list[Obj]:
    """The worker container's environment (ELASTRAIN_*, gloo and NCCL)."""
    out: list[Obj] = [
        {"name": env.COORDINATOR, "value": coordinator_address(cfg)},
        _token_env(),
        # A pod name is unique per pod, so a replacement (a new pod for the same
        # index) registers as a new member, as the launcher's w4, w5, ... do.
        _field_env(env.MEMBER_ID, "metadata.name"),
        # The address gloo binds and advertises to peers: this pod's IP.
        _field_env(env.ADVERTISE_HOST, "status.podIP"),
        {"name": env.RUN_DIR, "value": run_dir(cfg)},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    cdir = ckpt_dir(cfg)
    if cdir:
        out.append({"name": env.CKPT_DIR, "value": cdir})
    if cfg.ckpt_every is not None:
        out.append({"name": env.CKPT_EVERY, "value": str(cfg.ckpt_every)})
    if cfg.ckpt_format is not None:
        out.append({"name": env.CKPT_FORMAT, "value": str(cfg.ckpt_format)})
    if cfg.heal_auth is not None:
        out.append({"name": env.HEAL_AUTH, "value": str(cfg.heal_auth)})
    if cfg.socket_ifname:
        out.append({"name": "GLOO_SOCKET_IFNAME", "value": cfg.socket_ifname})
    if cfg.gpus_per_worker > 0:
        if cfg.socket_ifname:
            out.append({"name": "NCCL_SOCKET_IFNAME", "value": cfg.socket_ifname})
        out += [
            # 2 = CleanUpOnly: on a collective error or timeout the watchdog aborts
            # the communicator and the error surfaces in the step, without tearing
            # the process down (1 and 3 kill it): the survivors keep their PIDs.
            {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "2"},
            {"name": "NCCL_DEBUG", "value": "WARN"},
        ]
    out += [{"name": k, "value": v} for k, v in cfg.env]
    return out


def worker_pod(cfg: K8sConfig) -> Obj:
    vols, mounts = _volumes(cfg, shm=cfg.gpus_per_worker > 0)
    resources: Obj = {
        "requests": {"cpu": cfg.cpu, "memory": cfg.memory},
        "limits": {"memory": cfg.memory},
    }
    if cfg.gpus_per_worker > 0:
        resources["requests"][GPU_RESOURCE] = str(cfg.gpus_per_worker)
        resources["limits"][GPU_RESOURCE] = str(cfg.gpus_per_worker)
    container: Obj = {
        "name": "worker",
        "image": cfg.image,
        "command": list(cfg.command),
        "env": worker_env(cfg),
        "resources": resources,
        "volumeMounts": mounts,
    }
    if cfg.prestop_s > 0:
        # Keep training for prestop_s after the pod is told to stop: when the whole
        # job is stopped the coordinator gets SIGTERM at the same moment (it has no
        # preStop) and its preemption notice reaches this worker first, so it writes
        # its emergency-checkpoint shard and exits 76 instead of leaving.
        container["lifecycle"] = {"preStop": {"exec": {"command": ["sleep", str(cfg.prestop_s)]}}}
    spec: Obj = {
        # Required by backoffLimitPerIndex and podFailurePolicy; a failed container
        # fails its pod, and the Job makes a new pod for the same index.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": cfg.worker_termination_grace_s,
        "containers": [container],
        "volumes": vols,
    }
    if cfg.gpus_per_worker > 0:
        spec["tolerations"] = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": labels(cfg, "worker")}, "spec": harden(spec)}


def worker_pod_failure_policy() -> Obj:
    """How the Job counts a failed worker pod (rules are tried in order, first match wins)."""
    return {
        "rules": [
            # Evicted, preempted by the scheduler, node drained or tainted: not the
            # worker's fault; replace without counting it.
            {
                "action": "Ignore",
                "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
            },
            # Left gracefully on its own SIGTERM (75), stopped by a whole-job
            # preemption notice after its emergency checkpoint (76), or killed by
            # SIGTERM before the trainer's handler was installed (143).
            {
                "action": "Ignore",
                "onExitCodes": {
                    "containerName": "worker",
                    "operator": "In",
                    "values": [EXIT_LEFT, EXIT_PREEMPTED, EXIT_SIGTERM],
                },
            },
            # Refused by the coordinator (its model does not match the job's): a new
            # pod of the same image would be refused too; give this index up.
            {
                "action": "FailIndex",
                "onExitCodes": {
                    "containerName": "worker",
                    "operator": "In",
                    "values": [EXIT_REFUSED],
                },
            },
            # Part of the state is gone from every member's memory (a sharded job
            # with one replica group lost a rank): no new pod can be healed. Fail the
            # workers' Job, so that the JobSet's failurePolicy recreates the whole job,
            # which resumes from its newest checkpoint.
            {
                "action": "FailJob",
                "onExitCodes": {
                    "containerName": "worker",
                    "operator": "In",
                    "values": [EXIT_STATE_LOST],
                },
            },
            # Anything else (a crash, OOM kill 137, ...) counts against this index's
            # backoffLimitPerIndex only.
        ]
    }


def workers_job_spec(cfg: K8sConfig) -> Obj:
    """The workers' Indexed Job (the JobSet's `workers` template)."""
    return {
        "completionMode": "Indexed",
        "completions": cfg.pods,
        "parallelism": cfg.pods,
        # Failures are counted per index: a failed pod is replaced for its index
        # alone; an index is given up after retries_per_worker counted failures.
        "backoffLimitPerIndex": cfg.retries_per_worker,
        # More failed indexes than this and fewer than min_workers can ever run:
        # the Job fails (and with it the JobSet, see failurePolicy).
        "maxFailedIndexes": cfg.pods - cfg.min_workers,
        # The job-wide limit would otherwise still apply to the sum over indexes.
        "backoffLimit": MAX_INT32,
        # Make the replacement only once the old pod is gone (terminal): never two
        # pods (two GPU sets, two members) for one index. Required with podFailurePolicy.
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": worker_pod_failure_policy(),
        "template": worker_pod(cfg),
    }


def coordinator_job_spec(cfg: K8sConfig) -> Obj:
    """The coordinator as a one-index Job (coordinator="jobset")."""
    return {
        "completionMode": "Indexed",
        "completions": 1,
        "parallelism": 1,
        "backoffLimitPerIndex": max(cfg.retries_per_worker, 10),
        "backoffLimit": MAX_INT32,
        # Never two coordinators: the replacement starts once the old one has exited.
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "Ignore",
                    "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                },
                {
                    "action": "Ignore",
                    "onExitCodes": {
                        "containerName": COORDINATOR,
                        "operator": "In",
                        "values": [EXIT_SIGTERM],
                    },
                },
            ]
        },
        "template": coordinator_pod(cfg, in_job=True),
    }


# ---- objects ----------------------------------------------------------------


def token_secret(cfg: K8sConfig) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(cfg, token_secret_name(cfg)),
        "type": "Opaque",
        "stringData": {TOKEN_KEY: cfg.token},
    }


def coordinator_service(cfg: K8sConfig) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(cfg, service_name(cfg), COORDINATOR),
        "spec": {
            "type": "ClusterIP",
            "selector": selector(cfg, COORDINATOR),
            # jobset mode: a terminating coordinator stays an endpoint, so the
            # workers still reach it while it hands out the preemption notice (a
            # Job never runs two coordinators at once: podReplacementPolicy Failed).
            # deployment mode: a ReplicaSet starts the replacement while the old pod
            # terminates, so the old one must stop receiving traffic.
            "publishNotReadyAddresses": cfg.coordinator == "jobset",
            "ports": [
                {"name": "http", "port": cfg.http_port, "targetPort": "http", "protocol": "TCP"},
                {
                    "name": "store",
                    "port": cfg.store_port,
                    "targetPort": "store",
                    "protocol": "TCP",
                },
            ],
        },
    }


def job_network_policies(cfg: K8sConfig) -> list[Obj]:
    """Only the job's pods reach the coordinator's ports and the workers' (see hardening.py)."""
    return network_policies(
        lambda name, component: _meta(cfg, f"{cfg.name}-{name}", component),
        {"app.kubernetes.io/instance": cfg.name},
        selector(cfg, COORDINATOR),
        selector(cfg, "worker"),
        [("http", cfg.http_port), ("store", cfg.store_port)],
    )


def coordinator_deployment(cfg: K8sConfig) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(cfg, service_name(cfg), COORDINATOR),
        "spec": {
            "replicas": 1,
            # Never two coordinators during a rollout.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector(cfg, COORDINATOR)},
            "template": coordinator_pod(cfg, in_job=False),
        },
    }


def jobset(cfg: K8sConfig) -> Obj:
    extra: dict[str, str] = {}
    if cfg.queue:
        extra[QUEUE_LABEL] = cfg.queue
    if cfg.priority:
        extra[PRIORITY_LABEL] = cfg.priority
    workers: Obj = {
        "name": WORKERS,
        "replicas": 1,
        "template": {
            "metadata": {"labels": labels(cfg, "worker")},
            "spec": workers_job_spec(cfg),
        },
    }
    rjobs = [workers]
    if cfg.coordinator == "jobset":
        rjobs.insert(
            0,
            {
                "name": COORDINATOR,
                "replicas": 1,
                "template": {
                    "metadata": {"labels": labels(cfg, COORDINATOR)},
                    "spec": coordinator_job_spec(cfg),
                },
            },
        )
        workers["dependsOn"] = [{"name": COORDINATOR, "status": "Ready"}]
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _meta(cfg, cfg.name, None, **extra),
        "spec": {
            # A JobSet acts only when a child *Job* fails (a pod failure is the
            # Job's business). With no rules every Job failure is RestartJobSet,
            # i.e. recreate every Job, while restarts < maxRestarts, else fail.
            "failurePolicy": {"maxRestarts": cfg.max_restarts, "restartStrategy": "Recreate"},
            # Done when the workers are done (the coordinator never completes; the
            # JobSet controller deletes the remaining active Jobs when it finishes).
            "successPolicy": {"operator": "All", "targetReplicatedJobs": [WORKERS]},
            "replicatedJobs": rjobs,
        },
    }


def _sum(q: str, n: int) -> Fraction:
    return parse_quantity(q) * n


def kueue_objects(cfg: K8sConfig) -> list[Obj]:
    """Example Kueue setup with quota for exactly this job (an admin's objects, usually)."""
    assert cfg.queue
    flavor = "elastrain-gpu" if cfg.gpus_per_worker else "elastrain-default"
    cpu = _sum(cfg.cpu, cfg.pods)
    mem = _sum(cfg.memory, cfg.pods)
    if cfg.coordinator == "jobset":  # the coordinator is part of the admitted workload
        cpu += parse_quantity(cfg.coordinator_cpu)
        mem += parse_quantity(cfg.coordinator_memory)
    resources: list[Obj] = [
        {"name": "cpu", "nominalQuota": format_quantity(cpu, binary=False)},
        {"name": "memory", "nominalQuota": format_quantity(mem, binary=True)},
    ]
    if cfg.gpus_per_worker:
        resources.append(
            {"name": GPU_RESOURCE, "nominalQuota": str(cfg.gpus_per_worker * cfg.pods)}
        )
    rf: Obj = {
        "apiVersion": KUEUE_API,
        "kind": "ResourceFlavor",
        "metadata": {"name": flavor, "labels": labels(cfg)},
        "spec": {},
    }
    if cfg.gpus_per_worker:
        rf["spec"]["tolerations"] = [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
    cq: Obj = {
        "apiVersion": KUEUE_API,
        "kind": "ClusterQueue",
        "metadata": {"name": cfg.cluster_queue, "labels": labels(cfg)},
        "spec": {
            "namespaceSelector": {},
            "queueingStrategy": "BestEffortFIFO",
            # Higher-priority workloads may preempt this job: Kueue then suspends
            # the JobSet, every pod gets SIGTERM, the coordinator's is the notice.
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": [r["name"] for r in resources],
                    "flavors": [{"name": flavor, "resources": resources}],
                }
            ],
        },
    }
    lq: Obj = {
        "apiVersion": KUEUE_API,
        "kind": "LocalQueue",
        "metadata": _meta(cfg, cfg.queue),
        "spec": {"clusterQueue": cfg.cluster_queue},
    }
    out = [rf, cq, lq]
    if cfg.priority:
        out.append(
            {
                "apiVersion": KUEUE_API,
                "kind": "WorkloadPriorityClass",
                "metadata": {"name": cfg.priority, "labels": labels(cfg)},
                "value": 1000,
                "description": f"elastrain job priority {cfg.priority}",
            }
        )
    return out


def render(cfg: K8sConfig) -> list[Obj]:
    """Every object of the job, in apply order."""
    out: list[Obj] = []
    if cfg.kueue_setup:
        out += kueue_objects(cfg)
    out += [token_secret(cfg), *job_network_policies(cfg), coordinator_service(cfg)]
    if cfg.coordinator == "deployment":
        out.append(coordinator_deployment(cfg))
    out.append(jobset(cfg))
    return json.loads(json.dumps(out))  # plain, unshared dicts and lists


def to_yaml(objs: list[Obj]) -> str:
    """A multi-document YAML file (needs PyYAML: `pip install 'elastrain[k8s]'`)."""
    import yaml

    return "".join(
        "---\n" + yaml.safe_dump(o, sort_keys=False, default_flow_style=False) for o in objs
    )


def find(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    """The one object of `kind` (and `name`); KeyError when absent."""
    for o in objs:
        if o["kind"] == kind and (name is None or o["metadata"]["name"] == name):
            return o
    raise KeyError(f"no {kind} {name or ''} in the rendered objects")

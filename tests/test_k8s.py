"""Kubernetes manifests: offline schema validation, the failure policy, the CLI paths.

No cluster is needed. Core kinds are checked with `kubernetes-validate` (strict),
JobSet and Kueue kinds with their CRDs' openAPIV3Schema (../shared/k8s-crds when
present, else the bundled compact copies, which must equal them).
"""

from __future__ import annotations

import json
import socket
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from elastrain import env
from elastrain.exitcodes import EXIT_LEFT, EXIT_PREEMPTED, EXIT_REFUSED, EXIT_STATE_LOST
from elastrain.k8s import cluster
from elastrain.k8s.config import K8sConfig
from elastrain.k8s.render import find, render, to_yaml
from elastrain.quantity import format_quantity, parse_quantity

yaml = pytest.importorskip("yaml")
validate = pytest.importorskip("elastrain.k8s.validate")
pytest.importorskip("kubernetes_validate")
pytest.importorskip("jsonschema")

Obj = dict[str, Any]
TOKEN = "test-token-not-secret"

CONFIGS = {
    # 1. CPU: coordinator Deployment, 4 workers and a hot spare pod, no queue.
    "cpu": K8sConfig(
        image="registry.example/train:1", token=TOKEN, workers=4, spares=1, min_workers=2
    ),
    # 2. GPU with Kueue: coordinator inside the JobSet, queue + priority + example setup.
    "gpu-kueue": K8sConfig(
        image="registry.example/train:1",
        token=TOKEN,
        name="llm",
        namespace="team-a",
        workers=8,
        min_workers=6,
        gpus_per_worker=8,
        cpu="32",
        memory="200Gi",
        coordinator="jobset",
        queue="team-a-queue",
        priority="high",
        kueue_setup=True,
        command=("python", "examples/gpt.py", "--steps", "1000"),
    ),
    # 3. Checkpoint PVC: durable DCP checkpoints every 50 steps on a shared volume,
    #    heals sealed stripe by stripe.
    "ckpt-pvc": K8sConfig(
        image="registry.example/train:1",
        token=TOKEN,
        workers=3,
        ckpt_pvc="elastrain-ckpt",
        ckpt_every=50,
        ckpt_format="dcp",
        heal_auth="mac",
        env=(("MY_FLAG", "1"),),
    ),
}


@pytest.fixture(scope="module")
def validator() -> Any:
    return validate.Validator(validate.default_crd_dir())


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {k: render(c) for k, c in CONFIGS.items()}


# ---- 4. validation -------------------------------------------------------------


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_three_configurations_pass_schema_validation(
    which: str, rendered: dict[str, list[Obj]], validator: Any
) -> None:
    objs = rendered[which]
    assert validator.errors(objs) == []
    # And the YAML that kubectl gets parses back to the same objects.
    assert list(yaml.safe_load_all(to_yaml(objs))) == objs
    kinds = [o["kind"] for o in objs]
    assert {"Secret", "Service", "JobSet"} <= set(kinds)
    if which == "gpu-kueue":
        assert {"ResourceFlavor", "ClusterQueue", "LocalQueue", "WorkloadPriorityClass"} <= set(
            kinds
        )
        assert "Deployment" not in kinds
    else:
        assert "Deployment" in kinds


def test_validation_has_teeth(rendered: dict[str, list[Obj]], validator: Any) -> None:
    """Misspelled or mistyped fields in each kind of object are reported."""
    objs = json.loads(json.dumps(rendered["gpu-kueue"]))
    js = find(objs, "JobSet")
    js["spec"]["failurePolicy"]["maxRestart"] = 1  # typo: a CRD field
    wjob = js["spec"]["replicatedJobs"][1]["template"]["spec"]
    wjob["backoffLimitPerIndx"] = 3  # typo inside the embedded batch/v1 JobSpec
    find(objs, "ClusterQueue")["spec"]["queueingStrategy"] = "Whatever"  # not in the enum
    find(objs, "LocalQueue")["spec"]["clusterQueue"] = 7  # wrong type
    find(objs, "Service")["spec"]["ports"][0]["port"] = "http"  # wrong type, core kind
    errs = validator.errors(objs)
    joined = "\n".join(errs)
    assert "maxRestart" in joined
    assert "backoffLimitPerIndx" in joined
    assert "ClusterQueue/" in joined and "Whatever" in joined
    assert "LocalQueue/" in joined
    assert "Service/" in joined
    bad_ns = json.loads(json.dumps(rendered["gpu-kueue"]))
    find(bad_ns, "ClusterQueue")["metadata"]["namespace"] = "x"
    assert any("cluster-scoped" in e for e in validator.errors(bad_ns))


def test_bundled_crd_schemas_equal_the_published_ones() -> None:
    src = validate.default_crd_dir()
    if src is None:
        pytest.skip("the published CRDs (../shared/k8s-crds or $ELASTRAIN_K8S_CRDS) are absent")
    full = validate.load_crds(src)
    bundled = validate.load_crds(None)
    assert {c.kind for c in bundled.values()} == set(validate.BUNDLED_KINDS)
    for key, crd in bundled.items():
        assert full[key].versions == crd.versions, key
        assert full[key].scope == crd.scope


# ---- the failure policy ----------------------------------------------------------
#
# A model of the documented semantics, applied to the rendered fields:
# - Job pod failure policy (https://kubernetes.io/docs/concepts/workloads/controllers/job/
#   #pod-failure-policy): rules are evaluated in order, the first match decides:
#   FailJob fails the Job and terminates all its pods; FailIndex fails the pod's
#   index; Ignore does not count the failure and a replacement pod is created;
#   Count (or no match) is the default handling.
# - Backoff limit per index (.../job/#backoff-limit-per-index): with
#   completionMode Indexed and restartPolicy Never, failures are counted per index;
#   an index whose failures exceed backoffLimitPerIndex is marked failed, the other
#   indexes continue; once more than maxFailedIndexes indexes failed, the Job fails
#   and its running pods are terminated. Without it, failures of all pods count
#   against backoffLimit and exceeding it fails the whole Job.
# - Pod replacement policy (.../job/#pod-replacement-policy): Failed creates the
#   replacement only once the old pod is terminal.
# - JobSet failure policy (jobset.sigs.k8s.io docs, "Failure Policy"; CRD field
#   docs in jobset.yaml): it acts when a child *Job* fails; a matching rule's action
#   applies, else RestartJobSet, which recreates every child Job (all pods) while
#   restarts < maxRestarts, else the JobSet fails.


def _rules_match(rule: Obj, exit_code: int | None, conditions: set[str], container: str) -> bool:
    if "onExitCodes" in rule:
        req = rule["onExitCodes"]
        if exit_code is None or req.get("containerName", container) != container:
            return False
        inside = exit_code in req["values"]
        return inside if req["operator"] == "In" else not inside
    return any(
        c["type"] in conditions and c.get("status", "True") == "True"
        for c in rule.get("onPodConditions", [])
    )


class JobModel:
    """One Indexed Job's bookkeeping under the documented semantics."""

    def __init__(self, spec: Obj) -> None:
        self.spec = spec
        self.pod = spec["template"]["spec"]
        self.container = self.pod["containers"][0]["name"]
        n = spec["completions"]
        self.running = set(range(n))  # indexes with a running pod
        self.failures = dict.fromkeys(range(n), 0)
        self.failed_indexes: set[int] = set()
        self.total_failures = 0
        self.failed = False
        self.replaced: list[int] = []  # indexes that got a new pod, in order

    def pod_failed(
        self, index: int, exit_code: int | None = None, conditions: set[str] | None = None
    ) -> set[int]:
        """Index `index`'s pod failed. Returns the *other* indexes whose pods are terminated."""
        assert index in self.running
        if self.pod["restartPolicy"] != "Never":
            # OnFailure: the kubelet restarts the container in place, counted
            # against backoffLimit job-wide (podFailurePolicy and per-index are disallowed).
            raise AssertionError("restartPolicy must be Never for per-index semantics")
        self.running.discard(index)
        action = "Count"
        for rule in self.spec.get("podFailurePolicy", {}).get("rules", []):
            if _rules_match(rule, exit_code, conditions or set(), self.container):
                action = rule["action"]
                break
        if action == "FailJob":
            return self._fail_job()
        if action == "FailIndex":
            self.failed_indexes.add(index)
        elif action == "Ignore":
            self._replace(index)
        else:  # Count
            per_index = self.spec.get("backoffLimitPerIndex")
            if per_index is not None and self.spec.get("completionMode") == "Indexed":
                self.failures[index] += 1
                if self.failures[index] > per_index:
                    self.failed_indexes.add(index)
                else:
                    self._replace(index)
            else:
                self.total_failures += 1
                if self.total_failures > self.spec.get("backoffLimit", 6):
                    return self._fail_job()
                self._replace(index)
        max_failed = self.spec.get("maxFailedIndexes")
        if max_failed is not None and len(self.failed_indexes) > max_failed:
            return self._fail_job()
        return set()

    def _replace(self, index: int) -> None:
        # podReplacementPolicy Failed: the new pod is made after the old one is
        # terminal, so one index never has two pods.
        assert self.spec.get("podReplacementPolicy") == "Failed"
        self.running.add(index)
        self.replaced.append(index)

    def _fail_job(self) -> set[int]:
        self.failed = True
        killed = set(self.running)
        self.running.clear()
        return killed


def jobset_reaction(js: Obj, restarts_so_far: int = 0) -> str:
    """What the JobSet does when a child Job failed: restart-all or fail-all."""
    fp = js["spec"].get("failurePolicy", {})
    for rule in fp.get("rules", []):
        action = rule["action"]  # a rule without conditions matches every failure
        if action == "FailJobSet":
            return "fail-all"
        if action.startswith("RestartJobSet"):
            return "restart-all"
        if action.startswith("RestartJob"):
            return "restart-job"
    return "restart-all" if restarts_so_far < fp.get("maxRestarts", 0) else "fail-all"


def _workers_job(objs: list[Obj]) -> Obj:
    js = find(objs, "JobSet")
    (rj,) = [r for r in js["spec"]["replicatedJobs"] if r["name"] == "workers"]
    assert rj.get("replicas", 1) == 1  # one Indexed Job holds every worker
    return rj["template"]["spec"]


FAILURES = [
    ("crash", 1, None),
    ("oom-kill", 137, None),
    ("segfault", 139, None),
    ("graceful leave (SIGTERM)", EXIT_LEFT, None),
    ("whole-job preemption stop", EXIT_PREEMPTED, None),
    ("SIGTERM before the handler", 143, None),
    ("eviction / node drain", 143, {"DisruptionTarget"}),
    ("refused by the coordinator", EXIT_REFUSED, None),
]


@pytest.mark.parametrize("which", sorted(CONFIGS))
@pytest.mark.parametrize(("what", "code", "conds"), FAILURES, ids=[f[0] for f in FAILURES])
def test_single_pod_failure_does_not_restart_other_workers(
    which: str, what: str, code: int, conds: set[str] | None, rendered: dict[str, list[Obj]]
) -> None:
    objs = rendered[which]
    spec = _workers_job(objs)
    cfg = CONFIGS[which]
    # The rendered fields this relies on (see the semantics above):
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == cfg.pods
    assert spec["backoffLimitPerIndex"] >= 1  # one counted failure never fails an index
    assert spec["maxFailedIndexes"] == cfg.pods - cfg.min_workers
    assert spec["podReplacementPolicy"] == "Failed"
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    rules = spec["podFailurePolicy"]["rules"]
    # No single pod fails the Job, but one whose job has lost state from memory.
    fail_job = [r for r in rules if r["action"] == "FailJob"]
    assert [r["onExitCodes"]["values"] for r in fail_job] == [[EXIT_STATE_LOST]]

    for index in range(cfg.pods):
        job = JobModel(spec)
        killed = job.pod_failed(index, code, conds)
        assert killed == set(), f"{what} of worker {index} terminated {killed}"
        assert not job.failed
        assert job.running >= set(range(cfg.pods)) - {index}  # the others keep running
        if code == EXIT_REFUSED:
            assert job.failed_indexes == {index} and job.replaced == []
        else:
            assert job.replaced == [index]  # only the failed one is recreated
            assert job.running == set(range(cfg.pods))


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_a_worker_that_finds_state_lost_fails_the_job_so_it_can_resume(
    which: str, rendered: dict[str, list[Obj]]
) -> None:
    # A sharded job with one replica group that lost a rank: no pod of any index can
    # be healed, so the whole Job fails at once (the JobSet restarts it, resuming from
    # the newest checkpoint, while restarts < maxRestarts) instead of replacing pods.
    cfg = CONFIGS[which]
    job = JobModel(_workers_job(rendered[which]))
    killed = job.pod_failed(0, EXIT_STATE_LOST)
    assert job.failed and killed == set(range(1, cfg.pods))


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_the_jobset_restarts_everything_only_after_min_workers_are_lost(
    which: str, rendered: dict[str, list[Obj]]
) -> None:
    objs = rendered[which]
    cfg = CONFIGS[which]
    spec = _workers_job(objs)
    js = find(objs, "JobSet")
    assert js["spec"]["failurePolicy"]["maxRestarts"] == cfg.max_restarts == 0
    assert not js["spec"]["failurePolicy"].get("rules")
    job = JobModel(spec)
    # Crash index 0 until it is given up: the others are never touched.
    for _ in range(spec["backoffLimitPerIndex"]):
        assert job.pod_failed(0, 1) == set()
    assert job.pod_failed(0, 1) == set() or cfg.pods == cfg.min_workers
    assert job.failed_indexes == {0}
    lost = 1
    while not job.failed:
        victim = min(job.running)
        for _ in range(spec["backoffLimitPerIndex"] + 1):
            if job.failed or victim not in job.running:
                break
            job.pod_failed(victim, 1)
        lost += 1
    # The Job fails exactly when fewer than min_workers indexes can still run.
    assert lost == cfg.pods - cfg.min_workers + 1
    assert jobset_reaction(js) == "fail-all"


def test_the_model_has_teeth(rendered: dict[str, list[Obj]]) -> None:
    """A plain Job (job-wide backoffLimit 0, no per-index limit) under a JobSet with
    restarts: one crash fails the Job and the JobSet recreates every worker."""
    spec = json.loads(json.dumps(_workers_job(rendered["cpu"])))
    for k in ("backoffLimitPerIndex", "maxFailedIndexes", "podFailurePolicy"):
        del spec[k]
    spec["backoffLimit"] = 0
    job = JobModel(spec)
    assert job.pod_failed(1, 1) == {0, 2, 3, 4}  # 4 workers and a spare
    js = {"spec": {"failurePolicy": {"maxRestarts": 3}}}
    assert jobset_reaction(js) == "restart-all"


def test_coordinator_in_jobset_is_never_done_and_replaced_alone(
    rendered: dict[str, list[Obj]],
) -> None:
    js = find(rendered["gpu-kueue"], "JobSet")
    names = [r["name"] for r in js["spec"]["replicatedJobs"]]
    assert names == ["coordinator", "workers"]
    assert js["spec"]["successPolicy"] == {"operator": "All", "targetReplicatedJobs": ["workers"]}
    assert js["spec"]["replicatedJobs"][1]["dependsOn"] == [
        {"name": "coordinator", "status": "Ready"}
    ]
    cspec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert cspec["podReplacementPolicy"] == "Failed"  # never two coordinators
    job = JobModel(cspec)
    assert job.pod_failed(0, 143) == set() and job.replaced == [0]  # SIGTERM: not counted
    assert job.failures[0] == 0
    c = cspec["template"]["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "elastrain.k8s.coordinator"]
    svc = find(rendered["gpu-kueue"], "Service")
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert find(rendered["cpu"], "Service")["spec"]["publishNotReadyAddresses"] is False


def test_coordinator_entry_point_turns_exit_0_into_a_failure(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import elastrain.control.server as server
    from elastrain.k8s import coordinator

    seen: list[Any] = []
    monkeypatch.setattr(server, "main", lambda argv=None: seen.append(argv) or 0)
    assert coordinator.main(["--target", "2"]) == 143
    assert seen == [["--target", "2"]]
    monkeypatch.setattr(server, "main", lambda argv=None: 5)
    assert coordinator.main([]) == 5


# ---- 3. what the manifests say -----------------------------------------------------


def _containers(objs: list[Obj]) -> list[Obj]:
    out = []
    for o in objs:
        if o["kind"] == "Deployment":
            out += o["spec"]["template"]["spec"]["containers"]
        if o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                out += rj["template"]["spec"]["template"]["spec"]["containers"]
    return out


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_token_only_in_the_secret_and_a_file(which: str, rendered: dict[str, list[Obj]]) -> None:
    objs = rendered[which]
    secret = find(objs, "Secret")
    assert secret["stringData"]["token"] == TOKEN
    for c in _containers(objs):
        assert TOKEN not in json.dumps(c)  # not in command, args or env values
        envs = {e["name"]: e for e in c["env"]}
        assert envs[env.TOKEN_FILE]["value"] == "/var/run/elastrain/token"
        assert env.TOKEN not in envs
        mount = next(m for m in c["volumeMounts"] if m["name"] == "token")
        assert mount["readOnly"] and mount["mountPath"] == "/var/run/elastrain"
    others = [o for o in objs if o["kind"] != "Secret"]
    assert TOKEN not in json.dumps(others)


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_worker_pods(which: str, rendered: dict[str, list[Obj]]) -> None:
    cfg = CONFIGS[which]
    pod = _workers_job(rendered[which])["template"]["spec"]
    (c,) = pod["containers"]
    envs = {e["name"]: e for e in c["env"]}
    assert envs[env.COORDINATOR]["value"] == f"{cfg.name}-coordinator:{cfg.http_port}"
    assert envs[env.MEMBER_ID]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert envs[env.ADVERTISE_HOST]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert c["command"] == list(cfg.command)
    # preStop keeps the worker training until the coordinator's notice arrives, and
    # the grace period covers preStop + the emergency checkpoint + a margin.
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(cfg.prestop_s)]
    assert pod["terminationGracePeriodSeconds"] >= cfg.prestop_s + cfg.grace_s + 10
    assert c["resources"]["requests"]["cpu"] == cfg.cpu
    if cfg.gpus_per_worker:
        for k in ("requests", "limits"):
            assert c["resources"][k]["nvidia.com/gpu"] == str(cfg.gpus_per_worker)
        assert envs["TORCH_NCCL_ASYNC_ERROR_HANDLING"]["value"] == "2"
        assert envs["NCCL_SOCKET_IFNAME"]["value"] == "eth0"
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    else:
        assert "nvidia.com/gpu" not in json.dumps(c["resources"])
        assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in envs
    if cfg.ckpt_pvc:
        vol = next(v for v in pod["volumes"] if v["name"] == "data")
        assert vol["persistentVolumeClaim"]["claimName"] == cfg.ckpt_pvc
        assert envs[env.CKPT_DIR]["value"].startswith("/elastrain/")
        assert envs[env.CKPT_EVERY]["value"] == str(cfg.ckpt_every)
        assert envs["MY_FLAG"]["value"] == "1"
    else:
        assert env.CKPT_DIR not in envs
    # The checkpoint format reaches the workers only when asked for: else the script's.
    if cfg.ckpt_format is not None:
        assert envs[env.CKPT_FORMAT]["value"] == cfg.ckpt_format
    else:
        assert env.CKPT_FORMAT not in envs
    # Likewise the heal's integrity mode.
    if cfg.heal_auth is not None:
        assert envs[env.HEAL_AUTH]["value"] == cfg.heal_auth
    else:
        assert env.HEAL_AUTH not in envs


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_coordinator_pod(which: str, rendered: dict[str, list[Obj]]) -> None:
    cfg = CONFIGS[which]
    objs = rendered[which]
    if cfg.coordinator == "deployment":
        dep = find(objs, "Deployment")
        assert dep["spec"]["replicas"] == 1
        assert dep["spec"]["strategy"] == {"type": "Recreate"}
        pod = dep["spec"]["template"]
    else:
        pod = find(objs, "JobSet")["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    spec = pod["spec"]
    (c,) = spec["containers"]
    args = c["args"]
    assert args[args.index("--grace") + 1] == f"{cfg.grace_s:g}"
    assert args[args.index("--target") + 1] == str(cfg.workers)
    assert args[args.index("--min") + 1] == str(cfg.min_workers)
    assert args[args.index("--bind") + 1] == f"$(POD_IP):{cfg.http_port}"
    assert spec["terminationGracePeriodSeconds"] >= cfg.grace_s + 10
    # Probes: /v1/status needs the token, so readiness/liveness exec a stdlib client
    # that reads the token file; the startup probe only checks the port.
    for probe in ("readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:2] == ["python", "-c"] and "/v1/status" in cmd[2]
        assert env.TOKEN_FILE in cmd[2]
    assert c["startupProbe"]["tcpSocket"]["port"] == "http"
    # The Service selects exactly the coordinator pod and exposes both ports.
    svc = find(objs, "Service")
    assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {
        "http": cfg.http_port,
        "store": cfg.store_port,
    }


def test_kueue_labels_and_quota(rendered: dict[str, list[Obj]]) -> None:
    cfg = CONFIGS["gpu-kueue"]
    objs = rendered["gpu-kueue"]
    js = find(objs, "JobSet")
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == cfg.queue
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == cfg.priority
    lq = find(objs, "LocalQueue")
    assert lq["metadata"] == {**lq["metadata"], "name": cfg.queue, "namespace": "team-a"}
    cq = find(objs, "ClusterQueue")
    assert lq["spec"]["clusterQueue"] == cq["metadata"]["name"]
    assert "namespace" not in cq["metadata"]
    quota = {
        r["name"]: r["nominalQuota"]
        for r in cq["spec"]["resourceGroups"][0]["flavors"][0]["resources"]
    }
    assert quota["nvidia.com/gpu"] == str(8 * 8)
    assert parse_quantity(quota["cpu"]) == 8 * 32 + parse_quantity("500m")
    assert parse_quantity(quota["memory"]) == parse_quantity("1600Gi") + parse_quantity("1Gi")
    assert "kueue.x-k8s.io/queue-name" not in json.dumps(find(rendered["cpu"], "JobSet"))


def test_quantities() -> None:
    assert parse_quantity("500m") * 2 == 1
    assert format_quantity(parse_quantity("1536Mi"), binary=True) == "1536Mi"
    assert format_quantity(parse_quantity("2") + parse_quantity("500m"), binary=False) == "2500m"
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity("2 cores")


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"workers": 0}, "workers must be >= 1"),
        ({"workers": 2, "min_workers": 3}, "lower --min or raise --workers"),
        ({"gpus_per_worker": -1}, "gpus_per_worker must be >= 0"),
        ({"name": "My_Job"}, "not a valid Kubernetes name"),
        ({"name": "x" * 41}, "at most 40"),
        ({"priority": "high"}, "pass --queue with --priority"),
        ({"kueue_setup": True}, "pass --queue too"),
        ({"ckpt_every": 10}, "pass --ckpt-pvc"),
        ({"ckpt_format": "zip"}, r"--ckpt-format must be one of flat, dcp \(got 'zip'\)"),
        ({"heal_auth": "sha1"}, r"--heal-auth must be one of \('digest', 'mac'\), got 'sha1'"),
        ({"retries_per_worker": 0}, "retries_per_worker must be >= 1"),
        ({"coordinator": "statefulset"}, "'deployment' or 'jobset'"),
        ({"cpu": "lots"}, "not a Kubernetes quantity"),
        ({"token": ""}, "token"),
        ({"http_port": 29401}, "must differ"),
    ],
)
def test_config_rejects_bad_combinations(kw: dict[str, Any], msg: str) -> None:
    base: dict[str, Any] = {"image": "img:1", "token": TOKEN}
    with pytest.raises(ValueError, match=msg):
        K8sConfig(**{**base, **kw})


# ---- CLI ---------------------------------------------------------------------------


def test_cli_render_writes_valid_private_yaml(tmp_path: Path, validator: Any) -> None:
    from elastrain.cli import main

    tok = tmp_path / "tok"
    tok.write_text("from-a-file\n")
    out = tmp_path / "job.yaml"
    rc = main(
        [
            "k8s", "render", "--workers", "3", "--image", "img:2", "--queue", "q",
            "--ckpt-pvc", "ck", "--token-file", str(tok), "-o", str(out), "--validate",
            "--env", "A=b", "--", "python", "train.py", "--lr", "1e-3",
        ]
    )  # fmt: skip
    assert rc == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    objs = list(yaml.safe_load_all(out.read_text()))
    assert validator.errors(objs) == []
    assert find(objs, "Secret")["stringData"]["token"] == "from-a-file"
    pod = _workers_job(objs)["template"]["spec"]
    assert pod["containers"][0]["command"] == ["python", "train.py", "--lr", "1e-3"]


def test_cli_render_forwards_the_checkpoint_format_and_heal_auth(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], validator: Any
) -> None:
    from elastrain.cli import main

    def worker_env(*extra: str) -> dict[str, str]:
        out = tmp_path / "job.yaml"
        argv = ["k8s", "render", "--image", "img:2", "--ckpt-pvc", "ck", "-o", str(out)]
        assert main([*argv, *extra]) == 0
        objs = list(yaml.safe_load_all(out.read_text()))
        if "mac" in extra:  # one of them through the schemas (each costs ~0.5 s)
            assert validator.errors(objs) == []
        (c,) = _workers_job(objs)["template"]["spec"]["containers"]
        return {e["name"]: e.get("value") for e in c["env"]}

    assert worker_env("--ckpt-format", "dcp")[env.CKPT_FORMAT] == "dcp"
    assert worker_env("--ckpt-format", "flat")[env.CKPT_FORMAT] == "flat"
    assert worker_env("--heal-auth", "mac")[env.HEAL_AUTH] == "mac"
    assert worker_env("--heal-auth", "digest")[env.HEAL_AUTH] == "digest"
    unset = worker_env()
    assert env.CKPT_FORMAT not in unset and env.HEAL_AUTH not in unset
    for flag, bad, choices in (("--ckpt-format", "zip", "'flat', 'dcp'"),
                               ("--heal-auth", "sha1", "'digest', 'mac'")):  # fmt: skip
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            main(["k8s", "render", "--image", "img:2", flag, bad])
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and choices in err


def test_cli_render_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    from elastrain.cli import main

    assert main(["k8s", "render", "--workers", "2", "--min", "3", "--image", "i"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "lower --min" in err


def _no_cluster(monkeypatch: pytest.MonkeyPatch, kubeconfig: Path) -> None:
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)


@pytest.mark.parametrize("cmd", [["status"], ["chaos", "--random"], ["chaos", "--kill-pod", "p"]])
@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_no_cluster_is_a_clear_one_line_error(
    cmd: list[str],
    kind: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("kubernetes")
    from elastrain.cli import main

    kc = tmp_path / "kubeconfig"
    if kind == "empty":
        kc.write_text("")
    _no_cluster(monkeypatch, kc)
    assert main(["k8s", *cmd]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("elastrain k8s: error: no Kubernetes cluster configured")


def test_unreachable_cluster_is_a_clear_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("kubernetes")
    from elastrain.cli import main

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kc = tmp_path / "kubeconfig"
    kc.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": f"https://127.0.0.1:{port}"}}],
                "users": [{"name": "u", "user": {"token": "x"}}],
                "contexts": [{"name": "k", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "k",
            }
        )
    )
    _no_cluster(monkeypatch, kc)
    assert main(["k8s", "status"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert f"cannot reach the Kubernetes API at https://127.0.0.1:{port}" in err


# ---- status and chaos, offline ----------------------------------------------------------


def _pod(name: str, role: str, index: str | None, phase: str = "Running", **extra: Any) -> Obj:
    labels = {"app.kubernetes.io/component": role, "app.kubernetes.io/instance": "j"}
    if index is not None:
        labels["batch.kubernetes.io/job-completion-index"] = index
    return {
        "metadata": {
            "name": name,
            "labels": labels,
            "creationTimestamp": "2026-11-30T12:00:00Z",
            **extra,
        },
        "status": {
            "phase": phase,
            "podIP": "10.0.0.1",
            "nodeName": "n1",
            "containerStatuses": [{"ready": phase == "Running", "restartCount": 0}],
        },
    }


def test_format_status_and_victims() -> None:
    pods = [
        _pod("j-workers-0-1-bbbbb", "worker", "1"),
        _pod("j-workers-0-0-aaaaa", "worker", "0"),
        _pod("j-coordinator-0-0-ccccc", "coordinator", "0"),
        _pod("j-workers-0-2-ddddd", "worker", "2", deletionTimestamp="2026-11-30T12:01:00Z"),
        _pod("j-workers-0-3-eeeee", "worker", "3", phase="Pending"),
    ]
    js = {
        "metadata": {"labels": {"kueue.x-k8s.io/queue-name": "q"}},
        "spec": {"suspend": False, "failurePolicy": {"maxRestarts": 0}},
        "status": {"restarts": 0, "conditions": []},
    }
    jobs = [
        {
            "metadata": {"name": "j-workers-0"},
            "spec": {"completions": 4},
            "status": {"active": 3, "ready": 2, "failed": 1, "failedIndexes": "3"},
        }
    ]
    text = cluster.format_status(
        "j", "ns", js, jobs, pods, datetime(2026, 11, 30, 12, 5, tzinfo=UTC)
    )
    lines = text.splitlines()
    assert lines[1] == "  JobSet j: running; restarts 0/0; queue q"
    assert "failed indexes 3" in lines[2]
    table = lines[4:]
    assert table[0].split()[:3] == ["pod", "role", "index"]
    assert [r.split()[0] for r in table[1:]] == [
        "j-coordinator-0-0-ccccc",
        "j-workers-0-0-aaaaa",
        "j-workers-0-1-bbbbb",
        "j-workers-0-2-ddddd",
        "j-workers-0-3-eeeee",
    ]
    assert "Terminating" in table[4] and "5m" in table[1]
    assert "not found" in cluster.format_status("j", "ns", None, [], [])
    # Only running, not terminating workers are chaos victims; the seed decides.
    assert cluster.worker_victims(pods) == ["j-workers-0-0-aaaaa", "j-workers-0-1-bbbbb"]
    assert cluster.choose_victim(pods, 1) == cluster.choose_victim(pods, 1)
    with pytest.raises(cluster.ClusterError, match="no running worker"):
        cluster.choose_victim(pods[2:3], 0)


def test_k8s_is_listed_in_the_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    from elastrain.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    assert "k8s" in capsys.readouterr().out

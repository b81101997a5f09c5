"""Cluster operations through the official `kubernetes` client: status and chaos.

The client uses the current kubeconfig context ($KUBECONFIG or ~/.kube/config,
`--context` to pick another), or the pod's service account when run inside a
cluster. Every failure to get there (no client installed, no configuration,
API unreachable, forbidden, JobSet not installed) is a `ClusterError` with a
one-line message; the CLI prints it and exits 2.

The formatting and victim choice are pure functions of plain dicts (what
`ApiClient.sanitize_for_serialization` returns), so they are tested offline.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from elastrain.k8s.render import COORDINATOR, JOBSET_API

Obj = dict[str, Any]

REQUEST_TIMEOUT = (5.0, 20.0)
"""(connect, read) seconds for every API call: an unreachable cluster fails fast."""
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"


class ClusterError(Exception):
    """No cluster, or the cluster said no: the message is one line for the user."""


@dataclass
class Cluster:
    """A connected client: `api` is a kubernetes.client.ApiClient."""

    api: Any
    namespace: str
    host: str


def connect(context: str | None = None, namespace: str | None = None) -> Cluster:
    """Load the kubeconfig (or the in-cluster config) and return a client. Does not call
    the API yet; raises ClusterError when there is nothing to connect to."""
    try:
        from kubernetes import client, config
        from kubernetes.config.config_exception import ConfigException
    except ImportError:
        raise ClusterError(
            "the kubernetes client is not installed: pip install 'elastrain[k8s]'"
        ) from None
    ns = namespace
    try:
        # $KUBECONFIG read now (the client reads it once, at import).
        kubeconfig = os.environ.get("KUBECONFIG") or None
        config.load_kube_config(config_file=kubeconfig, context=context)
        if ns is None:
            contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
            if context is not None:
                active = next((c for c in contexts if c.get("name") == context), active)
            ns = (active or {}).get("context", {}).get("namespace")
    except (ConfigException, OSError, ValueError, TypeError) as kube_err:
        if context is not None:
            raise ClusterError(f"no Kubernetes context {context!r}: {kube_err}") from None
        try:
            config.load_incluster_config()
        except ConfigException:
            raise ClusterError(
                f"no Kubernetes cluster configured ({_one_line(kube_err)}); set KUBECONFIG "
                "or ~/.kube/config, or run inside a cluster"
            ) from None
        if ns is None:
            try:
                with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
                    ns = f.read().strip()
            except OSError:
                ns = None
    cfg = client.Configuration.get_default_copy()
    cfg.retries = 0  # one attempt: an unreachable API is reported at once
    return Cluster(client.ApiClient(cfg), ns or "default", str(cfg.host))


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300] or type(e).__name__


def _call(cl: Cluster, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """Call the API; turn transport and HTTP errors into ClusterError."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args, _request_timeout=REQUEST_TIMEOUT, **kw)
    except ApiException as e:
        if e.status == 404:
            raise LookupError(what) from None
        if e.status in (401, 403):
            raise ClusterError(
                f"{what}: the cluster at {cl.host} refused ({e.status} {e.reason}); "
                "check your credentials and RBAC"
            ) from None
        raise ClusterError(f"{what}: {e.status} {e.reason}") from None
    except (HTTPError, OSError) as e:
        raise ClusterError(
            f"cannot reach the Kubernetes API at {cl.host}: {_one_line(e)}"
        ) from None


def _plain(cl: Cluster, x: Any) -> Any:
    return cl.api.sanitize_for_serialization(x)


def fetch(cl: Cluster, name: str) -> tuple[Obj | None, list[Obj], list[Obj]]:
    """(JobSet or None, its Jobs, the job's pods) as plain dicts."""
    from kubernetes import client

    group, _, version = JOBSET_API.partition("/")
    custom = client.CustomObjectsApi(cl.api)
    try:
        js = _call(
            cl,
            f"JobSet {name}",
            custom.get_namespaced_custom_object,
            group,
            version,
            cl.namespace,
            "jobsets",
            name,
        )
    except LookupError:
        js = None
    batch = client.BatchV1Api(cl.api)
    jobs = _call(
        cl,
        "list Jobs",
        batch.list_namespaced_job,
        cl.namespace,
        label_selector=f"{JOBSET_LABEL}={name}",
    )
    core = client.CoreV1Api(cl.api)
    pods = _call(
        cl,
        "list pods",
        core.list_namespaced_pod,
        cl.namespace,
        label_selector=f"app.kubernetes.io/instance={name}",
    )
    return js, _plain(cl, jobs).get("items", []), _plain(cl, pods).get("items", [])


# ---- pure: formatting and choice ------------------------------------------------


def _age(ts: str | None, now: datetime) -> str:
    if not ts:
        return "-"
    try:
        t = datetime.fromisoformat(ts.replace("Z", "+00:00"))
    except ValueError:
        return "-"
    s = int((now - t).total_seconds())
    if s < 120:
        return f"{s}s"
    if s < 7200:
        return f"{s // 60}m"
    return f"{s // 3600}h"


def pod_row(pod: Obj, now: datetime) -> dict[str, str]:
    """One pod as the status table shows it."""
    meta = pod.get("metadata", {})
    st = pod.get("status", {})
    lab = meta.get("labels", {}) or {}
    cs = (st.get("containerStatuses") or [{}])[0]
    phase = st.get("phase", "?")
    if meta.get("deletionTimestamp"):
        phase = "Terminating"
    last = ""
    term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get(
        "terminated"
    )
    if term:
        last = f"exit {term.get('exitCode')}" + (
            f" ({term['reason']})" if term.get("reason") else ""
        )
    return {
        "pod": meta.get("name", "?"),
        "role": lab.get("app.kubernetes.io/component", "?"),
        "index": lab.get(INDEX_LABEL, "-")
        if lab.get("app.kubernetes.io/component") != COORDINATOR
        else "-",
        "phase": phase,
        "ready": "yes" if cs.get("ready") else "no",
        "restarts": str(cs.get("restartCount", 0)),
        "node": st.get("nodeName") or spec_node(pod) or "-",
        "ip": st.get("podIP") or "-",
        "age": _age(meta.get("creationTimestamp"), now),
        "last": last,
    }


def spec_node(pod: Obj) -> str | None:
    node = pod.get("spec", {}).get("nodeName")
    return str(node) if node else None


def _table(rows: list[dict[str, str]]) -> list[str]:
    if not rows:
        return []
    cols = list(rows[0])
    w = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    out = ["  ".join(c.ljust(w[c]) for c in cols).rstrip()]
    out += ["  ".join(r[c].ljust(w[c]) for c in cols).rstrip() for r in rows]
    return out


def format_status(
    name: str,
    namespace: str,
    js: Obj | None,
    jobs: list[Obj],
    pods: list[Obj],
    now: datetime | None = None,
) -> str:
    """The text of `elastrain k8s status` from plain dicts."""
    now = now or datetime.now(UTC)
    lines = [f"job {name} in namespace {namespace}"]
    if js is None:
        lines.append(f"  JobSet {name}: not found")
    else:
        spec, st = js.get("spec", {}), js.get("status", {}) or {}
        labels = js.get("metadata", {}).get("labels", {}) or {}
        conds = [
            f"{c.get('type')}={c.get('status')}" + (f" ({c['reason']})" if c.get("reason") else "")
            for c in st.get("conditions", []) or []
            if c.get("status") == "True"
        ]
        state = "suspended" if spec.get("suspend") else "running"
        if any(c.startswith(("Completed", "Failed")) for c in conds):
            state = "finished"
        queue = labels.get("kueue.x-k8s.io/queue-name")
        lines.append(
            f"  JobSet {name}: {state}; restarts {st.get('restarts', 0)}"
            f"/{spec.get('failurePolicy', {}).get('maxRestarts', 0)}"
            + (
                f"; queue {queue}" + (" (waiting for admission)" if spec.get("suspend") else "")
                if queue
                else ""
            )
            + (f"; {', '.join(conds)}" if conds else "")
        )
    for j in jobs:
        jm, jst, jspec = j.get("metadata", {}), j.get("status", {}) or {}, j.get("spec", {})
        extra = ""
        if jst.get("failedIndexes"):
            extra += f"; failed indexes {jst['failedIndexes']}"
        if jst.get("completedIndexes"):
            extra += f"; completed indexes {jst['completedIndexes']}"
        lines.append(
            f"  Job {jm.get('name')}: active {jst.get('active', 0)}, ready {jst.get('ready', 0)}, "
            f"succeeded {jst.get('succeeded', 0)}/{jspec.get('completions', '?')}, "
            f"failed pods {jst.get('failed', 0)}{extra}"
        )
    rows = sorted(
        (pod_row(p, now) for p in pods),
        key=lambda r: (r["role"] != COORDINATOR, r["index"].zfill(6), r["age"], r["pod"]),
    )
    if rows:
        lines.append("")
        lines += _table(rows)
    else:
        lines.append("  no pods")
    return "\n".join(lines)


def worker_victims(pods: list[Obj]) -> list[str]:
    """Names of the running, not terminating, worker pods (sorted)."""
    out = []
    for p in pods:
        meta = p.get("metadata", {})
        lab = meta.get("labels", {}) or {}
        if (
            lab.get("app.kubernetes.io/component") == "worker"
            and (p.get("status", {}) or {}).get("phase") == "Running"
            and not meta.get("deletionTimestamp")
        ):
            out.append(meta["name"])
    return sorted(out)


def choose_victim(pods: list[Obj], seed: int | None) -> str:
    names = worker_victims(pods)
    if not names:
        raise ClusterError("no running worker pod to kill")
    return random.Random(seed).choice(names)


# ---- commands -------------------------------------------------------------------


def status(cl: Cluster, name: str) -> str:
    js, jobs, pods = fetch(cl, name)
    if js is None and not jobs and not pods:
        raise ClusterError(
            f"no elastrain job {name!r} in namespace {cl.namespace} (no JobSet, Jobs or pods)"
        )
    return format_status(name, cl.namespace, js, jobs, pods)


def kill_pod(
    cl: Cluster,
    name: str,
    pod: str | None,
    seed: int | None = None,
    grace_period_s: int | None = None,
    evict: bool = False,
) -> str:
    """Delete (or evict) one pod of job `name`: `pod`, or a random running worker."""
    from kubernetes import client

    core = client.CoreV1Api(cl.api)
    if pod is None:
        _, _, pods = fetch(cl, name)
        pod = choose_victim(pods, seed)
    t0 = time.time()
    try:
        if evict:
            body = client.V1Eviction(
                metadata=client.V1ObjectMeta(name=pod, namespace=cl.namespace),
                delete_options=client.V1DeleteOptions(grace_period_seconds=grace_period_s),
            )
            _call(
                cl, f"evict pod {pod}", core.create_namespaced_pod_eviction, pod, cl.namespace, body
            )
            how = "evicted"
        else:
            _call(
                cl,
                f"delete pod {pod}",
                core.delete_namespaced_pod,
                pod,
                cl.namespace,
                grace_period_seconds=grace_period_s,
            )
            how = "deleted"
    except LookupError:
        raise ClusterError(f"no pod {pod!r} in namespace {cl.namespace}") from None
    gp = "" if grace_period_s is None else f" (grace period {grace_period_s} s)"
    return (
        f"{how} pod {pod} in {cl.namespace} at {time.strftime('%H:%M:%S', time.localtime(t0))}{gp}"
    )

"""Pod hardening and network isolation of an elastrain job: pure functions.

The store and the workers' gloo ports have no authentication of their own
(docs/design/trust.md); on a cluster the boundary is the
NetworkPolicy: only the job's own pods reach the coordinator's HTTP and store
ports, and the workers' ports (gloo listens on ephemeral ports, so every TCP
port of a worker pod, from the job's pods only). Probes are exec probes, or
come from the node, which NetworkPolicies do not filter.

Every pod runs as a non-root user with no privilege escalation, no
capabilities, the runtime's default seccomp profile and a read-only root
filesystem; what must be written is a mount: the run directory, /tmp, and
/dev/shm for GPU workers. Neither pod calls the Kubernetes API, so no
service-account token is mounted. The job token is mounted 0400 (the kubelet
gives it the pod's fsGroup, which the container runs in).
"""

from __future__ import annotations

from typing import Any

Obj = dict[str, Any]

RUN_AS = 1000
"""UID, GID and fsGroup of the job's processes (any non-root user the image allows)."""
TOKEN_MODE = 0o400
TMP_DIR = "/tmp"


def pod_security_context() -> Obj:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS,
        "runAsGroup": RUN_AS,
        # Volumes (the run directory, the token) are group-owned by it: writable and readable.
        "fsGroup": RUN_AS,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> Obj:
    return {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def harden(pod_spec: Obj) -> Obj:
    """`pod_spec` with the security contexts, a writable /tmp and no API token."""
    pod_spec["automountServiceAccountToken"] = False
    pod_spec["securityContext"] = pod_security_context()
    pod_spec.setdefault("volumes", []).append({"name": "tmp", "emptyDir": {}})
    for c in pod_spec["containers"]:
        c["securityContext"] = container_security_context()
        c.setdefault("volumeMounts", []).append({"name": "tmp", "mountPath": TMP_DIR})
    return pod_spec


def network_policies(
    meta: Any,
    instance: dict[str, str],
    coordinator: dict[str, str],
    workers: dict[str, str],
    ports: list[tuple[str, int]],
) -> list[Obj]:
    """Ingress to the coordinator (`ports`: name, number) and to every worker
    port, admitted from the job's own pods only (`instance`: their labels).
    `meta(name, component)` makes the objects' metadata."""
    peers = [{"podSelector": {"matchLabels": dict(instance)}}]
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta("coordinator", "coordinator"),
            "spec": {
                "podSelector": {"matchLabels": dict(coordinator)},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": peers,
                        "ports": [{"protocol": "TCP", "port": port} for _, port in ports],
                    }
                ],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": meta("workers", "worker"),
            "spec": {
                "podSelector": {"matchLabels": dict(workers)},
                "policyTypes": ["Ingress"],
                # gloo listens on ephemeral ports: any TCP port, from the job's pods.
                "ingress": [{"from": peers, "ports": [{"protocol": "TCP"}]}],
            },
        },
    ]

"""The coordinator's entry point when it runs as a Job's pod (`--coordinator jobset`).

    python -m elastrain.k8s.coordinator --bind $(POD_IP):29400 ... (the server's arguments)

It runs `elastrain.control.server` unchanged and changes one thing: the exit
status. The server exits 0 after SIGTERM (it was told to stop, it drained);
a Job would count that pod as *succeeded* and never replace it, leaving the
workers without a coordinator after a node drain, a liveness restart or a
`kubectl delete pod`. Here any return is 143 (128 + SIGTERM), a failure that
the Job's podFailurePolicy ignores (not counted) and replaces. When the whole
JobSet finishes, the JobSet controller deletes the coordinator's Job itself.
A Deployment restarts its pod whatever the status, so it runs the server directly.
"""

from __future__ import annotations

import sys

from elastrain.k8s.render import EXIT_SIGTERM


def main(argv: list[str] | None = None) -> int:
    from elastrain.control.server import main as server_main

    rc = server_main(argv)
    return rc if rc else EXIT_SIGTERM


if __name__ == "__main__":
    sys.exit(main())

"""The coordinator's TCPStore, bound where the job was told, and its key space.

Trust boundary (see docs/design/trust.md): the TCPStore has no authentication of its
own. Two things keep a process outside the job away from it:

- it listens on the coordinator's bind address only (loopback for a local
  job), never on a wildcard the job was not told to use: torch's TCPStore
  server binds every interface when it opens its own socket, so we open and
  bind the socket here and hand torch its file descriptor;
- the keys a generation's gloo group uses live under a prefix holding a
  per-generation secret (`generation_key`), handed only to the generation's
  members in the authenticated `rendezvous` answer. A process that can reach
  the store but holds no job token cannot name the group's keys (the members'
  addresses), so cannot read them or plant its own.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
from typing import Any

KEY_BYTES = 16
"""Length of a generation key before hex encoding (128 bits)."""


def listen_socket(host: str, port: int, backlog: int = 4096) -> socket.socket:
    """A listening TCP socket bound to exactly `host`:`port` (0: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        # A restarted coordinator gets its store port back at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def open_store(host: str, port: int) -> Any:
    """The master TCPStore, listening on `host` only. torch owns (and closes)
    the socket from here on, so ours is detached, not closed."""
    from torch.distributed import TCPStore

    sock = listen_socket(host, port)
    bound = int(sock.getsockname()[1])
    fd = sock.detach()
    return TCPStore(host, bound, is_master=True, wait_for_workers=False, master_listen_fd=fd)


def generation_key(secret: bytes, gen: int) -> str:
    """The secret part of generation `gen`'s store prefix: HMAC(secret, gen).
    `secret` is random per coordinator process; a restarted coordinator (a new
    store, too) numbers its generations after the old ones, so keys never
    collide with a generation that is still running."""
    return hmac.new(secret, str(gen).encode(), hashlib.sha256).hexdigest()[: 2 * KEY_BYTES]


def group_prefix(job_id: str, gen: int, key: str) -> str:
    """The store prefix of generation `gen`'s gloo group. Every member computes
    it here (one definition); `key` is the rendezvous answer's `group_key`
    ("" from a coordinator that predates it: the old, guessable prefix)."""
    base = f"{job_id}/gen{gen}"
    return f"{base}/{key}" if key else base

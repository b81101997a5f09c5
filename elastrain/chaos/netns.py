"""Several "hosts" on one machine: Linux network namespaces joined by veth links.

What it is for: partitions you can test. `elastrain run --hosts N` and the
soak put each worker on one of N such hosts so that a `cut` fault can take a
host off the network; the multi-host tests and benchmarks build their own.

    with Network(hosts=3) as net:
        coord = net.run_in(net.coord, [sys.executable, "-m", "elastrain.control.server", ...], env)
        w0 = net.run_in(net.hosts[0], [sys.executable, script], env)
        net.cut(net.hosts[2])    # host 2 drops off the network
        net.heal(net.hosts[2])   # and comes back

Layout (names carry the creating PID and a random suffix, so parallel runs
never clash, and leftovers of a killed run can be recognised and removed):

    ns <prefix>-coord:  lo, bridge "br0" with A.B.C.1/24, ports vb0, vb1, ...
    ns <prefix>-h<i>:   lo, "eth0" with A.B.C.(11+i)/24; its veth peer is vb<i>

Each veth pair is created directly with its ends inside the two namespaces,
so no interface and no address ever appears in the root namespace: the
subnet (a random 10.x.y.0/24 not in use in the root namespace, for the
reader's sake) is reachable only from inside these namespaces. Hosts reach
each other and the coordinator through the bridge; processes started with
`run_in` see only their namespace's interfaces (they share the file system,
so a run directory under /tmp is the "shared file system" of the hosts).

`cut(host)` takes the *bridge side* of the host's link down (`vb<i>` in the
coordinator's namespace): the switch port goes dark. Nothing inside the host
changes: it keeps its address and its routes, so its processes see what a
real partition looks like from inside, silence (packets dropped, connects and
reads timing out) rather than an immediate local "network unreachable" that
taking its own eth0 down would give (that removes the subnet's route in the
host). The other side is symmetrical: frames to the host are dropped at the
bridge, no RST, no ICMP. `heal(host)` brings the port back up; the bridge has
STP off, so the port forwards at once.

Teardown (`close`, also on any exception) kills every process `run_in`
started, by PID, then deletes every namespace (which destroys the veth pairs
and the bridge with them). Root and iproute2's `ip` are required
(`missing_requirement()` says why not).

A process that must talk to the hosts, such as the launcher of `elastrain run
--hosts N` and the coordinator it starts, enters the coordinator's namespace
with `entered(net.coord)`: the switch of this little network, where the bridge
address is. It is a per-thread switch (setns(2)); threads and processes
started from that thread afterwards are in it too.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_PREFIX = "elastrain"
_NETNS_DIR = Path("/run/netns")
_STALE = re.compile(rf"^{_PREFIX}-(\d+)-[0-9a-f]+-")


@dataclass(frozen=True)
class Host:
    """One namespace: `name` is the logical name ("coord", "h0", ...), `ns` the
    namespace, `addr` its address on the shared subnet, `port` the bridge port
    (in the coordinator's namespace) of its link; "" for the coordinator."""

    name: str
    ns: str
    addr: str
    port: str


def missing_requirement() -> str | None:
    """Why network namespaces cannot be built here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (apt-get install iproute2)"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete namespaces left behind by runs whose process is gone (a SIGKILLed
    pytest cannot tear down). Namespaces of live runs are not touched."""
    removed: list[str] = []
    if not _NETNS_DIR.is_dir():
        return removed
    for entry in sorted(_NETNS_DIR.iterdir()):
        m = _STALE.match(entry.name)
        stale = m is not None and not _pid_alive(int(m.group(1)))
        if stale and _ip("netns", "del", entry.name, check=False).returncode == 0:
            removed.append(entry.name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """A random 10.x.y.0/24 that no interface of the root namespace is in."""
    used = []
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    for tok in re.findall(r"inet (\d+\.\d+\.\d+\.\d+/\d+)", out):
        used.append(ipaddress.IPv4Interface(tok).network)
    for _ in range(100):
        net = ipaddress.IPv4Network(
            f"10.{secrets.randbelow(200) + 50}.{secrets.randbelow(254) + 1}.0/24"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 found")


class Network:
    """A coordinator namespace with a bridge, and `hosts` host namespaces, each
    linked to the bridge by a veth pair. A context manager; see the module
    docstring. Not thread-safe (one test drives it)."""

    def __init__(self, hosts: int = 3) -> None:
        if not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be between 1 and 200, got {hosts}")
        why = missing_requirement()
        if why:
            raise RuntimeError(why)
        remove_stale()
        self.prefix = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subnet = _free_subnet()
        base = self.subnet.network_address
        self.coord = Host("coord", f"{self.prefix}-coord", str(base + 1), "")
        self.hosts = [
            Host(f"h{i}", f"{self.prefix}-h{i}", str(base + 11 + i), f"vb{i}") for i in range(hosts)
        ]
        self.procs: list[subprocess.Popen[Any]] = []
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building ------------------------------------------------------------

    def _build(self) -> None:
        plen = self.subnet.prefixlen
        c = self.coord.ns
        self._add_ns(c)
        _ip("-n", c, "link", "set", "lo", "up")
        _ip("-n", c, "link", "add", "br0", "type", "bridge", "stp_state", "0")
        _ip("-n", c, "addr", "add", f"{self.coord.addr}/{plen}", "dev", "br0")
        _ip("-n", c, "link", "set", "br0", "up")
        for h in self.hosts:
            self._add_ns(h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
            # Both ends are born inside their namespaces: nothing in the root one.
            _ip("-n", c, "link", "add", h.port, "type", "veth", "peer", "name", "eth0", "netns", h.ns)  # fmt: skip
            _ip("-n", c, "link", "set", h.port, "master", "br0")
            _ip("-n", c, "link", "set", h.port, "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/{plen}", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    # ---- using ---------------------------------------------------------------

    def host(self, name: str) -> Host:
        for h in [self.coord, *self.hosts]:
            if h.name == name:
                return h
        raise KeyError(name)

    def run_in(
        self,
        host: Host,
        argv: Sequence[str],
        env: Mapping[str, str],
        **popen: Any,
    ) -> subprocess.Popen[Any]:
        """Start `argv` inside `host`'s namespace (`ip netns exec` execs it, so the
        Popen's PID is the program's own). Torn down with the network."""
        p = subprocess.Popen([*self.exec_prefix(host), *argv], env=dict(env), **popen)
        self.procs.append(p)
        return p

    def exec_prefix(self, host: Host) -> list[str]:
        """argv prefix that runs a program in `host`'s namespace (`ip netns exec`
        execs it: the PID a Popen sees is the program's own)."""
        return ["ip", "netns", "exec", host.ns]

    def exec_in(self, host: Host, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """Run a short command in `host`'s namespace and return its output."""
        return subprocess.run(
            ["ip", "netns", "exec", host.ns, *argv], capture_output=True, text=True, timeout=30
        )

    def cut(self, host: Host) -> None:
        """Partition `host`: its bridge port goes down (see the module docstring)."""
        _ip("-n", self.coord.ns, "link", "set", host.port, "down")

    def heal(self, host: Host) -> None:
        """Reconnect `host`: its bridge port comes back up."""
        _ip("-n", self.coord.ns, "link", "set", host.port, "up")

    # ---- teardown --------------------------------------------------------------

    def close(self) -> None:
        """Kill every started process (by PID), then delete every namespace.
        Idempotent; every step is attempted even if an earlier one failed."""
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        errors = []
        for ns in reversed(self._made):
            r = _ip("netns", "del", ns, check=False)
            if r.returncode != 0 and (_NETNS_DIR / ns).exists():
                errors.append(f"{ns}: {r.stderr.strip()}")
        self._made.clear()
        if errors:
            raise RuntimeError("could not delete namespaces: " + "; ".join(errors))

    def __enter__(self) -> Network:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_CLONE_NEWNET = 0x40000000


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def entered(host: Host) -> Iterator[None]:
    """Run the calling thread inside `host`'s namespace until the block ends.

    Only the calling thread moves (and what it starts meanwhile: threads,
    processes, sockets it creates); sockets made before keep their namespace.
    """
    here = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        there = os.open(_NETNS_DIR / host.ns, os.O_RDONLY)
        try:
            _setns(there)
        finally:
            os.close(there)
        try:
            yield
        finally:
            _setns(here)
    finally:
        os.close(here)

"""pytest glue for `elastrain.chaos.netns` (network namespaces as hosts)."""

from __future__ import annotations

from collections.abc import Iterator

from elastrain.chaos.netns import Host, Network, missing_requirement

__all__ = ["Host", "Network", "missing_requirement", "network", "require"]


def require() -> None:
    """pytest.skip unless namespaces can be built (root and `ip`); never skips otherwise."""
    import pytest

    why = missing_requirement()
    if why:
        pytest.skip(why)


def network(hosts: int = 3) -> Iterator[Network]:
    """Generator body for a pytest fixture: skips without root or `ip`."""
    require()
    with Network(hosts) as net:
        yield net

"""A demo's job run under a driver: the launcher's status calls go to the progress
line and to the driver, which follows the run's events and paces or schedules
faults (`elastrain demo --sharded`, `--jax`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypeVar

from elastrain.chaos.injector import register as register_chaos
from elastrain.launch.launcher import LaunchConfig, Launcher, RunResult
from elastrain.launch.progress import Progress


class StatusDriver(Protocol):
    def on_status(self, status: Mapping[str, Any]) -> None: ...


D = TypeVar("D", bound=StatusDriver)


def run_driven(
    cfg: LaunchConfig,
    steps: int,
    plain: bool,
    make_driver: Callable[[Launcher, Callable[[str], None]], D],
) -> tuple[RunResult, Launcher, D]:
    """Run `cfg` with a progress line; `make_driver(launcher, note)` builds the
    driver once the launcher (its run directory, its fault schedule) exists; it
    sees every status call after the progress line has."""
    with Progress(steps, plain=plain or None) as prog:
        drivers: list[D] = []

        def on_status(st: dict[str, Any]) -> None:
            prog.update(st)
            for d in drivers:
                d.on_status(st)

        register_chaos()  # its faults reach the launcher through the fault seam
        launcher = Launcher(cfg, on_status=on_status)
        driver = make_driver(launcher, prog.note)
        drivers.append(driver)
        prog.note(f"run directory: {launcher.run_dir}")
        prog.attach(launcher.run_dir)
        result = launcher.run()
    return result, launcher, driver

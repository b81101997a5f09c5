"""Shared fixtures: run a real elastic job (coordinator + worker processes) in a temp dir."""

from __future__ import annotations

import http.client
import importlib.util
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from elastrain.chaos.injector import register as register_chaos
from elastrain.chaos.schedule import parse_fault
from elastrain.launch.launcher import LaunchConfig, Launcher, RunResult
from elastrain.observe.events import read_events
from elastrain.observe.metrics import FAILURES

# The test suite is an entry point: its launchers fire chaos faults through the
# launcher's fault seam, as `elastrain run` does.
register_chaos()

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "tests" / "scripts" / "train_mlp.py")


def load_benchmark(script: str) -> Any:
    """``benchmarks/<script>`` loaded as a module (as ``bench_<name>``), for tests of its
    pure arithmetic; its own imports (`_steady.py`, `recovery.py`, ...) live beside it."""
    bench = ROOT / "benchmarks"
    if str(bench) not in sys.path:
        sys.path.insert(0, str(bench))
    name = "bench_" + Path(script).stem
    spec = importlib.util.spec_from_file_location(name, bench / script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


REPLACE_AFTER_RESHARD_S = 3.0
"""The replace delay of the reshard tests (2 x 2 -> 1 x 3 and back): their vacancy
must outlast ``reshard_after_s`` (0.5 s) and the held step's boundary (1 s) before the
replacement starts. A replacement forked from the warm prefork server starts in well
under a second, so the delay is that margin, not the replacement's own start-up."""


class FaultHold:
    """Holds a job's steps at ``seconds`` each through its pace file (the scripts'
    --pace-file, read every step) from its fault until ``released(events)`` is true:
    a loaded machine starts a replacement slowly, and the job must still be running
    when it arrives; before the fault and after the release it runs at full speed.
    The hold begins at `begin` (a test's own fault, or the job's start) or at the
    first `poll` whose events show a ``fault_injected`` or a worker's exit."""

    def __init__(
        self, pace: Path, seconds: str, released: Callable[[list[dict[str, Any]]], bool]
    ) -> None:
        self.pace, self.seconds, self.released = pace, seconds, released
        self.held = False

    def begin(self) -> None:
        if not self.held:
            self.pace.write_text(self.seconds)
            self.held = True

    def poll(self, events: list[dict[str, Any]]) -> None:
        """One status poll's look at the job's events."""
        if not self.held:
            if any(e["kind"] in ("fault_injected", "worker_exited") for e in events):
                self.begin()
        elif self.pace.exists() and self.released(events):
            self.pace.unlink()


@dataclass(frozen=True)
class JoinGate:
    """A replacement held before it joins until the test opens ``file``: the
    sharded scripts' ``--gated-members``/``--gate-file`` (`wait_at_gate` in
    tests/scripts/job_common.py). For a test that needs what follows its fault (a
    step or an evaluation run with the dead rank's slot vacant) to happen before a
    replacement forked from the warm prefork server joins, a few tenths of a second
    after the fault."""

    file: Path
    member: str

    @property
    def args(self) -> tuple[str, ...]:
        """The script's arguments that hold ``member`` at this gate."""
        return ("--gated-members", self.member, "--gate-file", str(self.file))

    def open_if(self, ready: bool) -> bool:
        """Open the gate when ``ready``; returns ``ready``."""
        if ready:
            self.file.touch()
        return ready


@dataclass
class InProcessRun:
    run_dir: Path
    events: list[dict[str, Any]]


def run_in_process(
    script: str, run_dir: Path, steps: int, argv: list[str] | None = None, **env_vars: str
) -> InProcessRun:
    """`script`'s failure-free run trained in this process as a single member (a
    coordinator server in this process, the script run as `__main__` on a thread of
    its own): its run directory (what a member writes there: final parameters...) and
    events.

    For a reference run: the math does not depend on how many members split the
    batch (float64 reductions), and this spares the suite a job's process start-up
    (a coordinator and a worker importing torch: tens of seconds on a loaded machine)."""
    import random
    import runpy
    import threading
    from unittest import mock

    import numpy as np
    import torch

    from elastrain import env
    from elastrain.control.config import CoordinatorConfig
    from elastrain.control.server import CoordinatorServer

    srv = CoordinatorServer(CoordinatorConfig(target=1), "ref-token", run_dir=str(run_dir))
    srv.start()
    worker_env = {env.COORDINATOR: srv.address, env.TOKEN: "ref-token", env.MEMBER_ID: "w0",
                  env.RUN_DIR: str(run_dir), env.STEPS: str(steps), **env_vars}  # fmt: skip
    errors: list[BaseException] = []

    def train() -> None:
        try:
            runpy.run_path(script, run_name="__main__")  # as `python script`
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    # What a script sets for its own process (one thread, its seeds) is put back after.
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    path = [str(Path(script).parent), *sys.path]  # as when run: its directory first
    try:
        with (
            mock.patch.dict(os.environ, worker_env),
            mock.patch.object(sys, "argv", [script, *(argv or [])]),
            mock.patch.object(sys, "path", path),
        ):
            # Off the main thread, so the trainer leaves pytest's SIGTERM handler alone;
            # a daemon, so that a run that hangs fails its test, not the session's exit.
            t = threading.Thread(target=train, name="reference-worker", daemon=True)
            t.start()
            t.join(timeout=300)
    finally:
        srv.stop()
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        random.setstate(py_rng)
        np.random.set_state(np_rng)
    assert not t.is_alive() and not errors, errors
    return InProcessRun(run_dir, read_events(run_dir))


class Job:
    def __init__(self, launcher: Launcher, result: RunResult) -> None:
        self.launcher = launcher
        self.result = result
        self.run_dir = result.run_dir
        self.events = read_events(result.run_dir)

    def of(self, kind: str, **match: Any) -> list[dict[str, Any]]:
        return [
            e
            for e in self.events
            if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())
        ]

    def log(self, member: str) -> str:
        return (self.run_dir / "logs" / f"{member}.log").read_text()


@pytest.fixture
def run_job(tmp_path: Path) -> Callable[..., Job]:
    """Run one job to completion; every process it started is gone afterwards."""
    launched: list[Launcher] = []

    def run(
        *,
        steps: int = 40,
        workers: int = 4,
        faults: list[str] | None = None,
        points: list[dict[str, Any]] | None = None,
        name: str = "job",
        script: str = MLP,
        script_args: list[str] | None = None,
        on_status: Callable[[Launcher, dict[str, Any]], None] | None = None,
        **kw: Any,
    ) -> Job:
        import json

        cfg = LaunchConfig(
            script=script,
            script_args=script_args or [],
            workers=workers,
            steps=steps,
            run_dir=str(tmp_path / name),
            faults=[parse_fault(f) for f in faults or []],
            fault_points=json.dumps(points) if points else None,
            progress=False,
            extra_env={"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")},
            **kw,
        )
        launcher = Launcher(
            cfg, on_status=None if on_status is None else lambda st: on_status(launcher, st)
        )
        launched.append(launcher)
        return Job(launcher, launcher.run())

    yield run
    for la in launched:
        # run() stops everything it started; double-check by PID.
        for pids in la.pids.values():
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                os.kill(pid, 9)
                pytest.fail(f"process {pid} outlived its job")
        if la.coordinator is not None:
            assert la.coordinator.poll() is not None, "coordinator outlived its job"


@pytest.fixture(scope="session")
def loop_reference(tmp_path_factory: pytest.TempPathFactory) -> InProcessRun:
    """tests/scripts/train_loop.py's failure-free run, once per session (test_loop.py
    and test_evaluate.py compare their jobs with it)."""
    from .test_loop import reference_job

    return reference_job(tmp_path_factory)


@pytest.fixture
def small_fs(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs mounted at tmp_path/small (needs root and mount permission)."""
    import shutil

    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs not permitted here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


_SIGINT_DEFAULT = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execvp(sys.argv[1], sys.argv[1:])"
)


def sigint_default(cmd: list[str]) -> list[str]:
    """`cmd` run with SIGINT at its default action. A test runner started in the
    background (`cmd &` in a script) runs with SIGINT ignored and a child inherits
    that, so a launcher would never see the Ctrl-C a test sends it. Reset in a
    small exec'd Python, not a `preexec_fn`: Python code between fork and exec
    in a test process with torch's threads can crash or deadlock."""
    return [sys.executable, "-c", _SIGINT_DEFAULT, *cmd]


def stop_processes(proc: subprocess.Popen[str], pids: set[int] | list[int]) -> None:
    """Teardown: stop a launcher subprocess and, by PID, every process it started."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def scrape(host: str, port: int, token: str | None) -> tuple[int, str]:
    """GET /metrics from a coordinator (with the job token, if given): (status, text)."""
    c = http.client.HTTPConnection(host, port, timeout=5)
    try:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        c.request("GET", "/metrics", headers=headers)
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def metric_samples(text: str) -> list[Sample]:
    """Every sample of a /metrics text, parsed by prometheus_client's own parser."""
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def metric_values(text: str) -> dict[str, float]:
    """Sample name -> value (labels dropped: the last sample of a name wins)."""
    return {s.name: s.value for s in metric_samples(text)}


def failures_metric(text: str) -> dict[str, float]:
    """kind -> value of every `elastrain_failures_total` sample."""
    return {s.labels["kind"]: s.value for s in metric_samples(text) if s.name == FAILURES}


def pytest_configure(config: pytest.Config) -> None:
    sys.path.insert(0, str(ROOT))


LONGEST_FIRST = (
    "test_soak.py", "test_elastic.py", "test_sharded.py", "test_sharded_step.py",
    "test_jax_multiproc.py", "test_sharded_carry.py", "test_script_failures.py",
    "test_durable.py", "test_demo_sharded.py", "test_jax.py", "test_slurm.py",
    "test_examples.py", "test_partition.py", "test_sharded_checkpoint.py",
    "test_sharded_meta.py", "test_gpu_check.py", "test_spares.py", "test_demo_jax.py",
)  # fmt: skip
"""The files with the most test time (summed, measured), longest first. `make test`
hands whole files to two workers (--dist loadfile) in collection order, as each
worker frees up: alphabetically, the long sharded, Slurm and soak files came last,
and the run ended with one worker on the soak for minutes while the other idled.
Handing the longest out first leaves the short files to even out the end."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Collect the LONGEST_FIRST files first (each file's tests keep their order)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    order = {id(item): n for n, item in enumerate(items)}
    items.sort(key=lambda it: (rank.get(it.path.name, len(rank)), order[id(it)]))


@pytest.fixture()
def master_store() -> Iterator[Any]:
    """A TCPStore server on a free loopback port, for process groups of threads."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    del store

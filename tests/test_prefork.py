"""Workers forked from the prefork server (`elastrain.launch.prefork`): each runs as
`python -m elastrain.worker SCRIPT ARGS` would (its own PID, session, environment,
working directory, log and exit status), the launcher learns every exit, and a
server that dies takes its children with it and lets the launcher fall back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from elastrain.launch.prefork import ForkedProcess, Preforker

SCRIPT = textwrap.dedent(
    """
    import json, os, sys, time
    out = {"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
           "mine": os.environ.get("ONLY_MINE"), "torch": "torch" in sys.modules,
           "dynamo": "torch._dynamo" in sys.modules, "umask": os.umask(0o22)}
    print(json.dumps(out), flush=True)
    if sys.argv[1] == "wait":
        time.sleep(60)  # killed by the test
    sys.exit(int(sys.argv[1]))
    """
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Preforker]:
    pf = Preforker()
    pf.start({**os.environ, "SHARED": "1"}, tmp_path / "prefork.log", 0o77)
    yield pf
    pf.close()


def spawn(pf: Preforker, tmp_path: Path, name: str, *args: str) -> ForkedProcess:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ONLY_MINE": name}
    proc = pf.spawn([str(script), *args], env, str(tmp_path), tmp_path / f"{name}.log", 0o27)
    assert proc is not None, (tmp_path / "prefork.log").read_text()
    return proc


def first_line(path: Path) -> dict[str, object]:
    return dict(json.loads(path.read_text().splitlines()[0]))


def test_a_forked_worker_runs_its_script_as_its_own_process_and_its_exit_is_reported(
    server: Preforker, tmp_path: Path
) -> None:
    a = spawn(server, tmp_path, "a", "3")
    b = spawn(server, tmp_path, "b", "0")
    assert (a.wait(30), b.wait(30)) == (3, 0)
    out = first_line(tmp_path / "a.log")
    assert out["pid"] == a.pid and out["sid"] == a.pid  # its own session, as Popen's
    assert out["argv"] == [str(tmp_path / "child.py"), "3"] and out["cwd"] == str(tmp_path)
    assert out["mine"] == "a" and first_line(tmp_path / "b.log")["mine"] == "b"
    assert out["torch"] is True  # imported once, by the server
    assert out["dynamo"] is True  # what torch.optim imports at a first optimizer, too
    assert out["umask"] == 0o27
    assert os.getpid() != a.pid != b.pid


def test_a_killed_worker_reports_the_signal_and_a_closed_server_ends(
    server: Preforker, tmp_path: Path
) -> None:
    w = spawn(server, tmp_path, "w", "wait")
    assert w.poll() is None
    w.kill()
    assert w.wait(30) == -signal.SIGKILL and w.poll() == -signal.SIGKILL
    w.kill()  # after its end: nothing to signal, no error
    server.close()
    assert server._proc is not None and server._proc.returncode == 0


def test_a_dead_server_takes_its_workers_and_the_launcher_falls_back(
    server: Preforker, tmp_path: Path
) -> None:
    w = spawn(server, tmp_path, "w", "wait")
    assert server._proc is not None
    os.kill(server._proc.pid, signal.SIGKILL)
    assert w.wait(30) == -signal.SIGKILL  # reported as Popen would
    # And it really died (its death signal): a process that is not our child is
    # polled for; gone, or a zombie until init reaps it.
    tick = threading.Event()
    for _ in range(3000):
        try:
            state = Path(f"/proc/{w.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            break
        if state == "Z":
            break
        tick.wait(0.01)
    else:
        raise AssertionError(f"worker {w.pid} outlived its prefork server")
    assert not server.serving
    assert server.spawn(["x.py"], dict(os.environ), str(tmp_path), tmp_path / "x.log", 0) is None


ENDS = textwrap.dedent(
    """
    import atexit, sys, threading
    from pathlib import Path
    from elastrain.exitcodes import WorkerExit

    out = Path(sys.argv[1])

    class Held:  # finalized at the exit, its globals still set
        def __del__(self) -> None:
            (out / "freed").write_text("finalized")

    held = Held()

    def last_words() -> None:
        threading.main_thread().join()  # runs on after the script returned
        (out / "thread").write_text("joined")

    threading.Thread(target=last_words).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    print("printed, not flushed")
    if sys.argv[2] == "leave":
        raise WorkerExit(75, "left", "")
    """
)


@pytest.mark.parametrize("how", ["forked", "popen"])
@pytest.mark.parametrize("end", ["return", "leave"])
def test_a_worker_ends_as_an_interpreter_exit_would(
    server: Preforker, tmp_path: Path, how: str, end: str
) -> None:
    """A worker whose script returned (or left with a `WorkerExit`) ends without the
    interpreter's teardown (`end_process`), and yet what a normal exit does that
    anyone can see happens: its non-daemon threads run to their end, its atexit
    hooks run, its module-level objects are finalized, its output is flushed,
    and its exit status is the script's."""
    script = tmp_path / "ends.py"
    script.write_text(ENDS)
    argv = [str(script), str(tmp_path), end]
    log = tmp_path / "w.log"
    if how == "forked":
        proc = server.spawn(argv, dict(os.environ), str(tmp_path), log, 0o77)
        assert proc is not None, (tmp_path / "prefork.log").read_text()
        rc = proc.wait(60)
    else:
        with log.open("w") as f:
            rc = subprocess.run(
                [sys.executable, "-m", "elastrain.worker", *argv],
                stdout=f, stderr=subprocess.STDOUT, timeout=60,
            ).returncode  # fmt: skip
    assert rc == (0 if end == "return" else 75), log.read_text()
    assert (tmp_path / "thread").read_text() == "joined"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert (tmp_path / "freed").read_text() == "finalized"
    assert "printed, not flushed" in log.read_text()

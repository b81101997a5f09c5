"""The worker entry point: `python -m elastrain.worker SCRIPT [ARGS...]`.

What `elastrain run` (and an agent) starts for each member. It runs the
user's script as `__main__`, like `python SCRIPT ARGS` would (same argv,
script directory first on sys.path), with two additions that keep the
library free of process-level decisions:

- the step hooks the launcher asked for are installed first (the chaos fault
  points when $ELASTRAIN_FAULTS or a run directory is set), so the engine
  never imports the tools;
- a `WorkerExit` raised by the library (leave, preemption, refusal, no
  coordinator, a misconfigured script) becomes the process exit status, here
  and nowhere else (with the exit record it carries written: a torn heal's
  cause of the member's own, `WorkerExit.record`); an error torch raises for a well-known mistake (a script
  using torch.distributed directly) exits EXIT_MISCONFIGURED with what to change;
- any other exception the script raises is a bug in the script, not a hardware
  failure: the traceback is printed, the exception's type, message and script
  line are written as the worker's exit record (`elastrain.exitrecord`), and
  the process ends at once with status 1, as a kill would end it. At once,
  because its peers are waiting for it in a collective: its sockets closing is
  what fails their wait in milliseconds, where the orderly shutdown of a live
  process (seconds) made a sharded group-mate suspect it of hanging. What that
  skips (atexit hooks, the last asynchronous checkpoint write) is what a kill
  skips, which the peers and the checkpoints already survive.

A worker whose script ended (done, or a `WorkerExit` that is not immediate)
ends with `end_process`: everything an interpreter's exit does that the
script or its peers can observe, then `os._exit`, without the interpreter's
teardown of every module torch loaded (0.5-1 s of CPU, on cores the survivors
train on).
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from elastrain import env
from elastrain.children import die_with_parent, end_process
from elastrain.exitcodes import EXIT_MISCONFIGURED, EXIT_SCRIPT_ERROR, WorkerExit
from elastrain.exitrecord import ScriptError, from_exception, write_record
from elastrain.runtime.preflight import explain


def install_hooks() -> None:
    """Install the hooks the environment asks for (the launcher's fault points)."""
    from elastrain.chaos.points import FaultHook
    from elastrain.runtime import hooks

    hook = FaultHook.from_env()
    if hook is not None:
        hooks.install(hook)


def join_replica_runtime() -> None:
    """A process of a multi-process JAX replica (`elastrain run --replica-procs K`)
    joins its replica's `jax.distributed` runtime before the script's first JAX call."""
    from elastrain.runtime.replica_place import ReplicaPlace

    place = ReplicaPlace.from_environ(os.environ)
    if place is not None:
        from elastrain.jax.replica import init_distributed

        init_distributed(place)


def main(argv: list[str] | None = None) -> NoReturn:
    """The worker: run the script (`run`), then end the process with its status
    (`end_process`)."""
    end_process(run(sys.argv[1:] if argv is None else argv))


def run(args: list[str]) -> int:
    """Run the script ``args[0]`` with its arguments as ``__main__``; the process's
    exit status."""
    if not args:
        print("usage: python -m elastrain.worker SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    die_with_parent()
    script = args[0]
    sys.argv = list(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    install_hooks()
    join_replica_runtime()
    try:
        runpy.run_path(script, run_name="__main__")
    except WorkerExit as e:
        if e.message:
            print(e.message, file=sys.stderr, flush=True)
        if e.record is not None:
            record(e.record)
        if e.immediate:
            # Still inside the handler: the traceback holds the script's frames, so
            # none of its CUDA tensors has been freed yet (see WorkerExit). Buffered
            # output and log records are written first; nothing else runs.
            sys.stdout.flush()
            logging.shutdown()
            os._exit(e.code)
        return e.code
    except Exception as e:
        # A well-known mistake that torch reports in words pointing the wrong way
        # ("Default process group has not been initialized"): say what to change.
        why = explain(e)
        traceback.print_exc()
        if why is None:
            script_failed(e)
        print(f"elastrain: misconfigured: {why}", file=sys.stderr, flush=True)
        return EXIT_MISCONFIGURED
    return 0


def record(err: ScriptError) -> None:
    """Write this process's exit record, where the launcher reads it (its run directory)."""
    run_dir, member = os.environ.get(env.RUN_DIR), os.environ.get(env.MEMBER_ID)
    if run_dir and member:
        try:
            write_record(Path(run_dir), member, os.getpid(), err)
        except OSError as why:
            print(f"elastrain: could not write the exit record: {why}", file=sys.stderr)


def script_failed(e: Exception) -> NoReturn:
    """The script raised `e` (its traceback is printed): record it and end the
    process now (see the module docstring)."""
    err = from_exception(e)
    print(f"elastrain: the script raised {err.headline()}", file=sys.stderr, flush=True)
    record(err)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(EXIT_SCRIPT_ERROR)


if __name__ == "__main__":
    main()

"""JAX replicas of several processes (issue 44): `elastrain run -n 4 --replica-procs 2`.

Pure parts: the launcher's replica book, the generation's replica layout, the
place a process reads from its environment, the partition of a leaf, the
launch config's refusals. Jobs (2 replicas x 2 processes, the soak's MLP with
dropout, float64 reductions): the failure-free run's loss curve equals a plain
2-member JAX job's bit for bit; a SIGKILL of one process: its replica-mate is
stopped, the other replica commits its next step within 1 s + one step with
the same PIDs, the replica is rebuilt as 2 fresh processes healed shard by
shard from their twins (bytes = one shard), the loss curve is bit-identical to
the failure-free run's, exactly-once holds and twins hold equal digests at every
generation start. Skipped where JAX or optax is not installed.
"""

from __future__ import annotations

import logging
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

from elastrain import env  # noqa: E402
from elastrain.data import GlobalOrder  # noqa: E402
from elastrain.jax.replica import AXIS, ReplicaLayout, default_spec, local_rows  # noqa: E402
from elastrain.launch.config import LaunchConfig  # noqa: E402
from elastrain.launch.replicas import ReplicaBook, expelled, free_address  # noqa: E402
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve  # noqa: E402
from elastrain.runtime.config import TrainerConfig, read_worker_env  # noqa: E402
from elastrain.runtime.replica_place import ReplicaPlace, parse_wire  # noqa: E402

from .conftest import ROOT, Job  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "train_jax_replicas.py")
PLAIN = str(ROOT / "tests" / "scripts" / "train_jax_mlp.py")
B, SEED, DATASET = 24, 7, 4096
HIDDEN = 32
STEPS = 40
FULL_BYTES = 3 * (16 * HIDDEN + HIDDEN + HIDDEN + 1) * 4 + 4 + 8
"""The whole model's state (params, adam's mu and nu, its count, the key): what a
replicated heal would move."""
PACE_S = 1.0
"""Seconds per step at least in the fault runs until the rebuilt replica is healed
(then full speed): a rebuilt replica (JAX import, runtime, compile) took 20-31 s
to join on this busy 2-core machine, and must join before the last step to be
seen healed."""


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


# ---- pure parts --------------------------------------------------------------------


def test_the_book_places_replicas_in_order_and_rebuilds_a_lost_one() -> None:
    ports = iter(range(9000, 9100))
    book = ReplicaBook(2, 2, lambda: f"127.0.0.1:{next(ports)}")
    places = [book.place_for(f"w{i}") for i in range(4)]
    assert [(p.replica, p.incarnation, p.proc) for p in places] == [
        (0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1),
    ]  # fmt: skip
    assert places[0].coordinator == places[1].coordinator != places[2].coordinator
    with pytest.raises(ValueError, match="all 2 replicas"):
        book.place_for("w9")
    # w1 dies: w0 is its mate to stop; w0's own exit afterwards names nobody.
    assert book.lost("w1") == ["w0"]
    assert book.lost("w0") == []
    fresh = [book.place_for("w4"), book.place_for("w5")]
    assert [(p.replica, p.incarnation, p.proc) for p in fresh] == [(0, 1, 0), (0, 1, 1)]
    assert fresh[0].coordinator not in {p.coordinator for p in places}
    assert book.lost("w2") == ["w3"]


def test_an_expelled_process_is_one_that_held_the_state_and_is_no_longer_registered() -> None:
    status: dict[str, Any] = {"registered": {"w0": {}, "w2": {}, "w3": {}}}
    holders = {"w0", "w1", "w2", "w3"}
    assert expelled(status, holders, ["w0", "w1", "w2", "w3", "w4"], False) == ["w1"]
    # w4 is fresh (never held the state): not registered yet is no expulsion.
    assert expelled(status, holders, ["w4"], False) == []
    assert expelled(status, holders, ["w1"], True) == []  # the job is ending
    assert expelled({"registered": {}}, holders, ["w1"], False) == []  # a new coordinator
    assert expelled({**status, "finished": True}, holders, ["w1"], False) == []


def test_a_place_travels_through_the_environment_and_refuses_a_partial_one() -> None:
    p = ReplicaPlace(2, 1, 3, 1, "127.0.0.1:1234")
    assert ReplicaPlace.from_environ(p.environ()) == p
    assert parse_wire(p.wire()) == ((1, 3), 1, 2)
    assert ReplicaPlace.from_environ({}) is None
    assert ReplicaPlace.from_environ({env.REPLICA_PROCS: "1"}) is None
    with pytest.raises(ValueError, match="incomplete"):
        ReplicaPlace.from_environ({env.REPLICA_PROCS: "2", env.REPLICA: "0"})
    with pytest.raises(ValueError, match="outside"):
        ReplicaPlace(2, 0, 0, 2, "x:1")
    host, port = free_address("127.0.0.1").split(":")
    assert host == "127.0.0.1" and int(port) > 0


def test_the_layout_finds_complete_replicas_twins_and_turns() -> None:
    a, b, c = (0, 0), (1, 0), (0, 1)
    places = {"w0": (a, 0), "w1": (a, 1), "w2": (b, 0), "w3": (b, 1), "w5": (c, 1)}
    layout = ReplicaLayout(("w2", "w3", "w0", "w1", "w5"), places, 2)
    assert layout.complete() == [b, a]  # by their first member's rank
    assert layout.twins(1) == ["w3", "w1", "w5"]
    # 6 micro-batches: replica b takes 0..2, a takes 3..5; inside each, rounds of 2.
    assert layout.turns("w2", 6) == [0, 2]
    assert layout.turns("w3", 6) == [1, None]  # a padding round, weight 0
    assert layout.turns("w0", 6) == [3, 5]
    assert layout.turns("w5", 6) == []  # its replica is incomplete: it computes nothing
    counted = [i for w in ("w0", "w1", "w2", "w3") for i in layout.turns(w, 6) if i is not None]
    assert sorted(counted) == list(range(6))  # every micro-batch counted once
    with pytest.raises(LookupError):
        ReplicaLayout(("w5",), {"w5": (c, 1)}, 2).turns("w5", 6)


def test_a_leaf_is_split_by_rows_where_the_processes_divide_it() -> None:
    assert default_spec((16, 32), 2) == (AXIS,)
    assert default_spec((1,), 2) == ()
    assert default_spec((), 2) == ()
    assert local_rows((16, 32), (AXIS,), 2, 1) == (slice(8, 16), slice(None))
    assert local_rows((3,), (), 2, 1) == (slice(None),)
    with pytest.raises(ValueError, match="unknown mesh axis"):
        local_rows((4,), ("model",), 2, 0)


def _replica_part(whole: dict[str, Any], procs: int, proc: int) -> dict[str, Any]:
    """Process `proc` of `procs`'s part of a test state: w split by rows, v along its
    second dimension (where `procs` divides them), b and the key whole."""
    w, v = whole["params"]["w"], whole["params"]["v"]
    sw = (AXIS,) if w.shape[0] % procs == 0 else ()
    sv = (None, AXIS) if v.shape[1] % procs == 0 else ()
    return {
        "params": {
            "b": whole["params"]["b"],
            "v": v[local_rows(v.shape, sv, procs, proc)],
            "w": w[local_rows(w.shape, sw, procs, proc)],
        },
        "key": whole["key"],
    }


def test_a_checkpoint_holds_whole_leaves_in_row_parts_and_resumes_on_any_k() -> None:
    """Writers 0 and 1 of a 2-process replica write row blocks of each stored leaf
    (a leaf split along dimension 1 is stored with it first), the whole leaves by
    writer 0, every row once; processes of 1, 2, 3 or 4-process replicas read their
    own parts back, bit for bit (3: w and v are not divisible, read whole); so does a
    process reading a single-process JAX job's flat checkpoint (every leaf whole)."""
    import torch

    from elastrain.checkpoint.dcp import tiling_problem
    from elastrain.jax.replica_checkpoint import (
        META,
        LeafPart,
        WholeTensors,
        flat_leaves,
        layout_problem,
        leaf_parts,
        read_part,
        replica_parts,
        saved_parts,
    )

    rng = np.random.default_rng(0)
    whole = {
        "params": {
            "b": np.float32(2.5),
            "v": rng.standard_normal((3, 4)).astype(np.float32),
            "w": rng.standard_normal((4, 6)).astype(np.float64),
        },
        "key": np.array([7, 9], dtype=np.uint32),
    }
    shapes = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), whole)
    parts = leaf_parts(shapes, _replica_part(whole, 2, 0), 2)
    assert [(p.name, p.dim) for p in parts] == [
        ("['key']", None), ("['params']['b']", None), ("['params']['v']", 1), ("['params']['w']", 0),
    ]  # fmt: skip
    written = [replica_parts(parts, _replica_part(whole, 2, k), {"step": 3}, 2, k) for k in (0, 1)]
    assert written[0].tensors == written[1].tensors
    assert written[0].tensors["['params']['v']"] == ("torch.float32", (4, 3))
    assert written[0].meta[META]["procs"] == 2 and written[0].meta["step"] == 3
    assert {c.fqn for c in written[1].chunks} == {"['params']['v']", "['params']['w']"}
    stored: dict[str, torch.Tensor] = {}
    for fqn, (_, shape) in written[0].tensors.items():
        chunks = [c for part in written for c in part.chunks if c.fqn == fqn]
        assert tiling_problem([(c.lo, c.hi) for c in chunks], shape[0] if shape else 1) is None
        stored[fqn] = torch.cat([c.tensor.reshape(c.hi - c.lo, *shape[1:]) for c in chunks])
        stored[fqn] = stored[fqn].reshape(shape)
    saved = saved_parts(written[0].meta, {}, [])
    for procs in (1, 2, 3, 4):
        for k in range(procs):
            want = _replica_part(whole, procs, k)
            mine = leaf_parts(shapes, want, procs)
            assert layout_problem(saved, mine) is None
            got = read_part(WholeTensors(stored), saved, mine, procs, k)
            for a, b in zip(got, jax.tree_util.tree_leaves(want), strict=True):
                assert a.dtype == np.asarray(b).dtype and np.array_equal(a, b), (procs, k)
    # A single-process JAX job's flat checkpoint: every leaf whole, in its own order.
    flat = {p.name: torch.from_numpy(np.array(x)) for p, x in
            zip(parts, jax.tree_util.tree_leaves(whole), strict=True)}  # fmt: skip
    flat = dict(reversed(flat.items()))
    saved_flat = saved_parts({}, flat_leaves(flat), [p.name for p in parts])
    assert [p.name for p in saved_flat] == [p.name for p in parts]
    got = read_part(WholeTensors(flat), saved_flat, parts, 2, 1)
    for a, b in zip(got, jax.tree_util.tree_leaves(_replica_part(whole, 2, 1)), strict=True):
        assert np.array_equal(a, b)
    other = [*parts[:3], LeafPart("['params']['w']", (8, 6), "float64", 0)]
    assert "is ['params']['w'] float64[8, 6] here" in str(layout_problem(saved, other))
    with pytest.raises(ValueError, match="not a 4th"):
        leaf_parts(shapes, _replica_part(whole, 2, 0), 4)


def _mlp_backend(proc: int | None, optimizer: Any, max_norm: float | None = None) -> Any:
    """The test MLP's backend in this process (no JAX runtime: nothing here runs a
    replica's collective): process `proc` of a 2-process replica, or (None) the
    single-process backend holding the whole model."""
    from elastrain.chaos.soak_job_jax import init, loss_fn
    from elastrain.jax.backend import JaxBackend
    from elastrain.jax.replica_backend import JaxReplicaBackend

    params = init(jax.random.PRNGKey(0), 16, HIDDEN)
    cfg = TrainerConfig(global_batch_size=B, micro_batch_size=4, total_steps=1, seed=SEED,
                        max_grad_norm=max_norm)  # fmt: skip
    if proc is None:
        return JaxBackend(params, optimizer, loss_fn, cfg, key=None)
    place = ReplicaPlace(2, 0, 0, proc, "127.0.0.1:1")
    return JaxReplicaBackend(params, optimizer, loss_fn, cfg, key=None, place=place)


def test_a_replica_process_compiles_its_update_once_across_steps_and_a_heal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The update `warm_up` compiles must serve every step, after a heal too: Adam's
    count came out of ``init`` uncommitted and a heal's leaves uncommitted, so the
    update compiled again in the first step after the warm-up and after each heal
    (seconds on a busy machine: the other replica's watchdog fired while a rebuilt
    replica's first step waited for XLA)."""
    from elastrain.jax.state import rebuild

    b = _mlp_backend(1, optax.adam(1e-2))
    for _ in range(2):
        b.begin_step(4)
        assert b.apply().grad_norm == 0.0  # an empty buffer: norm 0, the update compiled
    state = b.state()
    arrays = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.tree)]
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        state.healed = rebuild(state.tree, arrays)
        b.adopt(state)  # what a heal's receiver installs
        b.begin_step(4)
        b.apply()
    assert b._apply._cache_size() == 1
    # Nor does the heal's install compile anything (jnp.array staged each new shape).
    assert [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()] == []


def test_clipping_uses_the_whole_models_norm_over_a_replicas_parts() -> None:
    """Two processes of a replica, each holding its rows of one summed gradient, put
    their parts' squared norms in the norm slot; summed as the vote sums them, the
    norm equals the single-process backend's over the whole gradient, and each
    process's clipped update equals that backend's rows of it."""
    from elastrain.jax.replica import local_rows

    lr, limit = 0.5, 1e-3  # far below the gradient's norm: the clip acts
    whole = _mlp_backend(None, optax.sgd(lr), limit)
    parts = [_mlp_backend(k, optax.sgd(lr), limit) for k in (0, 1)]
    rng = np.random.default_rng(3)
    shapes = whole._layout.shapes
    grads = [rng.standard_normal(sh) * 10 for sh in shapes]  # the twins' sums
    whole.begin_step(4)
    assert whole._buf is not None
    whole._buf[: whole._layout.numel] = np.concatenate([g.ravel() for g in grads])
    for k, b in enumerate(parts):
        b.begin_step(4)
        rows = [g[local_rows(g.shape, s, 2, k)] for g, s in zip(grads, b._specs, strict=True)]
        b._buf[: b._layout.numel] = np.concatenate([r.ravel() for r in rows])
        b.put_norm_share(True)
    assert parts[0]._specs == [(AXIS,), (), (AXIS,), (AXIS,)]  # b1, b2 (replicated), w1, w2
    voted = sum(b._buf[b._layout.numel] for b in parts)
    for b in parts:
        b._buf[b._layout.numel] = voted
    want = whole.apply()
    got = [b.apply() for b in parts]
    assert want.grad_norm > 10 * limit
    assert all(u.grad_norm == got[0].grad_norm for u in got)  # identical on every process
    assert got[0].grad_norm == pytest.approx(want.grad_norm, rel=1e-12)
    for k, b in enumerate(parts):
        for w, p, s in zip(jax.tree_util.tree_leaves(whole.params),
                           jax.tree_util.tree_leaves(b.params), b._specs, strict=True):  # fmt: skip
            np.testing.assert_allclose(np.asarray(p), np.asarray(w)[local_rows(w.shape, s, 2, k)],
                                       rtol=0, atol=1e-7)  # fmt: skip
    # The update moved by lr * limit in norm (the clip), not by the raw gradient's.
    before = _mlp_backend(None, optax.sgd(lr)).params
    moved = np.sqrt(sum(float(np.sum((np.asarray(a) - np.asarray(c)) ** 2)) for a, c in
                        zip(jax.tree_util.tree_leaves(whole.params),
                            jax.tree_util.tree_leaves(before), strict=True)))  # fmt: skip
    assert moved == pytest.approx(lr * limit, rel=1e-3)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"workers": 3}, "not a multiple of --replica-procs 2"),
        ({"shard_size": 2}, "--shard-size"),
        ({"spares": 1}, "--spares"),
    ],
)
def test_the_launch_config_refuses_what_replicas_cannot_do(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        LaunchConfig(script=SCRIPT, **{"workers": 4, "replica_procs": 2, **kw})
    assert LaunchConfig(script=SCRIPT, workers=4, replica_procs=2).min_workers == 2


def test_the_launchers_replica_procs_reaches_the_trainer_config() -> None:
    cfg = TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=1)
    assert read_worker_env({env.REPLICA_PROCS: "2"}).apply(cfg).replica_procs == 2
    assert read_worker_env({}).apply(cfg).replica_procs == 1
    with pytest.raises(ValueError, match="replica_procs must be >= 1"):
        TrainerConfig(global_batch_size=8, micro_batch_size=4, total_steps=1, replica_procs=0)


# ---- jobs ----------------------------------------------------------------------------


def _assert_invariants(job: Job, steps: int, replicas: bool = True) -> None:
    assert job.result.status == "done", job.result.message
    starts = job.of("generation_start")
    assert starts and all(e["state_hash"] for e in starts)
    if replicas:  # twins compare among themselves
        assert all("shard" in e for e in starts)
    assert check_same_state(job.events) == []
    led = check_exactly_once(job.events, expected_ids)
    assert led.violations == [] and led.committed_steps == steps


def _finals(run_dir: Path) -> dict[str, tuple[str, np.ndarray[Any, Any]]]:
    return {
        f.stem: (f.read_text(), np.load(f.with_suffix(".npy")))
        for f in sorted((run_dir / "final").glob("*.place"))
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The failure-free 2 x 2 run's loss curve, checked against a plain JAX run's
    (one process a replica: one member trained in this process, `run_in_process`)
    over its first steps: equal to float32 rounding, the same data, keys and
    updates. Not bit for bit: a replica's 2 processes compute each micro-batch's
    gradient as one XLA program partitioned over the parameters' rows, whose
    partial sums may round otherwise than the whole model's dot (the gradient
    norm is compared the same way); on an AMD EPYC (AVX2) machine the curves
    first differ at step 2, by 2e-8 relative. What the design does promise bit for
    bit, a faulty run against the failure-free run of the same topology, the
    fault tests assert."""
    import os

    from elastrain.launch.launcher import Launcher

    from .conftest import ROOT as root
    from .conftest import run_in_process

    plain_steps = 8
    single = run_in_process(
        PLAIN, tmp_path_factory.mktemp("plain") / "run", plain_steps, ["--hidden", str(HIDDEN)]
    )
    starts = [e for e in single.events if e["kind"] == "generation_start"]
    assert starts and all(e["state_hash"] for e in starts)
    assert check_same_state(single.events) == []
    led = check_exactly_once(single.events, expected_ids)
    assert led.violations == [] and led.committed_steps == plain_steps
    cfg = LaunchConfig(
        script=SCRIPT,
        script_args=["--hidden", str(HIDDEN)],
        steps=STEPS,
        run_dir=str(tmp_path_factory.mktemp("ref")),
        progress=False,
        extra_env={"PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")},
        workers=4,
        replica_procs=2,
    )
    job = Job(la := Launcher(cfg), la.run())
    _assert_invariants(job, STEPS)
    curves, norms = [], []
    for name, events in (("plain", single.events), ("ref", job.events)):
        curves.append(loss_curve(events))
        by_step: dict[int, set[float]] = {}
        for e in (e for e in events if e["kind"] == "step_commit"):
            by_step.setdefault(e["step"], set()).add(e["grad_norm"])
        assert all(len(v) == 1 for v in by_step.values()), by_step  # the same on every process
        norms.append({s: v.pop() for s, v in by_step.items()})
        if name == "ref":
            finals = _finals(job.run_dir)
            by_shard: dict[str, list[np.ndarray[Any, Any]]] = {}
            for place, flat in finals.values():
                by_shard.setdefault(place.split()[1], []).append(flat)
            assert len(finals) == 4 and all(
                np.array_equal(v[0], v[1]) for v in by_shard.values()
            ), "twins' final parts differ"
    plain, ref = curves
    worst = max(abs(ref[s] - plain[s]) / abs(plain[s]) for s in plain)
    assert worst < 1e-6, (worst, plain, ref)
    # The global gradient norm (what max_grad_norm clips by) over a replica's parts,
    # summed with the vote, is the whole model's norm of the single-process run (to
    # the same float32 rounding of the partitioned gradients).
    plain_norm, ref_norm = norms
    assert all(ref_norm[s] == pytest.approx(n, rel=1e-6) for s, n in plain_norm.items()), (
        plain_norm,
        ref_norm,
    )
    return ref


def _rebuilt(events: list[dict[str, Any]]) -> bool:
    """Both processes of the rebuilt replica (w4, w5) have received their heal."""
    healed = {e["proc"] for e in events if e["kind"] == "heal_end" and e.get("role") == "recv"}
    return {"w4", "w5"} <= healed


def _fault_run(run_job: Any, tmp_path: Path, name: str, action: str) -> Job:
    """Held at PACE_S a step until the rebuilt replica is healed (the pace file is
    removed then), so that it joins before the end however slow its start; the
    steps after that run at full speed."""
    from elastrain.observe.events import read_events

    pace = tmp_path / f"{name}.pace"
    pace.write_text(str(PACE_S))

    def release(launcher: Any, st: dict[str, Any]) -> None:
        if pace.exists() and _rebuilt(read_events(Path(launcher.config.run_dir))):
            pace.unlink()

    job = run_job(
        steps=STEPS,
        workers=4,
        replica_procs=2,
        name=name,
        script=SCRIPT,
        script_args=["--hidden", str(HIDDEN), "--pace-file", str(pace)],
        points=[{"member": "w1", "step": 2, "phase": "compute", "action": action}],
        on_status=release,
    )
    pace.unlink(missing_ok=True)
    _assert_invariants(job, STEPS)
    spawned = {e["member"]: e for e in job.of("worker_spawned")}
    # w1 (replica 0, process 1) failed; the launcher stopped it (a hang) and its mate w0.
    exits = {e["member"]: e["returncode"] for e in job.of("worker_exited")}
    assert exits["w1"] == -9 and exits["w0"] == -9
    assert {spawned["w4"]["replaces"], spawned["w5"]["replaces"]} == {"w0", "w1"}
    return job


def _survivors_went_on(job: Job, t_fault: float, allowance_s: float) -> None:
    """The other replica kept its PIDs, committed every step, and its first commit
    after the fault came within `allowance_s` + one step (a step of the held job:
    the median step time up to the rebuilt replica's heal, while every step was
    held at PACE_S)."""
    spawned = {e["member"]: e for e in job.of("worker_spawned")}
    held_until = min(e["t"] for e in job.of("heal_end", role="recv"))
    for w in ("w2", "w3"):
        commits = [e for e in job.events if e["proc"] == w and e["kind"] == "step_commit"]
        assert {e["pid"] for e in commits} == {spawned[w]["pid"]}
        assert sorted(e["step"] for e in commits) == list(range(STEPS))
        times = sorted(e["t"] for e in commits)
        held = [t for t in times if t <= held_until]
        step_s = statistics.median(b - a for a, b in zip(held, held[1:], strict=False))
        after = min(e["t"] for e in commits if e["t"] > t_fault)
        assert after - t_fault <= allowance_s + step_s, (w, after - t_fault, step_s)


def _healed_from_twins(job: Job) -> None:
    """The rebuilt replica was healed shard by shard from its twins: one shard's bytes."""
    part = {m: flat for m, (_, flat) in _finals(job.run_dir).items()}
    for w in ("w4", "w5"):
        recv = job.of("heal_end", proc=w, role="recv")
        assert recv, f"{w} was not healed"
        shard_bytes = 3 * part[w].size * 4 + 4 + 8  # params, adam's mu and nu, count, key
        assert recv[0]["bytes"] == shard_bytes < FULL_BYTES
        assert job.of("step_commit", proc=w, step=STEPS - 1), w


def test_a_killed_process_takes_its_replica_down_and_the_other_goes_on(  # type: ignore[no-untyped-def]
    run_job, tmp_path: Path, reference: dict[int, float]
) -> None:
    job = _fault_run(run_job, tmp_path, "kill", "kill")
    _survivors_went_on(job, job.of("fault_injected", member="w1")[0]["t"], 1.0)
    _healed_from_twins(job)
    # The rebuilt replica compiled before it registered (its update included, the
    # same placement after the heal): nobody waited on it at its join.
    assert job.of("watchdog_fired") == [], job.of("watchdog_fired")
    # The math does not depend on the failure (float64 reductions: bit for bit).
    assert loss_curve(job.events) == reference


def test_a_hung_process_takes_its_replica_down_the_same_way(  # type: ignore[no-untyped-def]
    run_job, tmp_path: Path, reference: dict[int, float]
) -> None:
    """SIGSTOP of w1: the other replica's watchdog confirms the hang (3 s here),
    the coordinator expels w1, the launcher kills w1 and its mate (stuck in the
    replica's collective) and rebuilds the replica."""
    job = _fault_run(run_job, tmp_path, "hang", "hang")
    t_fault = job.of("fault_injected", member="w1")[0]["t"]
    ceiling = max(e["timeout_s"] for e in job.of("watchdog_fired"))
    _survivors_went_on(job, t_fault, ceiling + 1.0)
    _healed_from_twins(job)
    assert loss_curve(job.events) == reference


EVERY, KILL = 4, 10
"""The killed run checkpoints every EVERY steps; every process is killed at step KILL."""


def test_a_2x2_job_killed_whole_resumes_from_its_checkpoint_as_1x2(  # type: ignore[no-untyped-def]
    run_job, reference: dict[int, float]
) -> None:
    """A 2 x 2 job checkpointing every EVERY steps loses all four processes at step
    KILL (nothing replaces them): the job fails, its sharded checkpoint (2 parts,
    one replica's worth) stays. Run again on the same run directory as 1 x 2, each
    process reads its own part (bytes < the whole state), and the job goes on from
    the checkpoint's step: exactly-once, equal states, and the loss curve equal to
    the uninterrupted run's bit for bit (float64 reductions)."""
    from elastrain.checkpoint import latest_verified

    points = [{"member": f"w{i}", "step": KILL, "phase": "compute", "action": "kill"}
              for i in range(4)]  # fmt: skip
    args = ["--hidden", str(HIDDEN)]
    first = run_job(
        steps=STEPS,
        workers=4,
        replica_procs=2,
        script=SCRIPT,
        script_args=[*args, "--min-step-s", "0.3"],  # the checkpoints commit before the kill
        points=points,
        replace=False,
        checkpoint_every=EVERY,
    )
    assert first.result.status == "failed"
    newest = latest_verified(first.run_dir / "checkpoints")
    assert newest is not None and newest.kind == "dcp" and EVERY <= newest.step < KILL
    assert newest.num_shards == 2  # one writer per process index, not one per process
    resumed_to = newest.step + 6
    second = run_job(steps=resumed_to, workers=2, replica_procs=2, script=SCRIPT, script_args=args)
    assert second.result.status == "done", second.result.message
    assert second.result.resumed_from == newest.step
    t0 = max(e["t"] for e in second.events if e["kind"] == "job_start")
    ev = [e for e in second.events if e["t"] >= t0]
    loaded = [e for e in ev if e["kind"] == "checkpoint_loaded"]
    assert sorted(e["proc"] for e in loaded) == ["w0", "w1"]
    part = 3 * ((16 * HIDDEN + HIDDEN + HIDDEN) // 2 + 1) * 4 + 4 + 8  # its rows, b2, count, key
    assert all(e["step"] == newest.step and e["bytes"] == part < FULL_BYTES for e in loaded)
    assert check_same_state(ev) == []
    led = check_exactly_once(ev, expected_ids)
    assert [v for v in led.violations if not v.startswith("steps never committed")] == []
    curve = loss_curve(ev)
    assert sorted(curve) == list(range(newest.step, resumed_to))
    assert all(curve[s] == reference[s] for s in curve), (curve, reference)

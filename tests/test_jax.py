"""The JAX path (issue 9): pytree state helpers, a `JaxState` healed through the
shared striped protocol over a real gloo group, and a real elastic JAX job with a SIGKILL, compared with the
failure-free JAX run. Skipped where JAX or optax is not installed."""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed import ProcessGroupGloo  # noqa: E402

from elastrain.checkpoint import latest_verified  # noqa: E402
from elastrain.data import GlobalOrder  # noqa: E402
from elastrain.jax.state import (  # noqa: E402
    GradLayout,
    JaxState,
    named_leaves,
    rebuild,
    signature,
    state_hash,
)
from elastrain.observe.ledger import check_exactly_once, check_same_state, loss_curve  # noqa: E402
from elastrain.transfer import HealAuth, HealError, PreparedReceive, TorchState, heal  # noqa: E402
from elastrain.transfer.manifest import build_manifest, decode_manifest, encode_manifest  # noqa: E402
from elastrain.transfer.tamper import Tamper  # noqa: E402

from .conftest import ROOT, InProcessRun, Job, run_in_process  # noqa: E402

JAX_MLP = str(ROOT / "tests" / "scripts" / "train_jax_mlp.py")
B, SEED, DATASET, STEPS = 24, 7, 4096, 24
KEY = b"job-token"


def _state(seed: int, hidden: int = 8) -> dict[str, Any]:
    k = jax.random.PRNGKey(seed)
    params = {"w": jax.random.normal(k, (4, hidden)), "b": jnp.zeros(hidden, jnp.bfloat16)}
    opt = optax.adam(1e-2)
    return {"params": params, "opt_state": opt.init(params), "key": jax.random.PRNGKey(seed + 1)}


def test_state_names_hash_and_rebuild() -> None:
    a, b = _state(0), _state(1)
    sig = signature(a)
    assert sig == signature(b)
    assert ["['params']['b']", [8], "bfloat16"] in sig
    assert any(n.startswith("['opt_state']") for n, _, _ in sig)
    la, lb = named_leaves(a), named_leaves(b)
    assert state_hash(la, 3) == state_hash(named_leaves(_state(0)), 3)
    assert state_hash(la, 3) != state_hash(la, 4)
    assert state_hash(la, 3) != state_hash(lb, 3)
    back = rebuild(a, [x for _, x in lb])
    assert state_hash(named_leaves(back), 3) == state_hash(lb, 3)
    with pytest.raises(ValueError):
        rebuild(a, [np.zeros(3, np.float32)] * len(la))
    layout = GradLayout.of(a["params"])
    flat = layout.ravel(a["params"])
    assert flat.dtype == jnp.float32 and flat.shape == (layout.numel,)
    again = layout.unravel(flat)
    assert again["b"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(again["w"]), np.asarray(a["params"]["w"]))


def _run_ranks(n: int, fn: Any) -> list[Any]:
    """Run fn(pg, rank) on n threads, each with its own rank of one gloo group."""
    store = dist.HashStore()
    out: list[Any] = [None] * n

    def body(rank: int) -> None:
        pg = ProcessGroupGloo(dist.PrefixStore("heal", store), rank, n)
        try:
            out[rank] = fn(pg, rank)
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[rank] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_heal_stripes_a_jax_state_from_two_senders() -> None:
    good, behind = _state(0), _state(5)
    states = {0: JaxState(good), 1: JaxState(behind), 2: JaxState(good)}

    def fn(pg: Any, rank: int) -> Any:
        meta = {"committed": 7, "last_loss": 0.5} if rank in (0, 2) else None
        return heal(pg, rank, [0, 2], [1], states[rank], meta, 30.0, key=KEY)

    res = _run_ranks(3, fn)
    assert all(isinstance(r, tuple) for r in res), res
    meta, stats = res[1]
    assert meta == {"committed": 7, "last_loss": 0.5} and stats.role == "recv"
    healed = states[1].healed
    assert healed is not None
    assert state_hash(named_leaves(healed), 7) == state_hash(named_leaves(good), 7)
    assert state_hash(named_leaves(behind), 7) != state_hash(named_leaves(good), 7)
    assert healed["params"]["b"].dtype == jnp.bfloat16
    # Striped: each sender sent about half of the payload, the receiver got it all.
    s0, s2 = res[0][1].bytes, res[2][1].bytes
    assert s0 > 0 and s2 > 0 and abs(s0 - s2) <= 1 and s0 + s2 == stats.bytes
    assert states[0].healed is None and states[2].healed is None


def test_a_prepared_jax_receiver_expects_its_own_leaves_and_lands_where_it_laid_out() -> None:
    """A JAX state's leaves all exist from the start: the layout a receiver expects
    is the one its peers send (`PreparedReceive`), so the heal judges only the rest
    of the manifest and lands where the receiver laid out, bit-identical."""
    good, behind = _state(0), _state(5)
    states = {0: JaxState(good), 1: JaxState(behind)}
    prepared = PreparedReceive(states[1], in_place=False)
    sent = states[0].flatten()
    assert (
        states[1].expected_layout() == build_manifest("jax", sent.tensors, {}, [0], {}, 1).entries
    )

    def fn(pg: Any, rank: int) -> Any:
        return heal(
            pg, rank, [0], [1], states[rank], {"committed": 7} if rank == 0 else None, 30.0,
            key=KEY, prepared=prepared if rank == 1 else None,
        )  # fmt: skip

    res = _run_ranks(2, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert res[1][1].predicted and res[1][1].prepared
    healed = states[1].healed
    assert healed is not None
    assert state_hash(named_leaves(healed), 7) == state_hash(named_leaves(good), 7)


@pytest.mark.parametrize("auth", list(HealAuth))
def test_heal_jax_forged_stripe_is_fetched_from_the_other_sender(auth: HealAuth) -> None:
    """mac: a stripe sealed without the token is refused; digest: a stripe damaged on
    the wire makes the digest differ. Either way the other sender sends it again."""
    good, behind = _state(0), _state(5)
    states = {0: JaxState(good), 1: JaxState(good), 2: JaxState(behind)}
    bad = Tamper(forge=True) if auth == HealAuth.MAC else Tamper(flip=3)

    def fn(pg: Any, rank: int) -> Any:
        tamper = bad if rank == 0 else None
        meta = {"committed": 3} if rank < 2 else None
        return heal(
            pg, rank, [1, 0], [2], states[rank], meta, 30.0, key=KEY, tamper=tamper, auth=auth
        )

    res = _run_ranks(3, fn)
    assert all(isinstance(r, tuple) and r[1].refused == (0,) for r in res), res
    healed = states[2].healed
    assert healed is not None
    assert state_hash(named_leaves(healed), 3) == state_hash(named_leaves(good), 3)


def test_jax_state_flatten_and_bound() -> None:
    tree = {
        "a": jnp.arange(6, dtype=jnp.bfloat16).reshape(2, 3),
        "n": np.arange(4, dtype=np.uint32),
    }
    state = JaxState(tree)
    flat = state.flatten()
    assert [n for n, _ in flat.tensors] == ["['a']", "['n']"] and flat.section == {}
    a, n = flat.tensors[0][1], flat.tensors[1][1]
    assert a.dtype == torch.bfloat16 and a.float().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert n.dtype == torch.uint32 and n.shape == (4,)
    assert n.data_ptr() != tree["n"].ctypes.data  # a host array is copied, never aliased
    m = build_manifest("jax", flat.tensors, {}, [0], {}, 1)
    assert state.bound(m) is None and state.check(m) is None
    huge = decode_manifest(Tamper(manifest="huge_entry").manifest_bytes(encode_manifest(m)))
    assert "this state has 2 leaves of 28 bytes" in str(state.bound(huge))


def test_heal_refuses_a_different_layout_and_another_kind() -> None:
    good, other = _state(0), _state(0, hidden=9)

    def mismatch(pg: Any, rank: int) -> Any:
        state = JaxState(good if rank == 0 else other)
        meta = {"committed": 1, "last_loss": None} if rank == 0 else None
        return heal(pg, rank, [0], [1], state, meta, 30.0, key=KEY)

    res = _run_ranks(2, mismatch)
    assert all(isinstance(r, HealError) for r in res), res
    assert "cannot heal into this state" in str(res[1])

    # A JAX manifest sent to a torch receiver: refused by kind, before any payload.
    model = torch.nn.Linear(4, 8)
    opt = torch.optim.Adam(model.parameters())
    before = [t.clone() for t in model.state_dict().values()]

    def kinds(pg: Any, rank: int) -> Any:
        state = JaxState(good) if rank == 0 else TorchState(model, opt)
        return heal(pg, rank, [0], [1], state, {}, 30.0, key=KEY)

    res = _run_ranks(2, kinds)
    assert all(isinstance(r, HealError) for r in res), res
    assert "the senders' state is of kind 'jax', this rank's 'torch'" in str(res[1])
    assert "rank(s) [1] rejected" in str(res[0])
    after = list(model.state_dict().values())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def expected_ids(step: int) -> list[int]:
    return GlobalOrder(DATASET, SEED).ids(step * B, (step + 1) * B)


def assert_invariants(job: Job, steps: int) -> None:
    assert job.result.status == "done", job.result.message
    assert check_same_state(job.events) == []
    assert job.of("generation_start") and all(e["state_hash"] for e in job.of("generation_start"))
    led = check_exactly_once(job.events, expected_ids)
    assert led.violations == [] and led.committed_steps == steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> InProcessRun:
    """The failure-free JAX run both job tests compare with, run once: one member,
    trained in this process (`run_in_process`). Gradients are reduced in float64, so
    its curve and final parameters do not depend on how many members split the
    batch (checked: a 2- and a 3-worker job's are this run's bit for bit)."""
    ref = run_in_process(JAX_MLP, tmp_path_factory.mktemp("jax-ref") / "ref", STEPS)
    assert check_same_state(ref.events) == []
    led = check_exactly_once(ref.events, expected_ids)
    assert led.violations == [] and led.committed_steps == STEPS
    return ref


def test_jax_worker_killed_replacement_heals_and_math_matches(run_job, reference) -> None:  # type: ignore[no-untyped-def]
    ref = reference
    # --min 3: the kill pauses the job until the replacement has joined and
    # healed, so the replacement takes part in the rest of the run.
    job = run_job(
        steps=STEPS,
        workers=3,
        min_workers=3,
        replace_delay_s=0.5,
        name="jax-kill",
        script=JAX_MLP,
        points=[{"member": "w1", "step": 8, "phase": "compute", "action": "kill"}],
    )
    assert_invariants(job, STEPS)
    assert {(e["member"], e["phase"]) for e in job.of("fault_injected")} == {("w1", "compute")}
    # Survivors kept their PIDs and reached the last step.
    spawned = {e["member"]: e["pid"] for e in job.of("worker_spawned")}
    for m in ("w0", "w2"):
        pids = {e["pid"] for e in job.events if e["proc"] == m and e["kind"] == "step_commit"}
        assert pids == {spawned[m]}, (m, spawned[m], pids)
        assert job.of("step_commit", proc=m, step=STEPS - 1), m
    # The replacement was healed from its peers and trained to the end.
    assert job.of("heal_end", proc="w3", role="recv"), "w3 was not healed"
    assert job.of("step_commit", proc="w3", step=STEPS - 1)
    # The math does not depend on the failure.
    a, b = loss_curve(ref.events), loss_curve(job.events)
    assert sorted(a) == sorted(b) == list(range(STEPS))
    for s in range(STEPS):
        assert math.isclose(a[s], b[s], rel_tol=1e-5), f"step {s}: {a[s]} vs {b[s]}"
    finals = [np.load(f) for f in sorted((job.run_dir / "final").glob("*.npy"))]
    assert len(finals) == 3 and all(np.array_equal(finals[0], f) for f in finals[1:])
    np.testing.assert_allclose(np.load(ref.run_dir / "final" / "w0.npy"), finals[0], rtol=1e-5)


def test_jax_job_killed_entirely_resumes_from_its_checkpoint(run_job, reference) -> None:  # type: ignore[no-untyped-def]
    """The shared engine gives JAX durable checkpoints and whole-job resume: every
    worker killed at step 13 (checkpoints every 5 steps), the job rerun on the same
    run directory resumes from the newest checkpoint and follows the uninterrupted
    run's loss curve."""
    every, kill_at = 5, 13
    ref = reference
    # Paced (>= 0.3 s a step): a checkpoint commits in the background, and on a loaded
    # machine unpaced steps of this tiny model outran both commits before the kill.
    paced = ["--min-step-s", "0.3"]
    first = run_job(
        steps=STEPS,
        workers=2,
        name="jax-ckpt",
        script=JAX_MLP,
        script_args=paced,
        checkpoint_every=every,
        replace=False,
        points=[
            {"member": m, "step": kill_at, "phase": "compute", "action": "kill"}
            for m in ("w0", "w1")
        ],
    )
    assert first.result.status == "failed"
    # The newest checkpoint committed before the kill (a commit runs in the
    # background: under load the one of step 10 may still be pending at step 13).
    newest = latest_verified(first.run_dir / "checkpoints")
    assert newest is not None and every <= newest.step < kill_at and newest.step % every == 0
    start = newest.step
    # The rerun is not paced: nothing is killed in it, and its math does not depend
    # on how fast its steps run.
    second = run_job(
        steps=STEPS,
        workers=2,
        name="jax-ckpt",
        script=JAX_MLP,
        checkpoint_every=every,
    )
    assert second.result.status == "done", second.result.message
    assert second.result.resumed_from == start
    t0 = max(e["t"] for e in second.events if e["kind"] == "job_start")
    rerun = [e for e in second.events if e["t"] >= t0]
    loaded = [e for e in rerun if e["kind"] == "checkpoint_loaded"]
    assert len(loaded) == 2 and {e["step"] for e in loaded} == {start}
    assert check_same_state(rerun) == []
    a, b = loss_curve(ref.events), loss_curve(rerun)
    assert sorted(b) == list(range(start, STEPS)), "the rerun did not continue where it stopped"
    for s in range(start, STEPS):
        assert math.isclose(a[s], b[s], rel_tol=1e-5), f"step {s}: {a[s]} vs {b[s]}"
    finals = sorted((second.run_dir / "final").glob("*.npy"))
    np.testing.assert_allclose(
        np.load(ref.run_dir / "final" / "w0.npy"), np.load(finals[0]), rtol=1e-5
    )


def test_a_sharded_jax_job_is_refused_clearly(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sharded replica groups are FSDP2's: a JAX job asked for them, by its config or by
    `elastrain run --shard-size` (the launcher's environment), stops with a message
    saying so instead of training whole replicas under a sharded coordinator."""
    from elastrain import env
    from elastrain.jax import JaxElasticTrainer
    from elastrain.runtime.config import TrainerConfig

    params = {"w": jnp.zeros((2,))}
    where = {
        "coordinator": "127.0.0.1:1",
        "token": "t",
        "member_id": "w0",
        "run_dir": str(tmp_path),
    }
    base = {"global_batch_size": 4, "micro_batch_size": 2, "total_steps": 1}
    with pytest.raises(ValueError, match="shard_size 2: .*FSDP2.*drop --shard-size"):
        JaxElasticTrainer(
            params,
            optax.sgd(0.1),
            [],
            lambda p, b: 0.0,
            TrainerConfig(**base, shard_size=2),
            **where,
        )
    monkeypatch.setenv(env.SHARD_SIZE, "2")
    with pytest.raises(ValueError, match="shard_size 2"):
        JaxElasticTrainer(
            params, optax.sgd(0.1), [], lambda p, b: 0.0, TrainerConfig(**base), **where
        )


def test_a_jax_job_asked_for_dcp_checkpoints_is_refused_naming_the_flag(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A JAX state has no torch names for DCP keys: `--ckpt-format dcp` (the
    launcher's environment) or the config's `checkpoint_format` stops the job at
    construction, saying which flag to drop (flat, the default, is what
    `test_jax_job_killed_entirely_resumes_from_its_checkpoint` writes)."""
    from elastrain import env
    from elastrain.jax import JaxElasticTrainer
    from elastrain.runtime.config import TrainerConfig

    params = {"w": jnp.zeros((2,))}
    where = {"coordinator": "127.0.0.1:1", "token": "t", "member_id": "w0",
             "run_dir": str(tmp_path)}  # fmt: skip
    base = {"global_batch_size": 4, "micro_batch_size": 2, "total_steps": 1}
    with pytest.raises(ValueError, match="--ckpt-format dcp.*jax job.*--ckpt-format flat"):
        JaxElasticTrainer(
            params, optax.sgd(0.1), [], lambda p, b: 0.0,
            TrainerConfig(**base, checkpoint_format="dcp"), **where,
        )  # fmt: skip
    monkeypatch.setenv(env.CKPT_FORMAT, "dcp")
    with pytest.raises(ValueError, match="--ckpt-format dcp"):
        JaxElasticTrainer(
            params, optax.sgd(0.1), [], lambda p, b: 0.0, TrainerConfig(**base), **where
        )

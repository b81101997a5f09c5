"""A receiver's share of a heal laid out ahead (`PreparedReceive`, issue 42).

The receiver predicts the layout its peers will send (`NamedState.expected_layout`),
lays its landing out for it before the heal, and at the heal compares the
manifest's entries with it as bytes: the same entries are judged no further
(only the rest of the manifest is), other entries are judged whole as without
a preparation. What a user depends on: the prediction is what a stepped peer
really sends (else every heal takes the slow path), the heal is bit-identical
either way, and nothing a lying root could do through the rest of the
manifest gets past a prepared receiver.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from torch.distributed import TCPStore

import elastrain.transfer.landing as landing
import elastrain.transfer.striped as striped
from elastrain.transfer import LandingReserve, PreparedReceive, TorchState, heal, state_hash
from elastrain.transfer.flatten import flatten_state
from elastrain.transfer.landing import section_bytes
from elastrain.transfer.manifest import (
    Expected,
    build_manifest,
    decode_expected,
    decode_manifest,
    encode_manifest,
)
from elastrain.transfer.striped import Role, Verdict
from elastrain.transfer.tamper import LIES, Tamper
from tests.test_transfer import KEY, Net, fresh, run_threads, train_step, trained


def _stepped(opt_fn: Any, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model[1].to(torch.bfloat16)
    opt = opt_fn(model)
    return model, opt


OPTIMIZERS = {
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw-amsgrad": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, amsgrad=True),
    "sgd-momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "two-groups": lambda m: torch.optim.Adam(
        [{"params": m[0].parameters()}, {"params": m[1].parameters(), "amsgrad": True}], lr=1e-3
    ),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_fresh_receiver_expects_exactly_what_a_stepped_peer_sends(name: str) -> None:
    """The prediction for an optimizer that has not stepped is the layout of one that
    has (names, order, dtypes, shapes): torch's own first step is the reference, so
    a torch that changes it fails here instead of slowing every heal."""
    sender_model, sender_opt = _stepped(OPTIMIZERS[name], 0)
    for p in sender_model.parameters():
        p.grad = torch.ones_like(p)
    sender_opt.step()
    flat = flatten_state(sender_model, sender_opt)
    sent = build_manifest("torch", flat.tensors, flat.section, [0], {}, 1).entries
    receiver = TorchState(*_stepped(OPTIMIZERS[name], 1))
    assert receiver.expected_layout() == sent
    assert receiver.optimizer.state == {}  # predicting built nothing


def test_a_receiver_that_holds_optimizer_state_expects_its_own_layout() -> None:
    held = TorchState(*trained())
    flat = held.flatten()
    assert held.expected_layout() == build_manifest("torch", flat.tensors, {}, [0], {}, 1).entries


def test_an_optimizer_whose_first_step_is_not_known_expects_nothing_until_it_stepped() -> None:
    model = Net()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    assert TorchState(model, opt).expected_layout() is None
    train_step(model, opt, 0)
    flat = flatten_state(model, opt)
    want = build_manifest("torch", flat.tensors, {}, [0], {}, 1).entries
    assert TorchState(model, opt).expected_layout() == want


def _sender_bytes() -> bytes:
    model, opt = trained()
    flat = flatten_state(model, opt)
    m = build_manifest("torch", flat.tensors, flat.section, [0], {"step": 3}, heal_id=7)
    return encode_manifest(m)


def _verdict(data: bytes, state: TorchState, expected: Expected) -> Verdict:
    m = decode_expected(data, expected)
    assert m is not None and m.entries is expected.entries
    code, _ = striped._local_problem(m, Role.RECV, [0], None, state, m.auth, None, expected)
    return code


def test_the_rest_of_a_manifest_with_the_expected_entries_is_still_judged() -> None:
    """Its entries compared as bytes, a manifest is judged on the rest: its total,
    stripes and section lies are refused as malformed (the root is to blame), a
    section of another optimizer as a divergence."""
    joiner = TorchState(*fresh())
    expected = PreparedReceive(joiner).expected
    assert expected is not None
    data = _sender_bytes()
    assert _verdict(data, joiner, expected) == Verdict.OK
    doc = json.loads(data)

    def lying(change: Any) -> bytes:
        d = json.loads(data)
        change(d)
        return json.dumps(d, separators=(",", ":")).encode()

    lies = {
        "total": lambda d: d.update(total_bytes=d["total_bytes"] + 8),
        "stripes": lambda d: d["stripes"][0].update(nbytes=d["stripes"][0]["nbytes"] - 1),
        "section": lambda d: d["section"].update(lie={"$tensor": "optim/0/nothing"}),
    }
    for what, change in lies.items():
        assert _verdict(lying(change), joiner, expected) == Verdict.MALFORMED, what
    other = lying(lambda d: d["section"].update({"class": "torch.optim.sgd.SGD"}))
    assert _verdict(other, joiner, expected) == Verdict.REJECTED
    assert doc["entries"]  # the lies above kept the entries' bytes


def test_a_manifest_naming_its_entries_twice_is_decoded_whole() -> None:
    """JSON keeps the last of two keys: a manifest whose first entries are the
    expected ones but which names others after is not taken for the expected one."""
    joiner = TorchState(*fresh())
    expected = PreparedReceive(joiner).expected
    assert expected is not None
    data = _sender_bytes()
    twice = data[:-1] + b',"entries":[]}'
    assert decode_expected(twice, expected) is None
    assert decode_manifest(twice).entries == ()
    assert decode_expected(data.replace(b'"entries":[', b'"entries": [', 1), expected) is None


def _prepared_receiver(state: TorchState, reserve: bool) -> PreparedReceive:
    held = LandingReserve(section_bytes(state.landing_estimate())) if reserve else None
    return PreparedReceive(state, held)


@pytest.mark.parametrize("reserve", [False, True])
def test_heal_threads_a_prepared_receiver_lands_where_it_laid_out(
    master_store: TCPStore, monkeypatch: pytest.MonkeyPatch, reserve: bool
) -> None:
    """A receiver that prepared (what the replicated topology does at a generation's
    connect) decodes no entry, allocates no landing, finds no live target and plans
    no message at the heal, lands its model in its live tensors, and ends
    bit-identical."""
    states = [trained(), fresh()]
    want = state_hash(*states[0])
    receiver = TorchState(*states[1])
    prepared = _prepared_receiver(receiver, reserve)
    assert prepared.landing is not None and prepared.landing.in_place
    assert list(prepared.landing.planned) == [(0, prepared.expected.total_bytes)]
    params = [p.data_ptr() for p in states[1][0].parameters()]
    at_heal: list[str] = []
    for name in ("decode_manifest", "validate_manifest"):
        real = getattr(striped, name)
        monkeypatch.setattr(
            striped, name, lambda *a, _r=real, _n=name, **k: (at_heal.append(_n), _r(*a, **k))[1]
        )
    real_allocate = landing.Landing.allocate.__func__  # type: ignore[attr-defined]

    def allocate(cls: Any, *a: Any, **k: Any) -> Any:
        at_heal.append("allocate")
        return real_allocate(cls, *a, **k)

    monkeypatch.setattr(landing.Landing, "allocate", classmethod(allocate))
    real_live = TorchState.live_targets
    monkeypatch.setattr(
        TorchState, "live_targets", lambda s, m: (at_heal.append("live"), real_live(s, m))[1]
    )

    def fn(rank: int, pg: Any) -> Any:
        state = TorchState(*states[0]) if rank == 0 else receiver
        return heal(
            pg, rank, [0], [1], state, {"step": 3}, 10.0, key=KEY, in_place=True,
            prepared=prepared if rank == 1 else None,
        )  # fmt: skip

    res = run_threads(master_store, 2, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert state_hash(*states[1]) == want
    assert at_heal == []
    assert prepared.landing.planned == {}  # its planned receives were the ones posted
    assert [p.data_ptr() for p in states[1][0].parameters()] == params  # landed in place
    st = res[1][1]
    assert st.predicted and st.prepared and not res[0][1].predicted
    assert res[1][0] == {"step": 3}


def test_heal_threads_a_receiver_that_expected_another_layout_is_healed_whole(
    master_store: TCPStore,
) -> None:
    """A prediction that is wrong costs speed only: a sender whose last layer never
    stepped has no optimizer state for it, the receiver expected some, and it judges
    the manifest whole and heals bit-identical."""
    model, opt = trained()
    sender = (model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for p in model.parameters():
        p.grad = torch.ones_like(p) if p in set(model.fc1.parameters()) else None
    sender[1].step()  # the other params have no state
    want = state_hash(*sender)
    states = [sender, fresh()]
    receiver = TorchState(*states[1])
    prepared = PreparedReceive(receiver)

    def fn(rank: int, pg: Any) -> Any:
        state = TorchState(*states[0]) if rank == 0 else receiver
        return heal(
            pg, rank, [0], [1], state, {}, 10.0, key=KEY, in_place=True,
            prepared=prepared if rank == 1 else None,
        )  # fmt: skip

    res = run_threads(master_store, 2, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert not res[1][1].predicted and res[1][1].prepared
    assert state_hash(*states[1]) == want


@pytest.mark.parametrize("lie", LIES)
def test_heal_threads_a_prepared_receiver_refuses_every_lying_root(
    master_store: TCPStore, lie: str
) -> None:
    """Every lie of `Tamper` (the section's among them, which leaves the entries'
    bytes as the root wrote them) is refused by a prepared receiver too: the next
    sender becomes the root and the receiver ends bit-identical."""
    states = [trained(), trained(), fresh()]
    want = state_hash(*states[1])
    receiver = TorchState(*states[2])
    prepared = PreparedReceive(receiver)

    def fn(rank: int, pg: Any) -> Any:
        tamper = Tamper(manifest=lie, seed=2) if rank == 0 else None
        state = receiver if rank == 2 else TorchState(*states[rank])
        return heal(
            pg, rank, [0, 1], [2], state, {"root": rank}, 10.0, key=KEY, tamper=tamper,
            in_place=True, prepared=prepared if rank == 2 else None,
        )  # fmt: skip

    res = run_threads(master_store, 3, fn)
    assert all(isinstance(r, tuple) for r in res), res
    assert all(r[1].refused == (0,) for r in res)
    assert res[2][0] == {"root": 1}
    assert state_hash(*states[2]) == want

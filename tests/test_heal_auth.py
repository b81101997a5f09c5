"""The heal's integrity mode (`heal_auth`): chosen once, from the config or the
launcher's flag, and honoured by the heal every topology calls (`heal_with`)."""

from __future__ import annotations

import datetime
import itertools
import json
import threading
from typing import Any

import pytest
import torch
from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

from elastrain import env
from elastrain.launch.config import HEAL_AUTHS
from elastrain.runtime.config import TrainerConfig, read_worker_env
from elastrain.transfer import HealAuth, HealError, TorchState, heal_with, state_hash
from elastrain.transfer.manifest import build_manifest, decode_manifest, encode_manifest

KEY = b"job-token"
_GROUPS = itertools.count(1)


def test_the_launchers_spelling_of_the_modes_is_the_enums() -> None:
    assert tuple(a.value for a in HealAuth) == HEAL_AUTHS


def test_config_defaults_to_digest_and_refuses_other_modes() -> None:
    assert TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=1).heal_auth == (
        HealAuth.DIGEST
    )
    with pytest.raises(ValueError, match="heal_auth must be one of 'digest', 'mac'"):
        TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=1, heal_auth="none")


def test_the_launchers_override_reaches_the_config() -> None:
    base = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=1)
    we = read_worker_env({env.HEAL_AUTH: "mac"})
    assert we.heal_auth == "mac"
    assert we.apply(base).heal_auth == HealAuth.MAC
    assert read_worker_env({}).apply(base).heal_auth == HealAuth.DIGEST


def test_the_manifest_carries_the_mode() -> None:
    t = [("model/w", torch.arange(6, dtype=torch.float32))]
    m = build_manifest("torch", t, {}, [0], {}, 3, auth=HealAuth.MAC)
    assert decode_manifest(encode_manifest(m)) == m
    m = build_manifest("torch", t, {}, [0], {}, 3)
    got = decode_manifest(encode_manifest(m))
    assert got == m and got.auth == HealAuth.DIGEST
    bad = encode_manifest(m).replace(b'"auth":"digest"', b'"auth":"none"')
    with pytest.raises(HealError, match="auth is 'none'"):
        decode_manifest(bad)


def _states() -> list[tuple[torch.nn.Module, torch.optim.Optimizer]]:
    out = []
    for seed in (0, 5):
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 16)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        if seed:
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-2.0)
        out.append((model, opt))
    return out


def _run(store: TCPStore, modes: tuple[HealAuth, HealAuth]) -> tuple[list[Any], list[Any]]:
    states = _states()
    results: list[Any] = [None, None]
    prefix = f"auth{next(_GROUPS)}"

    def body(rank: int) -> None:
        client = TCPStore("127.0.0.1", store.port, is_master=False)
        pg = ProcessGroupGloo(PrefixStore(prefix, client), rank, 2, datetime.timedelta(seconds=20))
        fn = heal_with(modes[rank])
        try:
            results[rank] = fn(
                pg, rank, [0], [1], TorchState(*states[rank]), {"s": 1}, 10.0, key=KEY
            )
        except HealError as e:
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    return results, states


@pytest.mark.parametrize("auth", list(HealAuth))
def test_heal_with_heals_in_its_mode(master_store: TCPStore, auth: HealAuth) -> None:
    res, states = _run(master_store, (auth, auth))
    assert all(isinstance(r, tuple) for r in res), res
    assert state_hash(*states[1]) == state_hash(*states[0])


def test_heal_with_a_member_in_another_mode_is_refused(master_store: TCPStore) -> None:
    res, states = _run(master_store, (HealAuth.DIGEST, HealAuth.MAC))
    assert all(isinstance(r, HealError) for r in res), res
    assert "heal_auth='mac'" in str(res[1])
    assert state_hash(*states[1]) != state_hash(*states[0])


class _Empty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(0))


@pytest.mark.parametrize("auth", list(HealAuth))
def test_a_heal_with_no_payload_bytes_still_installs_the_checked_section(
    master_store: TCPStore, auth: HealAuth
) -> None:
    """Every tensor empty: no stripe moves, yet the section (here the lr) arrives,
    in digest mode checked against the root's sealed digest of layout and section."""
    states = [(m, torch.optim.SGD(m.parameters(), lr=lr)) for m, lr in ((_Empty(), 0.1),
              (_Empty(), 0.5))]  # fmt: skip
    results: list[Any] = [None, None]
    prefix = f"empty{next(_GROUPS)}"

    def body(rank: int) -> None:
        client = TCPStore("127.0.0.1", master_store.port, is_master=False)
        pg = ProcessGroupGloo(PrefixStore(prefix, client), rank, 2, datetime.timedelta(seconds=20))
        try:
            results[rank] = heal_with(auth)(
                pg, rank, [0], [1], TorchState(*states[rank]), {}, 10.0, key=KEY
            )
        except HealError as e:
            results[rank] = e

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert all(isinstance(r, tuple) for r in results), results
    assert results[1][1].bytes == 0
    assert states[1][1].param_groups[0]["lr"] == 0.1


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("name", 7, r"entries\[0\]\.name is not a string"),
        ("dtype", None, "dtype is not a string"),
        ("shape", [2, True], "shape is True, expected an integer"),
        ("shape", [2, -3], "shape is negative"),
        ("shape", "6", "shape is not a JSON array"),
        ("offset", 0.0, "offset is 0.0, expected an integer"),
        ("nbytes", False, "nbytes is False, expected an integer"),
        ("nbytes", None, "nbytes is None, expected an integer"),
    ],
)
def test_a_malformed_entry_is_refused_by_name(field: str, value: object, match: str) -> None:
    """The decoder's one-test path for well-formed entries lets nothing through that
    the field-by-field checks refuse (a bool is not an integer), and the refusal
    still names the field."""
    t = [("model/w", torch.arange(6, dtype=torch.float32))]
    raw = json.loads(encode_manifest(build_manifest("torch", t, {}, [0], {}, 3)))
    raw["entries"][0][field] = value
    with pytest.raises(HealError, match=match):
        decode_manifest(json.dumps(raw).encode())
    del raw["entries"][0][field]
    with pytest.raises(HealError, match=f"missing field '{field}'"):
        decode_manifest(json.dumps(raw).encode())

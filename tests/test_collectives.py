"""The transport choice (gloo or NCCL per generation), the NCCL version gate, and
the graveyard's abort of a dropped NCCL group: the parts a CPU can check
(`elastrain.runtime.collectives`; the NCCL calls run in benchmarks/gpu_check.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from elastrain.runtime.collectives import (
    NCCL_MIN,
    Transport,
    choose_transport,
    parse_nccl_version,
    settle_error_handling,
)
from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.group import Graveyard


@pytest.mark.parametrize(
    ("setting", "device", "sharded", "version", "transport", "why"),
    [
        ("auto", "cuda", False, (2, 21, 5), Transport.NCCL, "NCCL 2.21.5 on CUDA"),
        ("nccl", "cuda", False, NCCL_MIN, Transport.NCCL, "NCCL 2.14.3 on CUDA"),
        ("auto", "cpu", False, None, Transport.GLOO, "the model is on a cpu device"),
        ("auto", "cuda", True, (2, 21, 5), Transport.GLOO, "sharded model's FSDP2"),
        ("auto", "cuda", False, None, Transport.GLOO, "built without NCCL"),
        ("auto", "cuda", False, (2, 14, 2), Transport.GLOO, "NCCL 2.14.2 is older than 2.14.3"),
        ("gloo", "cuda", False, (2, 21, 5), Transport.GLOO, "collectives='gloo'"),
    ],
)
def test_the_transport_follows_the_device_the_layout_and_the_nccl_version(
    setting: str,
    device: str,
    sharded: bool,
    version: tuple[int, int, int] | None,
    transport: Transport,
    why: str,
) -> None:
    choice = choose_transport(setting, device, sharded=sharded, nccl_version=version)
    assert choice.transport is transport and why in choice.why


@pytest.mark.parametrize(
    ("device", "sharded", "version", "needle"),
    [
        ("cpu", False, None, "the model is on a cpu device; NCCL needs CUDA"),
        ("cuda", True, (2, 21, 5), "shard_size > 1"),
        ("cuda", False, None, "this torch was built without NCCL"),
        ("cuda", False, (2, 12, 12), "NCCL 2.12.12 is older than 2.14.3"),
    ],
)
def test_collectives_nccl_names_what_is_missing_instead_of_falling_back(
    device: str, sharded: bool, version: tuple[int, int, int] | None, needle: str
) -> None:
    with pytest.raises(ValueError, match="collectives='nccl' is not possible here") as e:
        choose_transport("nccl", device, sharded=sharded, nccl_version=version)
    assert needle in str(e.value) and "or use 'gloo'" in str(e.value)


def test_an_unknown_collectives_setting_is_refused_by_the_config_and_the_choice() -> None:
    with pytest.raises(ValueError, match="collectives must be 'auto'"):
        TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=1, collectives="mpi")
    with pytest.raises(ValueError, match="got 'mpi'"):
        choose_transport("mpi", "cuda", sharded=False, nccl_version=(2, 21, 5))


@pytest.mark.parametrize(
    ("raw", "version"),
    [
        ((2, 21, 5), (2, 21, 5)),
        ((2, 27, 3, "+cuda12.8"), (2, 27, 3)),
        (21805, (2, 18, 5)),
        (2708, (2, 7, 8)),
    ],
)
def test_nccl_versions_are_read_in_every_form_torch_reports(
    raw: Any, version: tuple[int, int, int]
) -> None:
    assert parse_nccl_version(raw) == version


class _Group:
    """A dropped group whose pending work ends only when the group is aborted (an
    NCCL kernel waiting for a dead peer)."""

    def __init__(self, fail_abort: bool = False) -> None:
        self.aborted = threading.Event()
        self.fail_abort = fail_abort
        self.order: list[str] = []

    def abort(self) -> None:
        self.order.append("abort")
        self.aborted.set()
        if self.fail_abort:
            raise RuntimeError("NCCL communicator already aborted")


class _Pending:
    def __init__(self, g: _Group) -> None:
        self.g = g

    def wait(self) -> None:
        if not self.g.aborted.wait(5.0):
            raise AssertionError("the work was waited for before the group was aborted")
        self.g.order.append("work ended")


@pytest.mark.parametrize("fail_abort", [False, True])
def test_a_dropped_nccl_group_is_aborted_off_the_callers_thread_then_its_work_ends(
    fail_abort: bool,
) -> None:
    yard, g = Graveyard(), _Group(fail_abort)
    yard.bury(g, [_Pending(g)], abort=True)
    for reaper in yard.blocked():
        reaper.join(5.0)
    assert g.order == ["abort", "work ended"] and len(yard) == 0


def test_a_gloo_group_is_parked_not_aborted() -> None:
    yard, g = Graveyard(), _Group()
    release = threading.Event()

    class Work:
        def wait(self) -> None:
            release.wait(5.0)

    yard.bury(g, [Work()])
    assert len(yard) == 1  # parked while its work is pending
    release.set()
    for t in yard.blocked():
        t.join(5.0)
    assert not g.aborted.is_set() and len(yard) == 0


def test_nccl_errors_abort_the_communicator_not_the_process_unless_the_user_chose_so() -> None:
    environ: dict[str, str] = {}
    assert settle_error_handling(environ) is None
    assert environ == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert settle_error_handling({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) is None
    chosen = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}
    warning = settle_error_handling(chosen)
    assert chosen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's choice is kept
    assert warning is not None and "will end this process too" in warning

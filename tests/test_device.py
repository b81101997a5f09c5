"""Devices (issue 22, the parts a CPU can check): which device a member trains on,
where its gradient buffers live, which reduction dtype that implies, and which
errors mean its device can no longer be trusted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from elastrain.runtime.config import TrainerConfig
from elastrain.runtime.device import check_device, is_poisoned, model_device, resolve_reduce_dtype
from elastrain.runtime.torch_backend import TorchBackend


def test_the_device_is_the_parameters_one_and_a_split_model_is_refused() -> None:
    assert model_device(nn.Linear(2, 2).parameters()) == torch.device("cpu")
    assert model_device([]) == torch.device("cpu")
    with torch.device("meta"):
        meta = nn.Linear(2, 2)
    assert model_device(meta.parameters()) == torch.device("meta")
    split = [nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta"))]
    with pytest.raises(ValueError, match=r"several devices \(cpu for parameter #0, meta for #1\)"):
        model_device(split)


@pytest.mark.parametrize(
    ("setting", "device", "want"),
    [
        ("auto", "cpu", "float64"),
        ("auto", "cuda", "native"),
        ("auto", "gpu", "native"),  # JAX's platform name
        ("auto", "tpu", "native"),
        ("float64", "cuda", "float64"),
        ("native", "cpu", "native"),
    ],
)
def test_auto_reduces_exactly_on_the_cpu_and_natively_on_accelerators(
    setting: str, device: str, want: str
) -> None:
    assert resolve_reduce_dtype(setting, device) == want


def test_reduce_dtype_is_checked_and_auto_is_the_default() -> None:
    assert (
        TrainerConfig(global_batch_size=4, micro_batch_size=1, total_steps=1).reduce_dtype == "auto"
    )
    with pytest.raises(ValueError, match="reduce_dtype must be 'auto'"):
        TrainerConfig(
            global_batch_size=4, micro_batch_size=1, total_steps=1, reduce_dtype="float16"
        )
    with pytest.raises(ValueError, match="reduce_dtype must be one of"):
        resolve_reduce_dtype("float16", "cpu")


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).sum()


@pytest.mark.parametrize("reduce_dtype", ["auto", "native"])
def test_gradient_and_reduction_buffers_live_on_the_parameters_device(reduce_dtype: str) -> None:
    """Built on the meta device (a stand-in for an accelerator on a CPU-only machine):
    every buffer the step reduces, the gradient views and the scratch follow the
    parameters; on the CPU "auto" is the exact float64 sum."""
    cfg = TrainerConfig(
        global_batch_size=4, micro_batch_size=1, total_steps=1, reduce_dtype=reduce_dtype
    )
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, cfg)
    backend.begin_step(3)
    assert backend.device == torch.device("meta")
    bufs = backend.reduce_buffers() + list(backend._flats) + [backend.work(16)]
    assert bufs and all(b.device.type == "meta" for b in bufs)
    assert all(p.grad is None or p.grad.device.type == "meta" for p in model.parameters())
    assert backend.extras().device.type == "meta" and backend.extras().numel() == 3
    # "auto" on a non-CPU device type reduces natively (meta counts as the CPU here:
    # it is where a CPU job builds its model before filling it).
    assert backend.native == (reduce_dtype == "native")
    lin = nn.Linear(2, 2)
    cpu = TorchBackend(lin, torch.optim.SGD(lin.parameters(), lr=0.1), _loss, cfg)
    cpu.begin_step(3)
    assert cpu.reduce_buffers()[0].device.type == "cpu"
    assert cpu.reduce_buffers()[0].dtype == (torch.float32 if cpu.native else torch.float64)


def test_a_micro_batch_leaves_its_loss_on_the_device_for_the_step_to_read_once() -> None:
    """`compute` returns the loss sum as a float64 device scalar, not a float: reading a
    CUDA loss to the host after each micro-batch would wait for the device before the
    next one's kernels are queued. The meta device has no values to read, so a compute
    that read one would fail here; on the CPU the float64 sum equals Python's."""
    cfg = TrainerConfig(global_batch_size=4, micro_batch_size=2, total_steps=1)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    backend = TorchBackend(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, cfg)
    backend.begin_step(3)
    got = backend.compute(0, 0, torch.ones(2, 4, device="meta"), 2)
    assert got.device.type == "meta" and got.dtype == torch.float64 and got.dim() == 0
    torch.manual_seed(0)
    lin = nn.Linear(4, 1)
    cpu = TorchBackend(lin, torch.optim.SGD(lin.parameters(), lr=0.1), _loss, cfg)
    cpu.begin_step(3)
    batch = torch.randn(2, 4)
    total = cpu.compute(0, 0, batch, 2) + cpu.compute(0, 1, batch * 3, 2)
    with torch.no_grad():
        want = 0.0 + float(_loss(lin, batch)) * 2 + float(_loss(lin, batch * 3)) * 2
    assert float(total) == want


def test_the_demo_gpt_builds_its_positions_and_mask_where_its_input_is() -> None:
    """The demo model on an accelerator: positions and the causal mask are made on
    the input's device (meta stands in for CUDA; both were made on the CPU before,
    which failed the first GPU run)."""
    from elastrain.demo.gpt import GPT

    model = GPT(d=32, layers=1, heads=2).to("meta")
    out = model(torch.zeros(2, 8, dtype=torch.long, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 8, 256)


def test_sticky_device_errors_are_poison_and_a_dead_peer_is_not() -> None:
    illegal = torch.AcceleratorError("CUDA error: an illegal memory access was encountered")
    assert is_poisoned(illegal)
    assert is_poisoned(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_poisoned(RuntimeError("NCCL error in: ...: unhandled cuda error, NCCL version 2.27"))
    # What a step's own code raises from it, with the device error as its cause.
    try:
        try:
            raise RuntimeError("CUDA error: unspecified launch failure")
        except RuntimeError as e:
            raise ValueError("loss is not a number") from e
    except ValueError as wrapped:
        assert is_poisoned(wrapped)
    for healthy in (
        RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1"),
        RuntimeError("Timed out waiting 3000ms for send operation to complete"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        ValueError("shapes do not match"),
    ):
        assert not is_poisoned(healthy), healthy


def test_the_health_check_passes_the_cpu_and_names_a_device_that_does_not_answer() -> None:
    assert check_device(torch.device("cpu")) is None
    assert check_device(torch.device("meta")) is None
    if not torch.cuda.is_available():
        why = check_device(torch.device("cuda", 0))
        assert why is not None and why.startswith("cuda:0: ")


# ---- placement on a node's devices (elastrain run/agent --devices) ----------------------


def test_devices_parse_and_a_bad_list_is_a_clear_error() -> None:
    from elastrain.launch.devices import parse_devices

    assert parse_devices("0,1,2,3") == ("0", "1", "2", "3")
    assert parse_devices("GPU-8a1f,GPU-77c0") == ("GPU-8a1f", "GPU-77c0")
    assert parse_devices("auto") == "auto"
    for bad, needle in (("", "comma-separated"), ("0,,1", "comma-separated"),
                        ("0, 1 2", "comma-separated"), ("0,1,0", "lists 0 more than once")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            parse_devices(bad)


def test_a_replacement_keeps_its_predecessors_device_unless_that_device_failed() -> None:
    from elastrain.launch.devices import DevicePool

    pool = DevicePool(("0", "1", "2"))
    assert [pool.take(m) for m in ("w0", "w1")] == ["0", "1"]
    assert pool.env("w1") == {
        "CUDA_VISIBLE_DEVICES": "1",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "3",
    }
    pool.release("w0", poisoned=False)  # killed: its GPU is not suspect
    assert pool.take("w3", replaces="w0") == "0"
    pool.release("w1", poisoned=True)  # a sticky device error: never again
    assert pool.take("w4", replaces="w1") == "2" and pool.failed == {"1"}
    pool.release("w4", poisoned=True)
    assert pool.take("w5", replaces="w4") is None  # "0" is busy, "1" and "2" failed
    assert pool.held == {"w3": "0"}


def test_fewer_devices_than_workers_is_refused() -> None:
    from elastrain.launch.config import LaunchConfig

    with pytest.raises(ValueError, match=r"lists 2 device\(s\) for -n 2 \+ --spares 1 workers"):
        LaunchConfig(script="train.py", workers=2, spares=1, devices=("0", "1"))


def test_auto_finds_the_nodes_gpus_and_places_one_per_worker_only_when_there_are_enough(
    tmp_path: Path,
) -> None:
    from elastrain.launch.devices import auto_devices, detect_devices

    gpus = tmp_path / "gpus"
    for bus in ("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0"):
        (gpus / bus).mkdir(parents=True)
    assert detect_devices({}, gpus) == ("0", "1", "2")  # the driver's list
    # A scheduler's choice wins: Slurm or a device plugin set CUDA_VISIBLE_DEVICES.
    assert detect_devices({"CUDA_VISIBLE_DEVICES": "4, 6"}, gpus) == ("4", "6")
    assert detect_devices({"CUDA_VISIBLE_DEVICES": ""}, gpus) == ()
    assert detect_devices({}, tmp_path / "absent") == ()  # no NVIDIA driver: a CPU node
    assert auto_devices(("0", "1", "2"), 2) == (("0", "1", "2"), "")
    assert auto_devices((), 4) == (None, "")
    devices, note = auto_devices(("0",), 4)  # 4 workers sharing one GPU
    assert devices is None and "found 1 GPU(s) (0) for 4 workers: not placing" in note


def test_the_cli_resolves_auto_on_this_node_and_keeps_an_explicit_list(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastrain import cli
    from elastrain.launch import devices

    ap = cli.build_parser()[1]["run"]
    monkeypatch.setattr(devices, "detect_devices", lambda: ("0", "1"))
    assert cli._devices(ap.parse_args(["-n", "2", "train.py"])) == ("0", "1")
    assert cli._devices(ap.parse_args(["-n", "3", "train.py"])) is None
    assert "found 2 GPU(s) (0,1) for 3 workers" in capsys.readouterr().err
    explicit = ap.parse_args(["-n", "3", "--devices", "5,6,7", "train.py"])
    assert cli._devices(explicit) == ("5", "6", "7")


_LEAVES = """
import atexit, logging, logging.handlers, sys
from pathlib import Path
from elastrain.exitcodes import WorkerExit

out = Path(sys.argv[1])
# Records held in memory until the handler is flushed (at logging.shutdown at the latest).
held_log = logging.handlers.MemoryHandler(100, target=logging.FileHandler(out / "log"))
logging.getLogger().addHandler(held_log)
logging.getLogger().setLevel(logging.INFO)
logging.warning("written before the exit")

class Held:  # stands in for a CUDA tensor: freeing one after a sticky error aborts
    def __del__(self):
        (out / "freed").write_text("x")

held = Held()
atexit.register(lambda: (out / "atexit").write_text("x"))
raise WorkerExit(74, "device_poisoned", "elastrain: w1's device failed", immediate=sys.argv[2] == "1")
"""


@pytest.mark.parametrize("immediate", [True, False])
def test_a_poisoned_worker_ends_before_anything_is_freed(tmp_path: Path, immediate: bool) -> None:
    """After a sticky CUDA error, freeing a CUDA tensor makes torch abort the process
    (seen on an H200: exit 74 became SIGABRT), so the entry point ends a poisoned
    worker with `os._exit`: exit 74, its message printed and its log records written,
    and no destructor or atexit hook run. The orderly exit (immediate=False) runs
    both, which shows the test sees them."""
    import subprocess
    import sys

    script = tmp_path / "leaves.py"
    script.write_text(_LEAVES)
    got = subprocess.run(
        [sys.executable, "-m", "elastrain.worker", str(script), str(tmp_path), str(int(immediate))],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert got.returncode == 74, got.stderr
    assert "w1's device failed" in got.stderr
    ran = {p.name for p in tmp_path.iterdir()} - {"leaves.py", "log"}
    assert ran == (set() if immediate else {"freed", "atexit"})
    assert "written before the exit" in (tmp_path / "log").read_text()  # log records kept

"""Energy and efficiency: FLOP counting, the power meters, and the figures built
from `flops_measured` / `power_sample` events (hand-built, like test_observe)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from elastrain.observe.efficiency import (
    FAILURE_BUCKETS,
    efficiency,
    energy_by_bucket,
    energy_intervals,
    table_peak,
)
from elastrain.observe.flops import measure_step_flops, tokens_per_sample
from elastrain.observe.goodput import BUCKETS, goodput
from elastrain.observe.power import (
    ESTIMATE_PREFIX,
    EstimateMeter,
    NvmlMeter,
    RaplMeter,
    Sampler,
    choose_meters,
)
from elastrain.observe.worker import metering_interval

# ---- FLOPs ----------------------------------------------------------------------------


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def test_flop_count_of_an_mlp_matches_the_analytic_count() -> None:
    """Linear(i, o) on b rows: forward 2bio; backward 2bio for the weight grad and
    2bio for the input grad (not needed by the first layer, whose input is data)."""
    dims = [64, 512, 256, 10]
    layers: list[nn.Module] = []
    for i, o in zip(dims, dims[1:], strict=False):
        layers += [nn.Linear(i, o), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    mb, gb = 16, 128
    batch = (torch.randn(mb, dims[0]), torch.randn(mb, dims[-1]))
    fc = measure_step_flops(model, mse, batch, mb, gb)
    io = [i * o for i, o in zip(dims, dims[1:], strict=False)]
    analytic_mb = 6 * mb * sum(io) - 2 * mb * io[0]
    assert fc.flops_per_microbatch == pytest.approx(analytic_mb, rel=0.05)
    assert fc.flops_per_step == fc.flops_per_microbatch * (gb // mb)
    assert fc.flops_per_sample == pytest.approx(fc.flops_per_step / gb)
    assert fc.tokens_per_sample is None


def test_flop_count_of_a_transformer_block_matches_6nd() -> None:
    """A GPT-style stack: FLOPs ~ 6 x parameters-in-matmuls x tokens (+ attention)."""
    d, t, b, layers, vocab = 64, 32, 4, 2, 97
    emb = nn.Embedding(vocab, d)
    block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True)
    stack = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
    head = nn.Linear(d, vocab)

    class Gpt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.stack, self.head = emb, stack, head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.stack(self.emb(x)))

    model = Gpt()

    def ce(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(m(x).reshape(-1, vocab), y.reshape(-1))

    x = torch.randint(0, vocab, (b, t))
    fc = measure_step_flops(model, ce, (x, x), b, b)
    tokens = b * t
    matmul_params = layers * (4 * d * d + 2 * d * 4 * d) + d * vocab
    attention = layers * 2 * 2 * t * t * d * b  # QK^T and AV, forward
    analytic = 6 * matmul_params * tokens + 3 * attention
    assert fc.flops_per_step == pytest.approx(analytic, rel=0.05)
    assert tokens_per_sample((x, x)) == t


def test_flop_count_of_the_demo_gpt() -> None:
    from elastrain.demo.gpt import GPT, loss_fn

    d, t, b, layers, vocab = 128, 64, 4, 2, 256
    x = torch.randint(0, vocab, (b, t))
    fc = measure_step_flops(GPT(vocab, t, d, layers), loss_fn, (x, x), b, 2 * b)
    matmul_params = layers * (4 * d * d + 8 * d * d) + d * vocab
    analytic = 2 * (6 * matmul_params * b * t + 3 * layers * 4 * t * t * d * b)
    assert fc.flops_per_step == pytest.approx(analytic, rel=0.05)


def test_counting_flops_leaves_the_model_and_rng_alone() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(4, 8), torch.randn(4, 1))
    rng = torch.get_rng_state()
    measure_step_flops(model, mse, batch, 4, 8)
    assert not model.training
    assert all(q.grad is None for q in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


# ---- meters ---------------------------------------------------------------------------


def fake_rapl(root: Path, uj: int, rng: int = 1000_000_000) -> None:
    z = root / "intel-rapl:0"
    z.mkdir(parents=True, exist_ok=True)
    (z / "name").write_text("package-0\n")
    (z / "energy_uj").write_text(f"{uj}\n")
    (z / "max_energy_range_uj").write_text(f"{rng}\n")
    sub = root / "intel-rapl:0:0"  # a sub-domain (core): not a package, not counted
    sub.mkdir(exist_ok=True)
    (sub / "energy_uj").write_text("5\n")
    (sub / "max_energy_range_uj").write_text(f"{rng}\n")


def test_rapl_meter_reads_packages_and_survives_a_wrap(tmp_path: Path) -> None:
    fake_rapl(tmp_path, 999_000_000)
    m = RaplMeter(tmp_path)
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("999_500_000".replace("_", ""))
    (r,) = m.read()
    assert r.joules == pytest.approx(0.5) and r.scope == "host" and not r.is_estimate
    assert r.domain.endswith(":package-0") and "measured" in r.label
    (tmp_path / "intel-rapl:0" / "energy_uj").write_text("1500000")  # wrapped at 1e9
    (r,) = m.read()
    assert r.joules == pytest.approx(0.5 + 0.5 + 1.5)
    with pytest.raises(OSError):
        RaplMeter(tmp_path / "nothing")


class FakeNvml:
    """The pynvml calls NvmlMeter makes, on two fake GPUs: one with an energy
    counter (mJ), one without (power in mW, integrated)."""

    def __init__(self) -> None:
        self.mj = 1_000_000.0
        self.mw = 300_000.0
        self.down = False

    def nvmlInit(self) -> None:  # noqa: N802
        pass

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.down = True

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:  # noqa: N802
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:  # noqa: N802
        return f"GPU-{h}".encode()

    def nvmlDeviceGetName(self, h: int) -> str:  # noqa: N802
        return "NVIDIA H200"

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> float:  # noqa: N802
        if h == 1:
            raise RuntimeError("NVMLError_NotSupported")
        return self.mj

    def nvmlDeviceGetPowerUsage(self, h: int) -> float:  # noqa: N802
        return self.mw

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:  # noqa: N802
        return SimpleNamespace(gpu=87)


def test_nvml_meter_uses_the_energy_counter_or_integrates_power() -> None:
    nv = FakeNvml()
    m = NvmlMeter(nv)
    nv.mj += 5000.0  # 5 J
    a, b = m.read()
    assert (a.domain, a.scope, a.joules, a.util) == ("nvml:GPU-0", "device", 5.0, 0.87)
    assert not a.is_estimate and "H200" in a.label and "measured" in a.label
    assert b.domain == "nvml:GPU-1" and b.watts == pytest.approx(300.0)
    assert b.joules > 0
    m.close()
    assert nv.down
    assert len(NvmlMeter(FakeNvml(), devices=[1]).read()) == 1


def test_estimate_meter_is_labelled_an_estimate() -> None:
    cpu = iter([0.0, 0.5, 1.0])
    m = EstimateMeter(tdp_w=100.0, cpus=2, cpu_time=lambda: next(cpu))
    (r,) = m.read()
    assert r.is_estimate and r.label.startswith(ESTIMATE_PREFIX) and r.scope == "process"
    assert 0 < r.watts <= 100.0
    with pytest.raises(ValueError, match="TDP"):
        EstimateMeter(tdp_w=0.0)


def test_choose_meters(monkeypatch: pytest.MonkeyPatch) -> None:
    (m,) = choose_meters("estimate")
    assert m.is_estimate
    with pytest.raises(ValueError, match="unknown power meter"):
        choose_meters("bogus")
    auto = choose_meters("auto")
    assert auto, "auto always has a meter: the estimate when nothing is readable"
    if not Path("/sys/class/powercap/intel-rapl:0/energy_uj").exists():
        try:
            import pynvml  # noqa: F401
        except ImportError:
            assert [x.source for x in auto] == ["estimate"]


def test_metering_interval() -> None:
    assert metering_interval("") == 1.0
    assert metering_interval("off") is None and metering_interval("0") is None
    assert metering_interval("0.25") == 0.25
    with pytest.raises(ValueError):
        metering_interval("fast")


class Collect:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.events.append({"kind": kind, **fields})
        return self.events[-1]


def test_sampler_emits_labelled_samples_and_a_last_one_on_stop() -> None:
    out = Collect()
    s = Sampler(out, [EstimateMeter(tdp_w=50.0)], interval_s=3600.0).start()
    assert s.sample() == 1
    s.stop()
    assert len(out.events) == 2  # the explicit sample and the one at stop
    for e in out.events:
        assert e["kind"] == "power_sample" and e["estimate"] is True
        assert e["label"].startswith(ESTIMATE_PREFIX)
        assert 0 <= e["cpu_util"] <= 1 and e["interval_s"] > 0


# ---- energy from events ---------------------------------------------------------------

T = 1_700_000_000.0


def ps(t: float, proc: str, pid: int, domain: str, joules: float, scope: str = "host",
       estimate: bool = False, dt: float = 1.0) -> dict[str, Any]:  # fmt: skip
    return {"t": T + t, "mono": t, "proc": proc, "pid": pid, "kind": "power_sample",
            "domain": domain, "source": "rapl", "label": "L" if not estimate else "ESTIMATE: x",
            "estimate": estimate, "scope": scope, "watts": 0.0, "joules": joules,
            "interval_s": dt, "cpu_util": 0.25, "host_cpu_util": 0.5, "util": None}  # fmt: skip


def test_a_shared_domain_is_counted_once_and_process_domains_add_up() -> None:
    ev = []
    for k in range(1, 11):  # two workers read the same package at 100 W for 10 s
        ev.append(ps(k, "w0", 1, "rapl:h:package-0", 100.0 * k))
        ev.append(ps(k + 0.5, "w1", 2, "rapl:h:package-0", 100.0 * k))
    ivs = energy_intervals(ev)
    assert sum(i.joules for i in ivs) == pytest.approx(1000.0, rel=0.06)
    ev2 = [ps(k, p, n, f"estimate:h:{n}", 10.0 * k, "process", True)
           for k in range(1, 6) for p, n in (("w0", 1), ("w1", 2))]  # fmt: skip
    assert sum(i.joules for i in energy_intervals(ev2)) == pytest.approx(100.0)


def two_member_run(fault: bool) -> list[dict[str, Any]]:
    """w0 and w1, 1 s steps from t=1; with `fault`, step 5 is lost at 6.5 and
    re-run after a 1.5 s recovery. Each worker's estimate meter: 10 W."""
    ev: list[dict[str, Any]] = [
        {"t": T, "proc": "launcher", "pid": 9, "kind": "job_start", "target": 2},
    ]
    for i, m in enumerate(("w0", "w1")):
        ev.append({"t": T, "proc": "launcher", "pid": 9, "kind": "worker_spawned",
                   "member": m, "pid_": 0, "replacement": False})  # fmt: skip
        ev[-1]["pid"] = 10 + i
        ev.append({"t": T + 1, "proc": m, "pid": 10 + i, "kind": "generation_start", "gen": 1,
                   "step": 0})  # fmt: skip
    t, s = 1.0, 0
    while s < 8:
        if fault and s == 5 and t < 7:
            for i, m in enumerate(("w0", "w1")):
                ev.append({"t": T + 6.5, "proc": m, "pid": 10 + i, "kind": "step_abort",
                           "step": 5, "gen": 1, "phase": "allreduce"})  # fmt: skip
                ev.append({"t": T + 8.0, "proc": m, "pid": 10 + i, "kind": "generation_start",
                           "gen": 2, "step": 5})  # fmt: skip
            t = 8.0
            continue
        t += 1.0
        for i, m in enumerate(("w0", "w1")):
            ev.append({"t": T + t, "proc": m, "pid": 10 + i, "kind": "step_commit", "step": s,
                       "gen": 1, "step_s": 1.0, "samples_per_s": 8.0, "loss": 1.0})  # fmt: skip
        s += 1
    end = t
    for i, m in enumerate(("w0", "w1")):
        for k in range(1, int(end) + 1):
            ev.append(ps(k, m, 10 + i, f"estimate:h:{10 + i}", 10.0 * k, "process", True))
        ev.append({"t": T + end, "proc": m, "pid": 10 + i, "kind": "flops_measured",
                   "flops_per_step": 4e12, "flops_per_sample": 5e11, "tokens_per_sample": 4,
                   "device": "NVIDIA H200", "device_key": f"cuda:GPU-{i}",
                   "peak_tflops": 989.4, "peak_source": "table",
                   "peak_estimate": False})  # fmt: skip
    ev.append({"t": T + end, "proc": "launcher", "pid": 9, "kind": "job_end", "status": "done"})
    return ev


def test_energy_lands_in_the_buckets_of_the_time_it_was_spent() -> None:
    clean, faulty = two_member_run(False), two_member_run(True)
    for ev in (clean, faulty):
        gp = goodput(ev)
        ivs = energy_intervals(ev)
        by = energy_by_bucket(ivs, gp)
        assert set(by) == set(BUCKETS)
        assert sum(by.values()) == pytest.approx(sum(i.joules for i in ivs), rel=1e-9)
    gp = goodput(faulty)
    by = energy_by_bucket(energy_intervals(faulty), gp)
    # step 5's first try (6 -> 6.5) was wasted; 6.5 -> 8 was regroup: 2 members x 10 W each
    assert by["wasted"] == pytest.approx(2 * 10 * 0.5, rel=1e-6)
    assert by["regroup"] == pytest.approx(2 * 10 * 1.5, rel=1e-6)
    ef = efficiency(faulty, gp, grid_gco2_per_kwh=500.0)
    assert ef.failure_j == pytest.approx(sum(by[b] for b in FAILURE_BUCKETS))
    assert ef.badput_j is not None and ef.badput_j >= ef.failure_j
    assert ef.energy_estimate and all(x.startswith("ESTIMATE") for x in ef.power_labels)
    assert ef.devices == 2 and ef.committed_steps == 8
    assert ef.achieved_tflops == pytest.approx(8 * 4.0 / gp.wall_s)
    assert ef.achieved_tflops_stepping == pytest.approx(4.0)
    assert ef.mfu_stepping == pytest.approx(4.0 / (2 * 989.4))
    assert ef.energy_j is not None and ef.co2e_g == pytest.approx(ef.energy_j / 3.6e6 * 500)
    assert ef.joules_per_step == pytest.approx(ef.energy_j / 8)
    assert ef.joules_per_token == pytest.approx(ef.energy_j / (8 * 8 * 4))
    assert ef.tflops_per_watt == pytest.approx(8 * 4.0 / ef.energy_j)
    assert ef.series["watts"] and max(w for _, w in ef.series["watts"]) == pytest.approx(20, 0.2)
    assert efficiency(faulty, gp, peak_tflops=100.0).mfu_stepping == pytest.approx(4 / 200)


def test_efficiency_of_a_run_without_metering() -> None:
    ef = efficiency([], goodput([]))
    assert ef.energy_j is None and ef.mfu is None and not ef.energy_estimate
    assert math.isclose(sum(ef.energy_by_bucket.values()), 0.0)


def test_peak_table() -> None:
    assert table_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4)
    assert table_peak("NVIDIA H100 PCIe", "bf16") == pytest.approx(756.5)
    assert table_peak("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5)
    assert table_peak("Tesla T4", "bf16") == pytest.approx(8.1)  # no bf16: fp32
    assert table_peak("Some CPU", "fp32") is None

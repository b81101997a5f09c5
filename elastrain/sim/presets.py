"""Named starting points for `elastrain sim --preset`. Every number is an assumption
stated here and in docs/guide/simulator.md; override any of them on the command line.

Failure rates come from Meta's Llama 3 report (The Llama 3 Herd of Models, 2024,
section 3.3.4 and its table of root causes): 419 unexpected interruptions in a
54-day snapshot of a 16,384-H100 job; about 64% were attributed to the GPUs
(faulty GPU, HBM3, SRAM, GPU system processor, silent data corruption, thermal),
the rest to the host, network and software. The report states "higher than 90%
effective training time". It gives no restart costs; ours are of the order
reported for large PyTorch jobs with async checkpointing and fast relaunch.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastrain.sim.config import (
    DAY,
    HOUR,
    CheckpointPolicy,
    Delay,
    FailureProcess,
    Failures,
    PowerConfig,
    RecoveryCosts,
    SimConfig,
    Topology,
    Workload,
)

LLAMA3_GPUS = 16384
LLAMA3_HOSTS = LLAMA3_GPUS // 8
LLAMA3_DAYS = 54.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_GPU_SHARE = 268 / 419
"""Share of the interruptions attributed to the GPUs themselves."""

GPU_MTBF_S = LLAMA3_GPUS * LLAMA3_DAYS * DAY / (LLAMA3_INTERRUPTIONS * LLAMA3_GPU_SHARE)
"""Per-GPU mean time between failures (about 9 years)."""
HOST_MTBF_S = LLAMA3_HOSTS * LLAMA3_DAYS * DAY / (LLAMA3_INTERRUPTIONS * (1 - LLAMA3_GPU_SHARE))
"""Per-host mean time between failures for everything but the GPUs (about 2 years)."""

LLAMA3_FAILURES = Failures(
    accelerator=FailureProcess(mtbf_s=GPU_MTBF_S),
    host=FailureProcess(mtbf_s=HOST_MTBF_S),
    replacement=Delay(mean_s=120.0, kind="lognormal", cv=0.5),
)
LLAMA3_COSTS = RecoveryCosts(
    detect_s=60.0,  # collective watchdog / health check
    restart_s=120.0,  # relaunch 2k hosts, imports, NCCL init
    regroup_s=30.0,  # elastic: new process group among survivors
    heal_s=10.0,
    state_bytes=405e9 * 14,  # bf16 weights + fp32 master weights and Adam moments
    heal_gbps=400.0,
    spare_swap_s=30.0,
)
LLAMA3_CHECKPOINT = CheckpointPolicy(
    interval_s="young", save_s=20.0, persist_s=60.0, restore_s=60.0
)


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: SimConfig


def _llama3() -> SimConfig:
    return SimConfig(
        # TP 8 x PP 16: one replica of the 405B model is 128 GPUs (16 hosts).
        topology=Topology(accelerators=LLAMA3_GPUS, accelerators_per_replica=128),
        failures=LLAMA3_FAILURES,
        costs=LLAMA3_COSTS,
        checkpoint=LLAMA3_CHECKPOINT,
        power=PowerConfig(busy_w=700.0, idle_w=150.0),
        workload=Workload(step_s=6.0),
        horizon_s=LLAMA3_DAYS * DAY,
    )


def _tpu_pod() -> SimConfig:
    # 9,216 chips, 4 per host, 64-chip cubes as correlated failure domains (a cube's
    # optical links, power or cooling); one model replica per cube. Chips and hosts
    # fail at the Llama 3 per-component rates; a cube fails once per ~6 years.
    return SimConfig(
        topology=Topology(
            accelerators=9216,
            accelerators_per_host=4,
            accelerators_per_replica=64,
            hosts_per_domain=16,
        ),
        failures=Failures(
            accelerator=FailureProcess(mtbf_s=GPU_MTBF_S),
            host=FailureProcess(mtbf_s=HOST_MTBF_S),
            domain=FailureProcess(mtbf_s=50_000 * HOUR),
            replacement=Delay(mean_s=300.0, kind="lognormal", cv=0.5),
        ),
        costs=RecoveryCosts(
            detect_s=30.0,
            restart_s=180.0,
            regroup_s=20.0,
            heal_s=5.0,
            state_bytes=70e9 * 14,
            heal_gbps=200.0,
            spare_swap_s=30.0,
        ),
        checkpoint=CheckpointPolicy(interval_s="young", save_s=15.0, restore_s=45.0),
        power=PowerConfig(busy_w=600.0, idle_w=120.0),
        workload=Workload(step_s=4.0),
        horizon_s=30 * DAY,
    )


PRESETS: dict[str, Preset] = {
    "llama3-16k": Preset(
        "llama3-16k",
        "16,384 H100s (2,048 hosts) at Llama 3's published interruption rate "
        "(419 in 54 days), 128-GPU replicas, 54 days",
        _llama3(),
    ),
    "tpu-pod-9216": Preset(
        "tpu-pod-9216",
        "9,216-chip TPU pod: 4 chips per host, 64-chip cubes as failure domains and replicas",
        _tpu_pod(),
    ),
}

DEFAULT = _llama3()
"""Rates and costs used when no preset is named (the job size comes from the flags)."""


def get(name: str) -> SimConfig:
    try:
        return PRESETS[name].config
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}") from None

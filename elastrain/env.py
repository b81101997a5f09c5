"""Every environment variable elastrain reads or sets, in one place.

The launcher (or a Kubernetes pod spec) sets these for each worker; the worker
runtime reads them in `ElasticTrainer`. Nothing else in the package spells an
`ELASTRAIN_*` name.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

COORDINATOR = "ELASTRAIN_COORDINATOR"
"""host:port of the coordinator's HTTP API."""

TOKEN = "ELASTRAIN_TOKEN"
"""The job token; every coordinator call carries it. Never passed on a command line."""

TOKEN_FILE = "ELASTRAIN_TOKEN_FILE"
"""Path of a file holding the job token (alternative to TOKEN)."""

MEMBER_ID = "ELASTRAIN_MEMBER_ID"
"""This worker's member id, unique per spawned process (w0, w1, ... replacements continue)."""

RUN_DIR = "ELASTRAIN_RUN_DIR"
"""The run directory: events, logs, ledger."""

PARENT_PID = "ELASTRAIN_PARENT_PID"
"""Set by the launcher (or an agent) on a child it starts: its own PID. The child
dies with it (`elastrain.children.die_with_parent`) and removes the variable."""

ADVERTISE_HOST = "ELASTRAIN_HOST"
"""Address this worker's gloo device binds and advertises (default 127.0.0.1)."""

FAULTS = "ELASTRAIN_FAULTS"
"""JSON list of in-worker fault points (see elastrain.chaos.points); for tests and chaos runs."""

STEPS = "ELASTRAIN_STEPS"
"""Optional override of the trainer's total step count (the launcher's --steps)."""

SHARD_SIZE = "ELASTRAIN_SHARD_SIZE"
"""Optional override of TrainerConfig.shard_size (the launcher's --shard-size): the
workers must agree with the coordinator's."""

REPLICA_PROCS = "ELASTRAIN_REPLICA_PROCS"
"""Processes per JAX replica (the launcher's --replica-procs K; unset or 1: a
replica is one process). The next four say where this process sits."""
REPLICA = "ELASTRAIN_REPLICA"
"""Which replica slot (0..R-1) this process belongs to."""
REPLICA_INCARNATION = "ELASTRAIN_REPLICA_INCARNATION"
"""How many times that slot was rebuilt before (its JAX runtime's id with REPLICA)."""
REPLICA_PROC = "ELASTRAIN_REPLICA_PROC"
"""This process's JAX process id inside its replica (0..K-1): the shard it holds."""
JAX_COORDINATOR = "ELASTRAIN_JAX_COORDINATOR"
"""host:port of the replica's `jax.distributed` coordinator (its process 0 serves
it), new for every incarnation of the replica."""

# Device placement (--devices; `elastrain.launch.devices`): the names CUDA and
# torchrun's workers already know, set per worker by the launcher.
VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
"""The one accelerator this worker sees."""
LOCAL_RANK = "LOCAL_RANK"
"""This worker's index among its launcher's devices."""
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
"""How many devices its launcher places workers on."""

CKPT_DIR = "ELASTRAIN_CKPT_DIR"
"""Checkpoint directory chosen by the launcher (overrides TrainerConfig.checkpoint_dir)."""

CKPT_EVERY = "ELASTRAIN_CKPT_EVERY"
"""Optional override of TrainerConfig.checkpoint_every (the launcher's --ckpt-every)."""

CKPT_MTBF = "ELASTRAIN_CKPT_MTBF"
"""Optional override of TrainerConfig.checkpoint_mtbf_s (the launcher's --ckpt-mtbf)."""

CKPT_FORMAT = "ELASTRAIN_CKPT_FORMAT"
"""Optional override of TrainerConfig.checkpoint_format, "flat" or "dcp" (the
launcher's --ckpt-format)."""

HEAL_AUTH = "ELASTRAIN_HEAL_AUTH"
"""Optional override of TrainerConfig.heal_auth, "digest" or "mac" (the launcher's
--heal-auth)."""

RESUME = "ELASTRAIN_RESUME"
"""Which checkpoint a worker loads before its first rendezvous: "none", "latest"
(the newest verified one), or a step number (the one the launcher chose and
verified at whole-job resume; newer step directories were already discarded).
Unset: "latest" when checkpointing is on, else "none"."""

RESUME_FROM = "ELASTRAIN_RESUME_FROM"
"""A DCP checkpoint written by a plain torch job (`elastrain run --resume-from`):
a worker with no elastrain checkpoint to load (RESUME "none", or "latest" and
none committed yet) loads this one instead, at RESUME_STEP."""

RESUME_STEP = "ELASTRAIN_RESUME_STEP"
"""The committed step count RESUME_FROM holds (--resume-step; unset: the
checkpoint's own ``step`` entry)."""

METERING = "ELASTRAIN_METERING"
EVENTS_STDOUT = "ELASTRAIN_EVENTS_STDOUT"
"""1: every process also prints its events to stdout, one JSON line each (cluster mode)."""
"""Worker power/utilisation sampling and the one-time FLOP count: "off" (or "0")
turns both off; a number is the sampling interval in seconds (default 1)."""

POWER_METER = "ELASTRAIN_POWER_METER"
"""Which power meters a worker uses: "auto" (default: NVML and RAPL where
readable, else the labelled estimate), or a comma list of "nvml", "rapl", "estimate"."""

CPU_TDP_W = "ELASTRAIN_CPU_TDP_W"
"""Thermal design power of this host's CPUs in watts, for the estimate meter
(default: 10 W per logical CPU)."""

PEAK_TFLOPS = "ELASTRAIN_PEAK_TFLOPS"
"""Override of the per-device peak TFLOPS used for MFU (default: the table in
elastrain.observe.efficiency)."""

GRID_GCO2_PER_KWH = "ELASTRAIN_GRID_GCO2_PER_KWH"
"""Grid carbon intensity for CO2e figures, in gCO2e per kWh (default 400)."""


def read_token(environ: Mapping[str, str] | None = None) -> str | None:
    """The job token: $ELASTRAIN_TOKEN, else the contents of the file
    $ELASTRAIN_TOKEN_FILE names (surrounding whitespace dropped), else None.
    The one place the coordinator and the workers read it from."""
    e = os.environ if environ is None else environ
    token = (e.get(TOKEN) or "").strip()
    if not token and e.get(TOKEN_FILE):
        token = Path(e[TOKEN_FILE]).read_text().strip()
    return token or None

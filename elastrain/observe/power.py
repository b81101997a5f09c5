"""Power meters: one small seam, three implementations, and the worker's sampler.

`PowerMeter.read()` returns one `PowerReading` per power domain it measures:
the domain's energy since the meter started (joules, cumulative) and its mean
power since the previous read (watts).

  NvmlMeter      NVIDIA GPUs through NVML (the `nvidia-ml-py` package, imported
                 lazily): the driver's energy counter where the GPU has one,
                 else its power reading integrated over time. Measured.
  RaplMeter      CPU packages through Linux RAPL
                 (/sys/class/powercap/intel-rapl:N/energy_uj, where readable;
                 AMD CPUs expose the same files). Measured, host-wide.
  EstimateMeter  neither readable: CPU TDP x this process's CPU utilisation.
                 NOT a measurement; every reading says so (`is_estimate`,
                 and a label starting with "ESTIMATE"), and every figure
                 derived from it (report, summary) carries the label.

`Sampler` runs in each worker on a daemon thread (default 1 Hz) and emits one
`power_sample` event per domain per tick, with this process's and the host's
CPU utilisation. Domains are named so that two workers reading the same
device or package name the same domain (the report counts each domain once).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from elastrain import env
from elastrain.observe.events import EventKind
from elastrain.threads import METER, name_native_thread

ESTIMATE_PREFIX = "ESTIMATE"
"""Every label of an estimated (not measured) power figure starts with this."""

DEFAULT_TDP_W_PER_CPU = 10.0
"""The estimate meter's CPU TDP per logical CPU when $ELASTRAIN_CPU_TDP_W is unset."""


@dataclass(frozen=True)
class PowerReading:
    """One domain's energy and power at one read.

    domain: stable name of what is measured ("nvml:GPU-<uuid>",
    "rapl:<host>:package-0", "estimate:<host>:<pid>").
    scope: "device" (one accelerator), "host" (a whole CPU package: shared by
    every process on the host) or "process" (this process's share).
    joules: energy since the meter started; watts: mean power since the last read.
    util: the device's utilisation 0..1 where the meter knows it (NVML), else None.
    """

    domain: str
    source: str
    label: str
    is_estimate: bool
    scope: str
    joules: float
    watts: float
    util: float | None = None


class PowerMeter(Protocol):
    """The power-meter seam. Who calls it: the worker's `Sampler` thread only;
    `read()` must not block for long (file or driver reads) and may raise
    OSError, which drops that read."""

    source: str
    is_estimate: bool

    def read(self) -> list[PowerReading]: ...

    def close(self) -> None: ...


# ---- NVML ---------------------------------------------------------------------------


class NvmlMeter:
    """GPU power through NVML. `nvml` is the `pynvml` module (from nvidia-ml-py),
    injectable for tests; `devices`: NVML indices to read (None: all)."""

    source = "nvml"
    is_estimate = False

    def __init__(self, nvml: Any = None, devices: Sequence[int] | None = None) -> None:
        if nvml is None:
            import pynvml as nvml  # type: ignore[no-redef]
        self.nvml = nvml
        nvml.nvmlInit()
        n = int(nvml.nvmlDeviceGetCount())
        idx = list(range(n)) if devices is None else [i for i in devices if 0 <= i < n]
        if not idx:
            nvml.nvmlShutdown()
            raise OSError("NVML sees no GPU")
        self._dev: list[dict[str, Any]] = []
        now = time.monotonic()
        for i in idx:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            name = nvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            d: dict[str, Any] = {"h": h, "uuid": uuid, "name": name, "t": now, "j": 0.0}
            try:
                d["mj0"] = float(nvml.nvmlDeviceGetTotalEnergyConsumption(h))
            except Exception:  # noqa: BLE001 - NVMLError_NotSupported on older GPUs
                d["mj0"] = None
                d["w"] = float(nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0
            self._dev.append(d)

    def read(self) -> list[PowerReading]:
        out = []
        for d in self._dev:
            h, now = d["h"], time.monotonic()
            dt = now - d["t"]
            if d["mj0"] is not None:
                j = (float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(h)) - d["mj0"]) / 1000.0
                w = (j - d["j"]) / dt if dt > 0 else 0.0
            else:  # trapezoid over the power readings
                w_now = float(self.nvml.nvmlDeviceGetPowerUsage(h)) / 1000.0
                w = (w_now + d["w"]) / 2
                j = d["j"] + w * dt
                d["w"] = w_now
            try:
                util: float | None = float(self.nvml.nvmlDeviceGetUtilizationRates(h).gpu) / 100
            except Exception:  # noqa: BLE001
                util = None
            d["t"], d["j"] = now, j
            out.append(
                PowerReading(
                    f"nvml:{d['uuid']}",
                    "nvml",
                    f"NVML {d['name']} (measured)",
                    False,
                    "device",
                    j,
                    w,
                    util,
                )  # fmt: skip
            )
        return out

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---- RAPL ---------------------------------------------------------------------------

RAPL_ROOT = "/sys/class/powercap"


class RaplMeter:
    """CPU package energy through Linux RAPL counters (host-wide: every process of
    the host reads the same domains). Raises OSError when none is readable."""

    source = "rapl"
    is_estimate = False

    def __init__(self, root: str | os.PathLike[str] = RAPL_ROOT) -> None:
        host = socket.gethostname()
        self._zones: list[dict[str, Any]] = []
        for z in sorted(Path(root).glob("intel-rapl:*")):
            if z.name.count(":") != 1:  # sub-domains (core, dram) are inside packages
                continue
            try:
                uj = int((z / "energy_uj").read_text())
                name = (z / "name").read_text().strip() if (z / "name").exists() else z.name
                rng = int((z / "max_energy_range_uj").read_text())
            except (OSError, ValueError):
                continue
            self._zones.append({"path": z / "energy_uj", "last": uj, "range": rng, "j": 0.0,
                                "t": time.monotonic(), "domain": f"rapl:{host}:{name}"})  # fmt: skip
        if not self._zones:
            raise OSError(f"no readable RAPL energy counter under {root}")

    def read(self) -> list[PowerReading]:
        out = []
        for z in self._zones:
            uj, now = int(z["path"].read_text()), time.monotonic()
            delta = uj - z["last"]
            if delta < 0:  # the counter wrapped
                delta += z["range"]
            dj = delta / 1e6
            dt = now - z["t"]
            z["last"], z["t"], z["j"] = uj, now, z["j"] + dj
            out.append(PowerReading(z["domain"], "rapl", "RAPL CPU package (measured)", False,
                                    "host", z["j"], dj / dt if dt > 0 else 0.0))  # fmt: skip
        return out

    def close(self) -> None:
        pass


# ---- estimate -----------------------------------------------------------------------


class EstimateMeter:
    """Neither NVML nor RAPL: an ESTIMATE of this process's CPU power as
    TDP x (this process's CPU time / (wall time x logical CPUs)). Summed over the
    processes of a host it never exceeds the TDP; it ignores idle power,
    memory and everything else, so it is a rough lower-bound guess, labelled."""

    source = "estimate"
    is_estimate = True

    def __init__(
        self,
        tdp_w: float | None = None,
        cpus: int | None = None,
        cpu_time: Callable[[], float] = time.process_time,
    ) -> None:
        self.cpus = cpus or os.cpu_count() or 1
        if tdp_w is None:
            raw = os.environ.get(env.CPU_TDP_W)
            tdp_w = float(raw) if raw else DEFAULT_TDP_W_PER_CPU * self.cpus
        if not tdp_w > 0:
            raise ValueError(f"the CPU TDP must be > 0 W (got {tdp_w}); set {env.CPU_TDP_W}")
        self.tdp_w = tdp_w
        self.label = (
            f"{ESTIMATE_PREFIX}: CPU TDP {tdp_w:g} W x process CPU utilisation "
            "(no power meter readable)"
        )
        self._cpu_time = cpu_time
        self._domain = f"estimate:{socket.gethostname()}:{os.getpid()}"
        self._c, self._t, self._j = cpu_time(), time.monotonic(), 0.0

    def read(self) -> list[PowerReading]:
        c, now = self._cpu_time(), time.monotonic()
        dt = now - self._t
        util = min(1.0, max(0.0, (c - self._c) / (dt * self.cpus))) if dt > 0 else 0.0
        w = self.tdp_w * util
        self._j += w * dt
        self._c, self._t = c, now
        return [PowerReading(self._domain, "estimate", self.label, True, "process", self._j, w,
                             None)]  # fmt: skip

    def close(self) -> None:
        pass


def choose_meters(spec: str | None = None) -> list[PowerMeter]:
    """The meters for this process. `spec` (default $ELASTRAIN_POWER_METER or "auto"):
    "auto" = NVML and RAPL where readable, the estimate when neither is; or a
    comma list of "nvml", "rapl", "estimate" (an unreadable one is skipped)."""
    spec = (spec or os.environ.get(env.POWER_METER) or "auto").strip().lower()
    names = ["nvml", "rapl"] if spec == "auto" else [s.strip() for s in spec.split(",")]
    unknown = set(names) - {"nvml", "rapl", "estimate"}
    if unknown:
        raise ValueError(
            f"unknown power meter(s) {sorted(unknown)} in {env.POWER_METER}={spec!r}; "
            "use auto, or a comma list of nvml, rapl, estimate"
        )
    meters: list[PowerMeter] = []
    for n in names:
        try:
            if n == "nvml":
                meters.append(NvmlMeter(devices=_cuda_nvml_index()))
            elif n == "rapl":
                meters.append(RaplMeter())
            else:
                meters.append(EstimateMeter())
        except Exception:  # noqa: BLE001 - ImportError, OSError, pynvml's NVMLError (no driver)
            continue
    if not meters and spec == "auto":
        meters.append(EstimateMeter())
    return meters


def _cuda_nvml_index() -> list[int] | None:
    """The NVML index of the GPU this process uses, when torch has initialised CUDA
    and CUDA_VISIBLE_DEVICES is a plain index list; None (all GPUs) otherwise."""
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None
        i = torch.cuda.current_device()
    except Exception:  # noqa: BLE001
        return None
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis:
        parts = [v.strip() for v in vis.split(",")]
        return [int(parts[i])] if i < len(parts) and parts[i].isdigit() else None
    return [i]


# ---- CPU utilisation ----------------------------------------------------------------


class CpuUtil:
    """This process's CPU utilisation (fraction of the host's logical CPUs) and
    the host's (from /proc/stat, None where it does not exist), since the last call."""

    def __init__(self, stat: str = "/proc/stat") -> None:
        self.cpus = os.cpu_count() or 1
        self._stat = stat
        self._c, self._t = time.process_time(), time.monotonic()
        self._host = self._host_times()

    def _host_times(self) -> tuple[float, float] | None:
        try:
            with open(self._stat) as f:
                vals = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
        return sum(vals[:8]), idle

    def sample(self) -> tuple[float, float | None]:
        c, now = time.process_time(), time.monotonic()
        dt = now - self._t
        proc = min(1.0, max(0.0, (c - self._c) / (dt * self.cpus))) if dt > 0 else 0.0
        self._c, self._t = c, now
        host_now = self._host_times()
        host: float | None = None
        if host_now is not None and self._host is not None:
            total, idle = host_now[0] - self._host[0], host_now[1] - self._host[1]
            host = min(1.0, max(0.0, 1 - idle / total)) if total > 0 else None
        self._host = host_now
        return proc, host


# ---- the sampler --------------------------------------------------------------------


class _Emitter(Protocol):
    def emit(self, kind: EventKind, **fields: Any) -> dict[str, Any]: ...


class Sampler:
    """Reads `meters` every `interval_s` on a daemon thread and emits `power_sample`
    events. Started and stopped by the worker's main thread; `stop()` takes one
    last sample so the energy up to a clean exit is recorded. A meter whose read
    fails is skipped for that tick; the thread never raises."""

    def __init__(self, events: _Emitter, meters: Sequence[PowerMeter], interval_s: float) -> None:
        if not interval_s > 0:
            raise ValueError(f"the sampling interval must be > 0 s (got {interval_s})")
        self.events, self.meters, self.interval_s = events, list(meters), interval_s
        self.cpu = CpuUtil()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t = time.monotonic()
        self._thread = threading.Thread(target=self._loop, name="elastrain-meter", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _loop(self) -> None:
        name_native_thread(METER)
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> int:
        """Emit one `power_sample` per domain now; returns how many."""
        with self._lock:
            now = time.monotonic()
            dt, self._t = now - self._t, now
            cpu, host = self.cpu.sample()
            n = 0
            for m in self.meters:
                try:
                    readings = m.read()
                except Exception:  # noqa: BLE001 - a flaky meter must not kill training
                    continue
                for r in readings:
                    self.events.emit(
                        EventKind.POWER_SAMPLE,
                        domain=r.domain,
                        source=r.source,
                        label=r.label,
                        estimate=r.is_estimate,
                        scope=r.scope,
                        watts=r.watts,
                        joules=r.joules,
                        interval_s=dt,
                        util=r.util,
                        cpu_util=cpu,
                        host_cpu_util=host,
                    )
                    n += 1
            return n

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.sample()
        for m in self.meters:
            try:
                m.close()
            except Exception:  # noqa: BLE001
                pass

"""Discrete-event simulation of one job through a failure trace.

The job is a state machine over phases (running, saving, detect, wait, restart,
restore, regroup, heal). Events are: failures (from the trace), replacement hosts
arriving, phase ends, and three times derived while running (next checkpoint, next
join, target reached), which fall on step boundaries. Between events the job moves
at a constant rate, so the cost is per event, not per step: a 16k-accelerator,
54-day run is a few thousand events.

Rigid strategies (restart, hot-spare) treat every failure of a job host as a stop:
roll back to the last durable checkpoint, detect, wait for every host, restart,
restore. The elastic strategy drops the replicas that lost a host, loses only the
in-flight step, regroups and runs shrunk; complete replicas join at the next step
boundary (regroup + heal). It rolls back only when no replica is left.
"""

from __future__ import annotations

import heapq
import math

from elastrain.sim.analytic import checkpoint_interval_s
from elastrain.sim.config import DAY, SimConfig
from elastrain.sim.metrics import BUCKETS, SimResult
from elastrain.sim.trace import FailureEvent, RandomTrace, Trace

# Phase numbers double as indices into BUCKETS (productive, checkpoint, ...).
RUNNING, SAVING, DETECT, WAIT, RESTART, RESTORE, REGROUP, HEAL = range(8)
LOST = BUCKETS.index("lost")
_EPS = 1e-9
_ARRIVE, _SPARE_ARRIVE = 0, 1


def simulate(config: SimConfig, trace: Trace | None = None) -> SimResult:
    """Run one job through `trace` (default: the random trace of `config.seed`)."""
    return _Job(config, trace if trace is not None else RandomTrace(config)).run()


class _Job:
    def __init__(self, config: SimConfig, trace: Trace) -> None:
        self.cfg = config
        self.trace = trace
        topo = config.topology
        self.hosts = topo.hosts
        self.rigid = config.strategy.rigid
        if self.rigid:  # all or nothing: the whole job behaves as one replica
            self.hpr, self.R, self.apr = topo.hosts, 1, topo.accelerators
            self.min_replicas = 1
        else:
            self.hpr, self.R = topo.hosts_per_replica, topo.replicas
            self.apr = topo.replica_accelerators
            self.min_replicas = config.strategy.min_replicas
        self.interval = checkpoint_interval_s(config)
        c = config.costs
        self.detect_s = c.detect_s
        self.heal_s = c.heal_time_s(self.hpr)
        self.swap_s = c.spare_swap_s
        self.step_table = dict(config.workload.step_s_by_replicas)

        self.t = 0.0
        self.phase = RUNNING
        self.phase_end = math.inf
        self.buckets = [0.0] * len(BUCKETS)
        self.progress = 0.0  # steps, in memory
        self.ckpt_progress = 0.0  # steps in the last durable checkpoint
        self.live = 0.0  # compute wall since the durable checkpoint's state, still kept
        self.live_accel = 0.0  # the same in accelerator-seconds
        self.lost_accel_s = 0.0
        self.run_since_ckpt = 0.0
        # (durable_at, progress, live, live_accel) of a checkpoint not yet durable
        self.pending: tuple[float, float, float, float] | None = None
        self.need_restore = False

        self.slot_ok = [True] * self.hosts
        self.missing = [0] * self.R
        self.active: set[int] = set(range(self.R))
        self.joining: set[int] = set()
        self.ready: set[int] = set()
        spares = config.strategy.spare_hosts
        self.spare_ok = [True] * spares
        self.spare_ready = list(range(spares))
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0

        self.n_active = self.R
        self.step_time = self._step_time(self.R)
        self.busy_accel_s = 0.0
        self.failures = self.host_failures = self.interruptions = self.rollbacks = 0
        self.lost_steps = 0.0

    # -- rates --------------------------------------------------------------
    def _step_time(self, n: int) -> float:
        wl = self.cfg.workload
        if n == self.R:
            return wl.step_s
        if n in self.step_table:
            return self.step_table[n]
        mb = wl.global_microbatches
        if mb is not None:
            return wl.step_s * (-(-mb // n)) / (-(-mb // self.R))
        return wl.step_s * self.R / n

    def _advance(self, t_new: float) -> None:
        dt = t_new - self.t
        if dt <= 0:
            return
        self.buckets[self.phase] += dt
        if self.phase == RUNNING:
            self.progress += dt / self.step_time
            self.run_since_ckpt += dt
            self.live += dt
            self.live_accel += self.n_active * self.apr * dt
            self.busy_accel_s += self.n_active * self.apr * dt
        self.t = t_new

    # -- main loop ----------------------------------------------------------
    def run(self) -> SimResult:
        cfg = self.cfg
        target = float(cfg.workload.steps) if cfg.workload.steps is not None else math.inf
        horizon = cfg.horizon_s
        if horizon is None:  # time-to-train without a cap: stop hopeless runs eventually
            horizon = 1000.0 * target * cfg.workload.step_s + 30 * DAY
        events = iter(self.trace)
        nxt: FailureEvent | None = next(events, None)
        done = False
        while True:
            t_next, what = horizon, "end"
            if self.phase == RUNNING:
                st, p = self.step_time, self.progress
                if target < math.inf:
                    tt = self.t + (target - p) * st
                    if tt <= t_next:
                        t_next, what = tt, "target"
                if self.ready and not self.rigid and not self.need_restore:
                    tj = self.t + (math.ceil(p - _EPS) - p) * st
                    if tj < t_next:
                        t_next, what = tj, "join"
                if self.interval < math.inf:
                    due = p + max(0.0, self.interval - self.run_since_ckpt) / st
                    tc = self.t + (math.ceil(due - _EPS) - p) * st
                    if tc < t_next:
                        t_next, what = tc, "checkpoint"
            if self.phase_end < t_next:
                t_next, what = self.phase_end, "phase"
            if self.heap and self.heap[0][0] < t_next:
                t_next, what = self.heap[0][0], "arrive"
            if nxt is not None and nxt.t < t_next:
                t_next, what = nxt.t, "failure"
            self._advance(t_next)
            if what == "end":
                break
            if what == "target":
                self.progress = target
                done = True
                break
            if what == "failure":
                assert nxt is not None
                self._on_failure(nxt)
                nxt = next(events, None)
            elif what == "arrive":
                _, _, kind, slot = heapq.heappop(self.heap)
                self._on_arrive(kind, slot)
            elif what == "phase":
                self._on_phase_end()
            elif what == "join":
                self.progress = round(self.progress)
                self.joining, self.ready = self.ready, set()
                self._enter(REGROUP, self.cfg.costs.regroup_s)
            else:  # checkpoint
                self.progress = round(self.progress)
                t_ext = min(horizon, nxt.t if nxt is not None else math.inf)
                if self.heap:
                    t_ext = min(t_ext, self.heap[0][0])
                self._skip_quiet_cycles(t_ext, target)
                self.run_since_ckpt = 0.0
                self._enter(SAVING, cfg.checkpoint.save_s)
        return self._result(self.t if done else None)

    def _skip_quiet_cycles(self, t_ext: float, target: float) -> None:
        """At a checkpoint start, jump over whole (save, compute) cycles that end before
        the next outside event: they are all alike, so do them in closed form."""
        ck = self.cfg.checkpoint
        self._resolve_pending()
        if self.ready or self.pending is not None:
            return
        st = self.step_time
        steps = max(1, math.ceil(self.interval / st - _EPS))  # steps per cycle
        run = steps * st
        if ck.persist_s > run:  # each checkpoint must be durable before the next one starts
            return
        cycle = ck.save_s + run
        m = math.floor((t_ext - self.t) / cycle) - 1  # keep a margin: the next event is later
        if target < math.inf:
            m = min(m, math.floor((target - self.progress) / steps) - 1)
        if m < 1:
            return
        self.buckets[SAVING] += m * ck.save_s
        self.buckets[RUNNING] += m * run
        self.busy_accel_s += self.n_active * self.apr * m * run
        self.ckpt_progress = self.progress + (m - 1) * steps
        self.progress += m * steps
        self.live = run
        self.live_accel = self.n_active * self.apr * run
        self.t += m * cycle

    def _enter(self, phase: int, duration: float) -> None:
        self.phase = phase
        self.phase_end = self.t + duration

    def _enter_running(self) -> None:
        self.phase = RUNNING
        self.phase_end = math.inf
        self.n_active = len(self.active)
        self.step_time = self._step_time(self.n_active)

    def _push(self, t: float, kind: int, slot: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, slot))

    # -- events -------------------------------------------------------------
    def _on_failure(self, ev: FailureEvent) -> None:
        self.failures += 1
        hit: set[int] = set()
        detect = self.detect_s if ev.detect_s is None else ev.detect_s
        for slot, delay in zip(ev.slots, ev.delays, strict=True):
            if slot >= self.hosts:  # a spare host
                j = slot - self.hosts
                if self.spare_ok[j]:
                    self.spare_ok[j] = False
                    self.spare_ready.remove(j)
                    self._push(self.t + detect + delay, _SPARE_ARRIVE, j)
                continue
            if not self.slot_ok[slot]:
                continue  # nothing there: still waiting for its replacement
            self.slot_ok[slot] = False
            self.host_failures += 1
            if self.spare_ready:
                j = self.spare_ready.pop()
                self.spare_ok[j] = False
                self._push(self.t + detect + delay, _SPARE_ARRIVE, j)
                self._push(self.t + detect + self.swap_s, _ARRIVE, slot)
            else:
                self._push(self.t + detect + delay, _ARRIVE, slot)
            r = slot // self.hpr
            self.missing[r] += 1
            self.ready.discard(r)
            if r in self.active or r in self.joining:
                hit.add(r)
        if hit:
            self._interrupt(hit, detect)

    def _interrupt(self, hit: set[int], detect: float) -> None:
        self.interruptions += 1
        if self.phase == RUNNING:
            whole = math.floor(self.progress + _EPS)
            frac = self.progress - whole
            if frac > _EPS:  # the in-flight step is lost
                x = min(frac * self.step_time, self.live)
                self.live -= x
                xa = min(x * self.n_active * self.apr, self.live_accel)
                self.live_accel -= xa
                self.lost_accel_s += xa
                self.buckets[0] -= x
                self.buckets[LOST] += x
                self.lost_steps += frac
            self.progress = float(whole)
        if self.phase == SAVING:  # abandoned, never written: take it again when running
            self.run_since_ckpt = self.interval
        self.active -= hit
        self.ready |= self.joining - hit  # complete, but not healed: they join later
        self.joining = set()
        if self.rigid:
            self.ready |= self.active
            self.active = set()
        if not self.active and not self.need_restore:
            self._rollback()
            self.need_restore = True
        if self.phase != WAIT:
            self._enter(DETECT, detect)

    def _resolve_pending(self) -> None:
        if self.pending is not None and self.pending[0] <= self.t + _EPS:
            _, progress, live, live_accel = self.pending
            self.ckpt_progress = progress
            self.live -= live
            self.live_accel -= live_accel
            self.pending = None

    def _rollback(self) -> None:
        self._resolve_pending()
        self.pending = None
        self.rollbacks += 1
        self.buckets[0] -= self.live
        self.buckets[LOST] += self.live
        self.lost_steps += self.progress - self.ckpt_progress
        self.lost_accel_s += self.live_accel
        self.live = self.live_accel = 0.0
        self.progress = self.ckpt_progress

    def _on_arrive(self, kind: int, slot: int) -> None:
        if kind == _SPARE_ARRIVE:
            self.spare_ok[slot] = True
            self.spare_ready.append(slot)
            return
        self.slot_ok[slot] = True
        r = slot // self.hpr
        self.missing[r] -= 1
        if self.missing[r] == 0:
            self.ready.add(r)
            if self.phase == WAIT:
                self._try_resume()

    def _try_resume(self) -> None:
        """After detection (or on an arrival while waiting): go on if enough replicas."""
        if self.need_restore:
            if len(self.ready) >= self.min_replicas:
                self.joining, self.ready = self.ready, set()
                self._enter(RESTART, self.cfg.costs.restart_s)
                return
        elif len(self.active) + len(self.ready) >= self.min_replicas:
            self.joining, self.ready = self.ready, set()
            self._enter(REGROUP, self.cfg.costs.regroup_s)
            return
        self._enter(WAIT, math.inf)

    def _on_phase_end(self) -> None:
        phase = self.phase
        if phase == DETECT:
            self._try_resume()
        elif phase == RESTART:
            self._enter(RESTORE, self.cfg.checkpoint.restore_s)
        elif phase == RESTORE:
            self.active, self.joining = self.joining, set()
            self.need_restore = False
            self.run_since_ckpt = 0.0
            self._enter_running()
        elif phase == REGROUP:
            if self.joining:
                self._enter(HEAL, self.heal_s)
            else:
                self._enter_running()
        elif phase == HEAL:
            self.active |= self.joining
            self.joining = set()
            self._enter_running()
        elif phase == SAVING:
            self._resolve_pending()
            durable = self.t + self.cfg.checkpoint.persist_s
            self.pending = (durable, self.progress, self.live, self.live_accel)
            self._resolve_pending()
            self._enter_running()
        else:  # pragma: no cover - RUNNING and WAIT have no timed end
            raise AssertionError(f"phase {phase} has no end")

    def _result(self, time_to_train: float | None) -> SimResult:
        cfg = self.cfg
        wall = self.t
        held = cfg.topology.accelerators + cfg.spare_accelerators
        p = cfg.power
        energy = self.busy_accel_s * p.busy_w + (held * wall - self.busy_accel_s) * p.idle_w
        useful = self.progress * cfg.workload.step_s * cfg.topology.accelerators * p.busy_w
        return SimResult(
            strategy=cfg.strategy.kind,
            accelerators=cfg.topology.accelerators,
            spare_accelerators=cfg.spare_accelerators,
            seed=cfg.seed,
            wall_s=wall,
            buckets=dict(zip(BUCKETS, self.buckets, strict=True)),
            steps=self.progress,
            step_s=cfg.workload.step_s,
            checkpoint_interval_s=self.interval,
            failures=self.failures,
            host_failures=self.host_failures,
            interruptions=self.interruptions,
            rollbacks=self.rollbacks,
            lost_steps=self.lost_steps,
            busy_accelerator_s=self.busy_accel_s,
            lost_accelerator_s=self.lost_accel_s,
            energy_j=energy,
            badput_energy_j=max(0.0, energy - useful),
            time_to_train_s=time_to_train,
        )

"""Heal rate against a plain gloo broadcast of the same bytes, side by side (issues 16, 18, 42).

Run from the repository root:

    .venv/bin/python benchmarks/heal_rate.py [--quick] [--no-record] [--senders 1,2]
        [--reps N] [--dim D --layers L --heads H] [--min-stripe-mib M]

The target (issue 42): a replacement's heal in digest mode (the default
`heal_auth`) runs at >= 80% of a plain gloo broadcast of the same bytes over
the same loopback, measured in the same run; the mac mode's rate is reported
beside it (issues 16 and 18 asked >= 50% of it, before the digest existed).
recovery.py and sharded.py measure it inside a whole job (minutes, one heal per
run); this measures just the transfer, many times, so that a change to the heal
code can be judged in a minute or two.

For each sender count S (`--senders`, default 1 and 2: a sharded 2x2 job heals
its dead rank's shard from its one twin; a replicated job stripes across all
survivors), S + 1 processes (_jobs/heal_rate_job.py) hold the demo GPT with
AdamW (default dim 256, 4 layers, 4 heads: about 39 MB of model and optimizer
state, the shard a 2x2 sharded.py replacement heals). The heals stripe the
payload as the trainers' `heal_with` does: over as many senders as give each
stripe at least `--min-stripe-mib` MiB (default `STRIPE_MIN_BYTES`, 64 MiB:
the 39 MB state then comes from one sender, the other kept for a stripe that
fails; 0 stripes over every sender, as before 2026-12-07). After one warm-up each,
`--reps` rounds run, each of five measurements after a barrier (so the
machine's load hits all five alike):

- warm: a plain gloo broadcast of a uint8 tensor of the heal's payload bytes
  from a sender to the receiver (their own 2-rank group), into memory the
  receiver touched before: the link rate, the target's reference;
- fresh: the same into memory the receiver allocated just before (a heal's
  receiver lands its state in memory it has not touched yet);
- heal: `elastrain.transfer.heal` of the TorchState from the S senders into
  the receiver in digest mode (manifest sealed under a job key, verdicts,
  stripes, the root's state digest sealed after them, the receiver's digest of
  what landed, install: the code the trainers run, in place as `heal_with`
  runs it: the model's entries land straight in the receiver's live tensors),
  timed on the receiver from the
  barrier to the end of its call. It lands in a `LandingReserve` the receiver
  mapped and touched before the barrier (untimed: the trainer's joiner
  prepares it while it waits to be admitted), where it laid out the layout it
  expects (`PreparedReceive`, untimed: the replicated trainer's receiver does it
  at the generation's connect; both preparations' time reported apart), from senders that flattened and laid out their state, the
  root (rank 0) also computing its state digest, before the barrier
  (`PreparedSend`, untimed: the replicated trainer's senders do it while the
  generation's group is built; the root's time reported apart);
- mac: the same heal in mac mode (every stripe sealed with Poly1305), into a
  reserve prepared the same way, from senders whose flatten and layout were prepared;
- cold: the digest heal with neither: landing in memory the receiver has not
  touched, the senders flattening and the root digesting at the heal (what every heal did
  before the reserve and the preparation);
- floor: the authenticated floor, the least any heal that authenticates its
  bytes must do: sender rank 0 seals the payload bytes with Poly1305 in 4 MiB
  pieces and sends each once sealed, the receiver checks each piece's tag as
  it arrives; nothing else (the bytes stay where they landed: no install copy,
  no manifest, no per-tensor work). Where the floor itself is below the
  target, no heal that authenticates its bytes can meet the target on this
  machine; "heal / floor" says how much of the floor the heal reaches;
- dfloor: the digest floor, the least a heal checked by the state digest must
  do once its root's digest is prepared: the payload in 1 MiB pieces (the
  size of the heal's own messages of this state) sent unsealed, the receiver
  hashing each (XXH3-128) as it lands; "heal / digest floor" says how
  much of it the heal reaches.

Every process runs with MALLOC_MMAP_THRESHOLD_=131072 (glibc's default, pinned)
so that each large allocation is fresh memory, as in a replacement's first heal
(without it glibc raises the threshold after the first free and later heals
would land in recycled, already touched pages). The receiver checks its state
hash against the senders' after the last round.

Reported per S: median MB/s of each, the heal's rate against the warm broadcast
(ratio of medians; and the median of per-round ratios, which a load swing
between rounds moves less), the cold heal's against the warm broadcast, the heal's payload phase alone
(`HealStats.payload_s`) as a rate and against the warm broadcast, the
milliseconds of the heal outside it (flatten, manifest rounds, install), the
reserve's preparation in milliseconds, CPU milliseconds of all processes per
operation, the receiver process's first heal (timed alone, before the rounds:
what a replacement's one heal meets, cold code paths) against the warm broadcast, and PASS/FAIL for heal >= 80% of warm (the
rounds' median). Prints the table, then as its last line
``heal/broadcast: <digest ratio> (mac <ratio>)`` for the sender count whose
digest ratio is lowest, and records
the run (benchmarks/results/) with date, machine, load, command and commit
(unless --no-record). --quick (S = 1, a 10 MB state, 3 rounds) is a smoke run
and never records. About 1 minute on the 2-core machine (--quick: 10 s).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from _harness import Bench, Figure, fmt, log, med, table, target  # noqa: E402
from _steady import JOBS, kill_all  # noqa: E402

from elastrain.transfer.manifest import STRIPE_MIN_BYTES, stripe_senders  # noqa: E402

TARGET = 0.8
"""The digest heal's rate as a fraction of the warm broadcast's (issue 42)."""
KINDS = ("warm", "fresh", "heal", "mac", "cold", "floor", "dfloor")
FULL: dict[str, int | str] = {"dim": 256, "layers": 4, "heads": 4, "reps": 20, "senders": "1,2"}
QUICK: dict[str, int | str] = {"dim": 128, "layers": 2, "heads": 4, "reps": 3, "senders": "1"}
MMAP_THRESHOLD = "131072"
"""glibc's default mmap threshold, pinned (see the module docstring)."""


def run_one(
    senders: int,
    shape: tuple[int, int, int],
    reps: int,
    out_dir: Path,
    timeout_s: float,
    min_stripe: int,
) -> dict[str, Any]:
    """Run the S + 1 job processes once; per rank, their JSON (`_jobs/heal_rate_job.py`)."""
    import torch.distributed as dist

    out_dir.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore(
        "127.0.0.1", 0, senders + 2, is_master=True, timeout=dt.timedelta(seconds=120),
        wait_for_workers=False,
    )  # fmt: skip
    prefix = out_dir / f"s{senders}"
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    argv = [str(senders), str(store.port), *(str(x) for x in shape), str(reps), str(prefix),
            str(min_stripe)]  # fmt: skip
    procs = []
    try:
        for r in range(senders + 1):
            with open(out_dir / f"s{senders}-r{r}.log", "wb") as logf:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(JOBS / "heal_rate_job.py"), str(r), *argv],
                        stdout=logf, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                    )
                )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        # Poll, so that one crashed process ends the run at once (its peers would
        # otherwise wait out gloo's timeout).
        while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{senders} sender(s): timed out after {timeout_s:.0f} s")
            time.sleep(0.1)
        rcs = [p.poll() for p in procs]
    finally:
        kill_all(procs)
    if any(rcs):
        raise RuntimeError(f"{senders} sender(s): job exit codes {rcs}; see {out_dir}")
    ranks = [json.loads(Path(f"{prefix}.{r}").read_text()) for r in range(senders + 1)]
    return summarize(ranks)


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Rates (MB/s, the receiver's wall time) and CPU (all ranks) per kind and round."""
    recv = ranks[-1]
    nbytes = recv["bytes"]
    rounds = len(recv["seconds"]["heal"])
    rates = {k: [nbytes / 1e6 / s for s in recv["seconds"][k]] for k in KINDS}
    cpu = {k: [sum(r["cpu"][k][i] for r in ranks) for i in range(rounds)] for k in KINDS}
    per_round = {
        ref: [h / w for h, w in zip(rates["heal"], rates[ref], strict=True)]
        for ref in ("warm", "fresh")
    }
    first = nbytes / 1e6 / recv["first"][0]
    # The receiver's heal split in two: moving the payload, and the rest (flatten,
    # manifest rounds, install), from `HealStats.payload_s`.
    payload = [nbytes / 1e6 / s for s in recv["payload_s"]["heal"]]
    mac_payload = [nbytes / 1e6 / s for s in recv["payload_s"]["mac"]]
    outside = [
        h - s for h, s in zip(recv["seconds"]["heal"], recv["payload_s"]["heal"], strict=True)
    ]
    return {
        "bytes": nbytes,
        "rates": rates,
        "cpu": cpu,
        "per_round": per_round,
        "first": first,
        "payload": payload,
        "mac_payload": mac_payload,
        "outside": outside,
        "prepare_s": recv["prepare_s"],
        "predicted": {k: (sum(v), len(v)) for k, v in recv["predicted"].items()},
        "root_prepare_s": ranks[0]["digest_prepare_s"],
    }


def rows_of(senders: int, r: dict[str, Any]) -> list[list[str]]:
    m = {k: med(r["rates"][k]) for k in KINDS}
    ratio = m["heal"] / m["warm"]
    return [
        [
            str(senders),
            fmt(r["bytes"] / 1e6, 1),
            fmt(m["warm"], 0),
            fmt(m["fresh"], 0),
            fmt(m["heal"], 0),
            f"{fmt(min(r['rates']['heal']), 0)} / {fmt(max(r['rates']['heal']), 0)}",
            fmt(ratio, 2),
            fmt(med(r["per_round"]["warm"]), 2),
            f"{fmt(m['mac'], 0)} ({fmt(m['mac'] / m['warm'], 2)})",
            f"{fmt(med(r['mac_payload']), 0)} ({fmt(med(r['mac_payload']) / m['warm'], 2)})",
            f"{fmt(m['cold'], 0)} ({fmt(m['cold'] / m['warm'], 2)})",
            f"{fmt(med(r['payload']), 0)} ({fmt(med(r['payload']) / m['warm'], 2)})",
            fmt(med(r["outside"]) * 1e3, 1),
            f"{fmt(med(r['prepare_s']) * 1e3, 1)} / {fmt(r['prepare_s'][0] * 1e3, 1)}",
            fmt(med(r["root_prepare_s"]) * 1e3, 1),
            " / ".join(fmt(med(r["cpu"][k]) * 1e3, 1) for k in KINDS),
            f"{fmt(r['first'], 0)} ({fmt(r['first'] / m['warm'], 2)})",
            f"{fmt(m['floor'], 0)} ({fmt(m['floor'] / m['warm'], 2)})",
            fmt(m["heal"] / m["floor"], 2),
            f"{fmt(m['dfloor'], 0)} ({fmt(m['dfloor'] / m['warm'], 2)})",
            fmt(m["heal"] / m["dfloor"], 2),
            "PASS" if ratio >= TARGET else "FAIL",
        ]
    ]


HEADER = [
    "senders",
    "MB",
    "warm bcast MB/s",
    "fresh bcast MB/s",
    "heal MB/s",
    "heal min / max",
    "heal / warm",
    "per-round heal / warm",
    "mac heal MB/s (/ warm)",
    "mac payload MB/s (/ warm)",
    "cold heal MB/s (/ warm)",
    "heal payload MB/s (/ warm)",
    "heal outside payload ms",
    "reserve touched ms: rounds / first",
    "root prepared ms",
    "CPU ms warm / fresh / heal / mac / cold / floor / dfloor",
    "first heal MB/s (/ warm)",
    "authenticated floor MB/s (/ warm)",
    "heal / floor",
    "digest floor MB/s (/ warm)",
    "heal / digest floor",
    f">= {TARGET:.0%} of warm",
]


def main() -> int:
    bench = Bench("heal_rate.py", __doc__, quick="smoke run: 10 MB, 3 rounds")
    ap = bench.ap
    ap.add_argument("--senders", help="comma-separated sender counts (default 1,2)")
    ap.add_argument("--reps", type=int, help="timed rounds per sender count (default 20)")
    ap.add_argument("--dim", type=int, help="demo GPT width (default 256)")
    ap.add_argument("--layers", type=int, help="demo GPT layers (default 4)")
    ap.add_argument("--heads", type=int, help="demo GPT heads (default 4)")
    ap.add_argument(
        "--min-stripe-mib", type=float, default=STRIPE_MIN_BYTES / (1 << 20),
        help="least MiB per sender's stripe (stripe_senders; default the trainers'; 0: every sender)",
    )  # fmt: skip
    args = bench.parse()
    base = QUICK if args.quick else FULL
    dim, layers, heads, reps = (
        int(getattr(args, k) if getattr(args, k) is not None else base[k])
        for k in ("dim", "layers", "heads", "reps")
    )
    try:
        senders = [int(x) for x in (args.senders or str(base["senders"])).split(",") if x]
    except ValueError:
        ap.error(f"--senders takes comma-separated integers, got {args.senders!r}")
    if not senders or min(senders) < 1:
        ap.error("--senders: each count must be at least 1")
    if reps < 1 or dim < 1 or layers < 1 or heads < 1 or dim % heads:
        ap.error("--reps, --dim, --layers, --heads must be positive, and dim a multiple of heads")

    if args.min_stripe_mib < 0:
        ap.error("--min-stripe-mib must be >= 0")
    min_stripe = int(args.min_stripe_mib * (1 << 20))
    t_wall0 = time.time()
    load = bench.load
    assert load is not None
    out_dir = bench.run_dir("heal-rate")
    log(
        f"load average now {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; logs under {out_dir}"
    )
    res: dict[int, dict[str, Any]] = {}
    loads: dict[int, float] = {}
    for s in senders:
        t_w = time.time()
        try:
            res[s] = run_one(s, (dim, layers, heads), reps, out_dir, 60.0 + 20.0 * reps, min_stripe)
        except RuntimeError as err:
            print(f"\nFATAL: {err}; nothing recorded.")
            load.stop()
            return 1
        loads[s] = load.mean(t_w, time.time())
        log(f"{s} sender(s): heal {fmt(med(res[s]['rates']['heal']), 0)} MB/s, warm broadcast "
            f"{fmt(med(res[s]['rates']['warm']), 0)} MB/s")  # fmt: skip

    t = table(HEADER, [row for s, r in res.items() for row in rows_of(s, r)])
    notes = [
        f"state: the demo GPT, dim {dim}, {layers} layers, {heads} heads, context 64, with "
        "AdamW after one step (model + optimizer state, as a heal moves it); the receiver "
        "starts from another seed with no optimizer state",
        f"striping: over as many senders as give each stripe >= {args.min_stripe_mib:g} MiB "
        "(stripe_senders, as the trainers' heal_with; 0: every sender), so "
        + ", ".join(
            f"{s} sender(s): {stripe_senders(res[s]['bytes'], s, min_stripe)} stripe(s)"
            for s in res
        ),
        f"{reps} rounds per sender count, each: warm broadcast, fresh broadcast, heal (digest), "
        "mac heal, cold heal, floor, digest floor, each after a barrier; rates are the payload bytes over the receiver's wall time from the "
        "barrier to its end of the operation; medians over rounds",
        "broadcast: one uint8 tensor of the payload's bytes, from sender rank 0 to the "
        "receiver in a 2-rank gloo group of their own; warm: into memory touched before; "
        "fresh: into a tensor allocated just before",
        "heal: elastrain.transfer.heal in digest mode (the default heal_auth: the manifest "
        "sealed under a job key; the root's state digest, sealed likewise, follows its "
        "stripes; the receiver hashes what lands and compares before installing) of model + optimizer from "
        "the senders, striped, into the receiver, installed; in place, as the trainers' "
        "heal_with runs it (the model's entries land straight in the receiver's live "
        "tensors, no install copy; the optimizer's in the reserve); mac heal: the same with "
        "heal_auth=mac (every stripe sealed with Poly1305, checked on arrival); the receiver's state hash equals "
        "the senders' after the last round (checked). The heal lands in a LandingReserve "
        "the receiver mapped and touched before the barrier, sized by its "
        "TorchState.landing_estimate() (what a joiner does while it waits to be admitted), "
        "where it laid out the layout it expects (PreparedReceive, what the replicated "
        "trainer's receiver does at the generation's connect; 'reserve touched': both "
        "preparations' time, off the clock, median over rounds and the first's), from senders that flattened and laid out their state, the root "
        "(rank 0) also computing its digest, before the barrier (PreparedSend, what the "
        "replicated trainer's senders do while the generation's group is built; 'root "
        "prepared': the root's time for it in digest mode, off the clock, median); the cold "
        "heal has neither: it lands in memory the receiver has not touched and its senders "
        "flatten and its root digests at the heal (as every heal did before)",
        f"every process: MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} (large allocations are "
        "fresh memory, as in a replacement's first heal), torch.set_num_threads(1), gloo "
        "over loopback",
        "heal payload: the payload bytes over the receiver's payload phase alone "
        "(HealStats.payload_s: stripes (and mac seals) sent, received and checked, the "
        "outcome; 'mac payload' the same for the mac heal); outside payload: the rest of "
        "its heal (flatten, the manifest rounds with the senders' staging and the landing's "
        "allocation overlapping the verdict's, the install), medians over rounds",
        "CPU: utime + stime of all processes of the heal (or of the broadcast's two) per "
        "operation, median over rounds",
        "authenticated floor: the least a heal that authenticates its bytes must do, with "
        "nothing else: sender rank 0 seals the payload bytes with Poly1305 (the MAC of the "
        "heal's stripe seals) in 4 MiB pieces, sending each as soon as it is sealed; the "
        "receiver checks each piece's tag as it arrives, into memory touched before, and "
        "leaves the bytes where they landed (no install copy, no manifest, no per-tensor "
        "work), one sender; heal / floor: how much of that the heal reaches",
        "digest floor: the least a heal checked by the state digest must do with its root's "
        "digest prepared: the payload in 1 MiB pieces (the heal's own messages of this state "
        "are at most that) sent unsealed, the receiver hashing each "
        "(XXH3-128) as it lands, one sender; heal / digest floor: how much of that the heal "
        "reaches",
        "first heal: the receiver process's first heal (one per sender count, timed from a "
        "barrier like the rounds, before them), with a reserve estimated from its fresh "
        "optimizer as a replacement's: cold code paths, as in a replacement; the rounds' "
        "heals come after it",
        "machine load (1-min load average): "
        + ", ".join(f"{loads[s]:.1f} during {s} sender(s)" for s in res)
        + f"; {load.mean(t_wall0, time.time()):.1f} mean over the benchmark",
        f"logs {out_dir.relative_to(ROOT) if out_dir.is_relative_to(ROOT) else out_dir}",
    ]
    notes.append(
        "the receiver's manifest had the layout it laid out ahead (HealStats.predicted): "
        + "; ".join(
            f"{s} sender(s): " + ", ".join(f"{k} {n}/{of}" for k, (n, of) in r["predicted"].items())
            for s, r in res.items()
        )
    )
    anomalies = [
        f"{s} sender(s): heal at {fmt(med(r['rates']['heal']) / med(r['rates']['warm']), 2)} "
        f"of the warm broadcast, below the {TARGET:.0%} target"
        for s, r in res.items()
        if med(r["rates"]["heal"]) < TARGET * med(r["rates"]["warm"])
    ]
    notes += [
        f"{s} sender(s): the authenticated floor itself runs at "
        f"{fmt(med(r['rates']['floor']) / med(r['rates']['warm']), 3)} of the warm broadcast, "
        f"below the {TARGET:.0%} target: no heal that MACs its bytes (Poly1305) "
        "meets it on this machine"
        for s, r in res.items()
        if med(r["rates"]["floor"]) < TARGET * med(r["rates"]["warm"])
    ]
    notes += [
        f"{s} sender(s): the digest floor itself runs at "
        f"{fmt(med(r['rates']['dfloor']) / med(r['rates']['warm']), 3)} of the warm broadcast, "
        f"below the {TARGET:.0%} target: no heal that hashes what lands meets it on this machine"
        for s, r in res.items()
        if med(r["rates"]["dfloor"]) < TARGET * med(r["rates"]["warm"])
    ]
    print()
    print(t)
    print()
    import torch

    def ratio(r: dict[str, Any], kind: str) -> float:
        return med(r["rates"][kind]) / med(r["rates"]["warm"])

    figures = [
        f for n, r in res.items() for f in (
            Figure(f"heal_mb_s[{n}]", f"heal rate, {n} sender(s)", med(r["rates"]["heal"]), "MB/s"),
            Figure(f"heal_over_warm[{n}]", f"heal / warm loopback broadcast, {n} sender(s)",
                   ratio(r, "heal"), ""),
            Figure(f"mac_over_warm[{n}]",
                   f"mac-mode heal / warm loopback broadcast, {n} sender(s)", ratio(r, "mac"), ""),
            Figure(f"floor_over_warm[{n}]",
                   f"authenticated floor / warm loopback broadcast, {n} sender(s)",
                   ratio(r, "floor"), ""),
            Figure(f"dfloor_over_warm[{n}]",
                   f"digest floor / warm loopback broadcast, {n} sender(s)",
                   ratio(r, "dfloor"), ""),
            Figure(f"cold_over_warm[{n}]",
                   f"cold heal (no reserve, no preparation) / warm loopback broadcast, "
                   f"{n} sender(s)", ratio(r, "cold"), ""),
        )
    ]  # fmt: skip
    targets = [
        target(f"heal rate (digest), {n} sender(s)", f">= {TARGET:g} of a warm loopback broadcast",
               f"{ratio(r, 'heal'):.2f}", ratio(r, "heal") >= TARGET)
        for n, r in res.items()
    ]  # fmt: skip
    bench.finish(f"torch {torch.__version__}, gloo over loopback", figures, targets, notes, t,
                 anomalies)  # fmt: skip
    if args.quick:
        print("\n(--quick smoke run: not recorded, and no number in it means anything)")
    for n, r in res.items():
        print(f"{n} sender(s): heal/broadcast {ratio(r, 'heal'):.2f} (mac {ratio(r, 'mac'):.2f})")
    worst = min(res.values(), key=lambda r: ratio(r, "heal"))
    print(f"heal/broadcast: {ratio(worst, 'heal'):.2f} (mac {ratio(worst, 'mac'):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The torchrun side of benchmarks/versus.py: DDP with a checkpoint every K steps.

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 5 \
        --monitor-interval 0.1 torchrun_gpt.py --out DIR --steps S --ckpt-every K [shape]

How most users run fault-tolerant training today, set up the way an expert would:

- torchrun restarts every worker when one dies (`--max-restarts`); each
  restart round builds its gloo group on `PrefixStore("attempt_<n>", store)`
  (n = TORCHELASTIC_RESTART_COUNT), so that a restarted worker never reads the
  dead round's addresses from the agent's shared store (see
  /work/shared/PEERS.md: without it, 4-worker restarts fail or hang).
- Rank 0 writes a checkpoint (model, optimizer, next step) every K steps with
  torch.save to a temporary file and an atomic rename; on start every rank
  resumes from it when it exists.
- The data order is elastrain's (a seeded global order, step s takes positions
  [s*B, (s+1)*B), micro-batches split by `assign_microbatches`), each
  micro-batch under the same reseeded RNG, the loss scaled so that DDP's mean
  over ranks is sum / global batch: the same math as the elastrain job.

The replacement delay: when the benchmark kills a worker it writes
`DIR/replace.json` ({"attempt": n, "rank": r, "delay_s": d}); in restart round
n, rank r sleeps d seconds before starting (standing in for scheduling the
replacement pod); the other ranks wait for it in the rendezvous and in the
group's construction.

Writes `DIR/r<rank>.jsonl` (see steplog.py): start, ready, commit per step
(`loss` is this rank's mean over its samples), checkpoint.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "_jobs"))

from steplog import StepLog  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt-every", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--block", type=int, required=True)
    ap.add_argument("--batch", type=int, required=True)
    ap.add_argument("--micro", type=int, required=True)
    a = ap.parse_args()
    out = Path(a.out)
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = StepLog(out / f"r{rank}.jsonl", f"r{rank}", attempt=attempt)
    log.emit("start", T_START)
    rep = out / "replace.json"
    if attempt > 0 and rep.exists():
        r = json.loads(rep.read_text())
        if int(r["attempt"]) == attempt and int(r["rank"]) == rank:
            time.sleep(float(r["delay_s"]))
            log.emit("replaced", time.time(), delay_s=float(r["delay_s"]))

    import torch
    import torch.distributed as dist
    from common import Shape, build, loss_fn, micro_rng_seed
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import default_collate

    from elastrain.data import GlobalOrder, assign_microbatches, step_microbatches

    torch.set_num_threads(1)
    shape = Shape(a.dim, a.layers, a.heads, a.block, a.batch, a.micro)
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=rank,
        world_size=world, timeout=datetime.timedelta(seconds=600),
    )  # fmt: skip
    model, opt, data = build(shape)
    ckpt = out / "ckpt.pt"
    start = 0
    if ckpt.exists():
        st = torch.load(ckpt, weights_only=True)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        start = int(st["step"])
    ddp = DDP(model)
    order = GlobalOrder(len(data), shape.seed, shuffle=True)
    B, W = shape.global_batch, world
    log.emit("ready", time.time(), resumed=start)
    for s in range(start, a.steps):
        t0 = time.monotonic()
        mbs = step_microbatches(s, B, shape.micro_batch)
        mine = assign_microbatches(len(mbs), W, rank)
        loss_sum, n = 0.0, 0
        for k, i in enumerate(mine):
            ids = order.ids(mbs[i].start, mbs[i].stop)
            ctx = contextlib.nullcontext() if k == len(mine) - 1 else ddp.no_sync()
            with ctx, torch.random.fork_rng(devices=[]):
                torch.manual_seed(micro_rng_seed(shape.seed, s, i))
                batch = default_collate([data[j] for j in ids])
                loss = loss_fn(ddp, batch)
                # DDP averages over W ranks: scale so the result is sum / global batch.
                (loss * (len(ids) * W / B)).backward()
            loss_sum += float(loss.detach()) * len(ids)
            n += len(ids)
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.emit(
            "commit", time.time(), step=s, loss=loss_sum / max(1, n), n=n,
            step_s=time.monotonic() - t0,
        )  # fmt: skip
        if rank == 0 and (s + 1) % a.ckpt_every == 0 and s + 1 < a.steps:
            tc = time.monotonic()
            tmp = out / "ckpt.pt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": s + 1}, tmp)
            os.replace(tmp, ckpt)
            log.emit("checkpoint", time.time(), step=s + 1, seconds=time.monotonic() - tc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

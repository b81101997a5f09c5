"""What the test job scripts share, so that each one keeps only what it tests.

The sharded family (train_sharded.py, train_sharded_step.py,
train_sharded_carry.py, train_raising.py): the residual network with a block
list, its regression data and loss, the model and AdamW every member builds
from seed 0, the trainer arguments (`sharded_arguments`) and the
`TrainerConfig` they make (`sharded_config`). The JAX family
(train_jax_mlp.py, train_jax_replicas.py): the soak's MLP job (`jax_mlp_job`).
Both: `Pace`, the minimum step time a test holds a job to.

The scripts run with their own directory first on sys.path (`elastrain run`'s
worker puts it there; the tests that import the model insert it), so they
import this module by name. It imports no JAX at module level: the torch
scripts do not load it, and the JAX job sets XLA_FLAGS before JAX loads.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from elastrain import TrainerConfig

if TYPE_CHECKING:
    from elastrain.jax import JaxElasticTrainer


# ---- the sharded family's model and data ---------------------------------------------


class Regression(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = 2048, d: int = 12, seed: int = 99) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d, generator=g)
        self.y = torch.sin(self.x[:, :3].sum(1, keepdim=True)) + 0.05 * torch.randn(
            n, 1, generator=g
        )

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 3 * d)
        self.down = nn.Linear(3 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(torch.tanh(self.up(self.norm(h)))))


class Net(nn.Module):
    """Its blocks sit in an `nn.ModuleList`, so each one is an FSDP2 unit; dims are
    chosen so that some parameters do not split evenly (padded shards)."""

    def __init__(self, d_in: int = 12, d: int = 37, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(depth))
        self.head = nn.Linear(d, 1)
        # Not persistent, not a parameter: must reach every FSDP2 wrapper intact.
        self.register_buffer("scale", torch.tensor([0.5]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h) * self.scale


def loss_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def sharded_model(on_meta: bool = False) -> tuple[Net, torch.optim.AdamW]:
    """One CPU thread, seed 0, the network and its AdamW: every member builds the
    same (``on_meta``: on the meta device; its state comes from a checkpoint or
    from its twins' heal)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = Net()
    else:
        model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)


def sharded_arguments(ap: argparse.ArgumentParser, steps: int) -> None:
    """The trainer arguments every sharded script takes (a script that wants
    another default sets it with ``ap.set_defaults``)."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--shard-size", type=int, default=1, help="TrainerConfig.shard_size")
    ap.add_argument("--ckpt-every", type=int, default=0, help="TrainerConfig.checkpoint_every")
    ap.add_argument("--hang-floor", type=float, default=3.0, help="watchdog floor (s)")
    ap.add_argument(
        "--reduce-dtype", default="auto", help="TrainerConfig.reduce_dtype (auto, float64, native)"
    )
    ap.add_argument(
        "--pace-file",
        default=None,
        help="a file holding a minimum step time in seconds, read every step (a test slows "
        "the job while it injects a fault and waits for the replacement)",
    )
    ap.add_argument(
        "--gated-members",
        default="",
        help="comma-separated member ids (replacements) that wait for --gate-file before they "
        "join (see wait_at_gate)",
    )
    ap.add_argument("--gate-file", default=None, help="the file that opens the gate")


def sharded_config(args: argparse.Namespace, **more: Any) -> TrainerConfig:
    """The sharded scripts' `TrainerConfig`: 24 samples a step in micro-batches of 3,
    seed 5, the arguments of `sharded_arguments`, and the script's own ``more``."""
    return TrainerConfig(
        global_batch_size=24,
        micro_batch_size=3,
        total_steps=args.steps,
        seed=5,
        shard_size=args.shard_size,
        checkpoint_every=args.ckpt_every,
        hang_timeout_floor_s=args.hang_floor,
        reduce_dtype=args.reduce_dtype,
        **more,
    )


# ---- both families ------------------------------------------------------------------


class Pace:
    """At least a minimum time per committed step: the number in ``file``, read
    every step, else ``minimum`` (a test slows a job while it injects a fault and
    waits for what follows, so that the steps do not outrun it)."""

    def __init__(self, file: str | None = None, minimum: float = 0.0) -> None:
        self.file = file
        self.minimum = minimum
        self.last = time.monotonic()

    def wait(self) -> None:
        """Called after each step: sleep out what is left of the step's pace."""
        pace = self.minimum
        if self.file:
            try:
                pace = float(Path(self.file).read_text())
            except (OSError, ValueError):
                pace = self.minimum
        if pace > 0:
            time.sleep(max(0.0, pace - (time.monotonic() - self.last)))
        self.last = time.monotonic()


def wait_at_gate(args: argparse.Namespace, timeout_s: float = 600.0) -> None:
    """Before joining: a member named in ``--gated-members`` waits until the test
    creates ``--gate-file``. A test that needs an order between its fault's
    aftermath and a replacement's arrival (a step committed with the dead rank's
    slot vacant, before the replacement takes it) opens the gate when its events
    show it; a replacement forked from the warm prefork server otherwise joins
    within a fraction of a second and may close that window first."""
    gated = [m for m in args.gated_members.split(",") if m]
    if os.environ.get("ELASTRAIN_MEMBER_ID", "") not in gated:
        return
    if not args.gate_file:
        raise SystemExit("--gated-members needs --gate-file")
    end = time.monotonic() + timeout_s
    while not Path(args.gate_file).exists():
        if time.monotonic() > end:
            raise SystemExit(f"the gate {args.gate_file} was not opened in {timeout_s:.0f} s")
        time.sleep(0.02)


# ---- the JAX family -----------------------------------------------------------------


def jax_arguments(ap: argparse.ArgumentParser, steps: int, hidden: int, pace_why: str) -> None:
    """The JAX scripts' arguments; ``pace_why``: what --min-step-s is for in that test."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument(
        "--min-step-s",
        type=float,
        default=0.0,
        help=f"pace: at least this long per committed step {pace_why}",
    )
    ap.add_argument(
        "--pace-file",
        default=None,
        help="a file holding a minimum step time in seconds, read every step, in place of "
        "--min-step-s while it exists (a test holds the job while it waits for a rebuilt "
        "replica, then lets it run at full speed)",
    )


def jax_mlp_job(args: argparse.Namespace, **more: Any) -> JaxElasticTrainer:
    """Train the soak's JAX MLP (dropout: the per-micro-batch keys matter) on a
    fixed regression set with optax Adam, paced by --pace-file (while it exists)
    or --min-step-s; a member that holds the final state writes its parameters to
    <run_dir>/final/<member>.npy (numpy, no pickle). ``more``: the script's own `TrainerConfig` fields."""
    # One XLA CPU thread per worker (several workers share two cores here): read
    # when JAX loads, which is below.
    os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
    import jax
    import numpy as np
    import optax

    from elastrain.chaos.soak_job_jax import init
    from elastrain.chaos.soak_job_jax import loss_fn as jax_loss
    from elastrain.chaos.soak_jobs import Regression as JaxRegression
    from elastrain.chaos.soak_jobs import save_final
    from elastrain.jax import JaxElasticTrainer

    params = init(jax.random.PRNGKey(0), 16, args.hidden)
    data = JaxRegression(n=4096, d=16, seed=1234)
    cfg = TrainerConfig(
        global_batch_size=24, micro_batch_size=4, total_steps=args.steps, seed=7, **more
    )
    trainer = JaxElasticTrainer(params, optax.adam(1e-2), data, jax_loss, cfg)
    pace = Pace(args.pace_file, minimum=args.min_step_s)
    for _ in trainer.steps():
        pace.wait()
    if trainer.holds_final_state:
        leaves = jax.tree_util.tree_leaves(trainer.params)
        save_final(trainer.member, np.concatenate([np.asarray(x).reshape(-1) for x in leaves]))
    return trainer

"""What the step engine needs from a framework: a `Backend` that only moves tensors.

The engine (`elastrain.runtime.engine`) owns the protocol: rendezvous,
verdicts, the watchdog, commit and abandon, leave, preemption, events, heal
and checkpoint scheduling. A backend owns one member's model replica and does
the arithmetic of a step on the engine's orders:

    begin_step()                       fresh or zeroed gradient buffers
    compute(step, i, batch, n)         forward/backward of micro-batch i, summed
    reduce_buffers()                   what the all-reduce sums (extras at the end of the first)
    apply()                            divide by the global batch, optimizer update (or skip it)
    discard()                          drop the buffers (an abandoned all-reduce may still write them)

and exposes its state as named buffers (`state()`, a `NamedState`) that heal
and checkpoints both read and write. `TorchBackend`
(`elastrain.runtime.torch_backend`) and `JaxBackend` (`elastrain.jax.backend`)
implement it. Nothing here depends on a framework but torch's tensor type,
which is the wire format of the gloo collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from elastrain.transfer.state import NamedState


class SkipReason(StrEnum):
    """Why a committed step did not update the state (the same on every member)."""

    NONFINITE = "nonfinite"
    """The reduced gradient held inf or nan (with a GradScaler: the scale overflowed)."""
    HOOK = "hook"
    """The script's `before_step` hook decided so."""


@dataclass(frozen=True)
class Update:
    """What `Backend.apply` did with a step's reduced gradient."""

    grad_norm: float | None = None
    """Global L2 norm of the mean gradient before clipping (None: not measured)."""
    skipped: SkipReason | None = None
    """None: the optimizer stepped. Otherwise the state did not change, and why."""


class Backend(Protocol):
    framework: str
    """"torch" or "jax": events and errors say which."""
    device: torch.device
    """The torch device the step's computation runs on: the transport choice (NCCL
    needs "cuda"), the NCCL group's device and the health check at start use it
    (a backend computing outside torch says where its wire buffers are: "cpu")."""

    def signature(self) -> list[list[Any]]:
        """The model's signature: the coordinator refuses a member whose differs from the job's."""

    def state(self) -> NamedState:
        """This member's whole training state as named buffers (model, optimizer, PRNG)."""

    def adopt(self, state: NamedState) -> None:
        """Make live what a heal or a resume installed into `state` (one `state()` gave)."""

    def state_hash(self) -> str:
        """A digest equal on two members iff their states are bit-identical."""

    def meta(self) -> dict[str, Any]:
        """JSON-able framework state that travels with a heal or a checkpoint (RNG, user extras)."""

    def load_meta(self, meta: dict[str, Any]) -> None:
        """Install what `meta` returned on the member that sent or saved it."""

    def problems(self) -> list[str]:
        """Well-known mistakes in how the script set this backend up (empty: none)."""

    def warm_up(self, batch: Any, extra_slots: int) -> None:
        """Compile or warm up once before registering (a joiner must not stall its peers);
        ``extra_slots``: what `begin_step` will be given, for buffers built ahead."""

    def begin_step(self, extra_slots: int) -> None:
        """Ready zeroed gradient buffers with `extra_slots` values at the end of the first
        reduce buffer (loss sum, sample count, the checkpoint schedule's measurements)."""

    def compute(self, step: int, microbatch: int, batch: Any, samples: int) -> float | torch.Tensor:
        """Forward and backward of one micro-batch (the gradient of the loss *sum*
        added into the step's buffers); returns its loss sum, a float or a float64
        0-dim tensor that the engine adds up and reads once per step (reading a
        CUDA tensor waits for the device: once a step, not once a micro-batch). Its
        randomness depends only on (seed, step, microbatch), never on membership."""

    def reduce_buffers(self) -> list[torch.Tensor]:
        """The CPU tensors the step's all-reduce sums in place, in a fixed order."""

    def extras(self) -> torch.Tensor:
        """The view of the extra slots at the end of the first reduce buffer."""

    def apply(self) -> Update | None:
        """Divide the summed gradient by the global batch and update the parameters, or
        skip the update (the step commits either way). Every member decides alike: its
        inputs are the same everywhere. None: updated, nothing measured."""

    def discard(self) -> None:
        """Forget the step's buffers: an abandoned all-reduce may still write into them."""

    def count_flops(self, batch: Any, micro_batch: int, global_batch: int) -> dict[str, Any] | None:
        """The `flops_measured` event's FLOP and device fields for one step (measured on
        `batch`, one micro-batch), or None where this backend cannot count them."""

"""The named state buffers of a member: what a heal (and, later, a checkpoint) moves.

A `NamedState` is a member's training state seen as an ordered list of named
CPU tensors plus one JSON section. The heal protocol (`elastrain.transfer.heal`)
is generic over it: the torch trainer passes a `TorchState` (model +
optimizer), the JAX trainer a `JaxState` (a pytree of leaves). All methods
are local (no communication); the distributed contract is:

- every member of one job builds states whose `flatten` gives the same names,
  dtypes and shapes in the same order once their state is up to date (the
  coordinator's model signature checks the model part before a member joins);
- a receiver judges a manifest with `bound` *before* it allocates anything for
  it (a claim larger than its own layout allows is blamed on the sender: the
  next sender is asked), then with `check` (a manifest that is plausible but
  does not fit is a divergence: the heal fails everywhere);
- `install` runs only after every byte verified, and either makes all of them
  live or raises HealError leaving the state untouched.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from elastrain.transfer.manifest import Entry, Manifest

MANIFEST_BASE_BYTES = 16 * 1024 * 1024
"""Every state accepts a manifest of this many bytes plus `MANIFEST_ENTRY_BYTES`
per entry it could hold: room for a large JSON meta (the trainer's extra
state) while a claim of a terabyte is refused before anything is allocated."""
MANIFEST_ENTRY_BYTES = 1024
"""Manifest bytes allowed per entry (its JSON line, and its share of the section)."""


@dataclass(frozen=True)
class FlatState:
    """A state as named tensors (aliases of the live buffers, not copies) plus JSON.

    ``section`` is whatever the kind needs besides tensors (torch: the
    optimizer's class, param_groups and non-tensor state; JAX: ``{}``), with
    each tensor it refers to replaced by ``{"$tensor": name}``.
    """

    tensors: list[tuple[str, torch.Tensor]]
    section: dict[str, Any]
    stable: frozenset[str] = frozenset()
    """Names of the tensors nothing but the optimizer step writes (in place), or
    nothing at all: a checkpoint may copy them in the background until the
    trainer's next mutation point (`elastrain.checkpoint.deferred`). The rest
    (what forward writes, such as BatchNorm's running statistics) is copied at once."""


def manifest_limit(max_entries: int) -> int:
    """The most manifest bytes a state that can hold ``max_entries`` entries accepts."""
    return MANIFEST_BASE_BYTES + MANIFEST_ENTRY_BYTES * max_entries


class NamedState(Protocol):
    """A member's state buffers, as the heal moves them. See the module docstring."""

    kind: str
    """Which trainer the state belongs to ("torch", "jax"); it travels in the
    manifest and a receiver refuses a manifest of another kind."""

    def steady(self) -> AbstractContextManager[None]:
        """A span in which nothing but the caller changes this state's structure
        (which tensors it holds, their names, shapes and dtypes; their values may
        change): inside it the kind may derive what it needs from that structure
        once instead of in every method (torch: the model's state_dict walk). A heal
        runs inside one; nesting is allowed."""
        ...

    def flatten(self) -> FlatState:
        """The state's named CPU tensors, in a fixed order, and its JSON section.

        Raises TypeError for state that cannot travel as tensors + JSON.
        """
        ...

    def manifest_limit(self) -> int:
        """The most manifest bytes this state accepts (checked on the announced
        length, before the manifest buffer is allocated)."""
        ...

    def landing_estimate(self) -> list[tuple[str, int]]:
        """``(name, nbytes)`` of the entries a heal into this state is expected to
        carry: a joiner maps and touches that much landing ahead of its heal
        (`elastrain.transfer.landing.LandingReserve`). Exact for what the state
        holds; an estimate (stated by the kind) for state that appears only once
        training ran. Only speed depends on it: a short estimate lands the rest in
        fresh memory, a long one gives the surplus back at the heal."""
        ...

    def expected_layout(self) -> tuple[Entry, ...] | None:
        """The entries a heal into this state will carry, exactly (names, dtypes,
        shapes, laid out back to back in `flatten` order), or None where the kind
        cannot say (state that appears only once training ran, of a kind it does
        not know). A receiver lays its landing out for it before the heal
        (`elastrain.transfer.prepared.PreparedReceive`) and, when the root's
        manifest has exactly these entries, judges only the rest of it
        (`bound_section`, `check_section`). So it must be what `bound` and `check`
        accept of entries; only speed depends on it being right (a manifest with
        other entries is judged whole, as without it)."""
        ...

    def bound(self, m: Manifest) -> str | None:
        """None if a correct peer of this state could have sent ``m``, else why not.

        Judged before any payload is allocated: the total and every entry must be
        no larger than this state's own layout allows, and the section must be
        consistent with the entries. A refusal blames the manifest's root.
        """
        ...

    def check(self, m: Manifest) -> str | None:
        """None if ``m`` (already within `bound`) fits this state exactly, else why not."""
        ...

    def bound_section(self, m: Manifest) -> str | None:
        """The part of `bound` its entries do not decide: for a manifest whose entries
        are this state's `expected_layout`, judged instead of `bound`."""
        ...

    def check_section(self, m: Manifest) -> str | None:
        """The part of `check` its entries do not decide: for a manifest whose entries
        are this state's `expected_layout`, judged instead of `check`."""
        ...

    def live_targets(self, m: Manifest) -> dict[str, torch.Tensor]:
        """The entries of ``m`` (already within `bound` and `check`) that a heal may
        land straight in this state's live tensors, by entry name: each a
        contiguous CPU tensor with exactly the entry's dtype and shape, sharing no
        byte with another entry's. Only a heal run ``in_place`` asks; it writes
        them before the payload is verified, so a heal that then fails leaves this
        state torn (`TornHeal`). Empty: everything lands in fresh memory."""
        ...

    def install(self, tensors: dict[str, torch.Tensor], section: dict[str, Any]) -> None:
        """Make verified tensors (fresh, one per entry, owned by the callee from now
        on, except those that are already the `live_targets` they were landed in)
        and the section the live state; HealError if refused (state untouched
        but for what landed in place)."""
        ...

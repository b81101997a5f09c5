"""Which replica groups keep their FSDP2 wrapper and process group across a regroup.

A sharded member computes through an FSDP2 wrapper bound to its replica
group's gloo process group (`ShardedBackend.form_group`). Building both again
costs a store rendezvous and a ``fully_shard`` of the model at every
generation, also for a group the failure did not touch. A group keeps them
when nothing it holds changed and nothing broke it:

- the same members in the same shard slots (`Layout.group`, shard order) and
  the same shard size as when its wrapper was built, so the wrapper's shards
  are still the members' rows and its ranks still their shard indices;
- no reshard in the new generation (rows move: every member's shards are new);
- none of its members is a heal's receiver (its state is replaced);
- every member holds the wrapper built in the same generation (one process
  group, not two that happen to have the same members), and none of them saw a
  collective of it fail or stop midway (`ShardedBackend.group_clean`): a
  member that left a forward or backward by an exception may have left its
  group-mates in a collective, and a gloo group with a collective half done
  (or aborted) cannot be used again.

The last condition is known to each member alone, so the members tell each
other (`report` per member, one all-reduce over the generation); the rest is
read from the generation's ready answer, the same on every member. `kept`
decides from all of it, the same on every member, without communication.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastrain.control.layout import Layout


@dataclass(frozen=True)
class BuiltGroup:
    """What a member's current wrapper was built for."""

    members: tuple[str, ...]
    """Its replica group, in shard order."""
    shard_size: int
    gen: int
    """The generation that built it (its process group's)."""


def report(built: BuiltGroup | None, clean: bool, layout: Layout, member: str) -> int:
    """This member's word on its wrapper for the new generation's `layout`: the
    generation that built it if it could serve the member's new replica group
    as it is (same members in the same slots, same shard size, no collective of it
    failed or stopped midway: `clean`), else 0 (none, or it must be built again).
    A shadow's is 0: it computes nothing."""
    if built is None or not clean or built.gen <= 0 or layout.is_shadow(member):
        return 0
    group = tuple(layout.group(layout.slots[member].replica))
    if built.shard_size != layout.shard_size or built.members != group:
        return 0
    return built.gen


def kept(
    reports: Mapping[str, int], layout: Layout, receivers: Iterable[str], reshard: bool
) -> frozenset[int]:
    """The complete replica groups of `layout` that keep their wrappers: every
    member reported the same building generation (`report`), none of them is a
    heal's `receivers`, and the generation does not `reshard`. The same answer
    on every member given the same reports."""
    if reshard:
        return frozenset()
    receiving = set(receivers)
    out = set()
    for r in layout.complete_replicas():
        group = layout.group(r)
        gens = {reports.get(w, 0) for w in group}
        if len(gens) == 1 and 0 not in gens and not receiving.intersection(group):
            out.add(r)
    return frozenset(out)

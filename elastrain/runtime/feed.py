"""The data feed: the job's sample order, each step's window of it, and the loader.

One owner for what a member reads: the global order (`GlobalOrder` for a
map-style dataset, `StreamOrder` for a replayable stream), the position where
each step's window starts (`DataPosition`, travels with the state) and the
`BatchLoader` that fetches this member's micro-batches, ahead of the step with
prefetch. Every member holds the same order and position (they travel with a
heal and a checkpoint), so a micro-batch's samples are the same whoever loads
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from elastrain.data import (
    DEFAULT_ORDER,
    BatchLoader,
    DataPosition,
    GlobalOrder,
    LoaderConfig,
    MapFetch,
    OrderKind,
    StreamFetch,
    StreamingDataset,
    StreamOrder,
    is_stream,
)
from elastrain.runtime.config import TrainerConfig


class MapDataset(Protocol):
    """A map-style dataset: `len()` and integer indexing (torch Datasets qualify).
    A replayable stream (`elastrain.data.StreamingDataset`, with
    `iter_from(position)`) is accepted wherever a MapDataset is."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


DataSource = MapDataset | StreamingDataset
"""What a trainer takes as its data: a map-style dataset or a replayable stream."""


class DataFeed:
    """This member's view of the job's data (see the module docstring)."""

    def __init__(
        self,
        dataset: DataSource,
        collate_fn: Callable[[list[Any]], Any],
        config: TrainerConfig,
        member: str,
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.stream = is_stream(dataset)
        self.order: GlobalOrder | StreamOrder = self._make_order(None)
        self.data_pos = DataPosition()
        """Where each step's window of the order starts (travels with the state)."""
        fetch = (
            StreamFetch(dataset, collate_fn)  # type: ignore[arg-type]
            if self.stream
            else MapFetch(dataset, collate_fn)
        )
        self.loader = BatchLoader(
            fetch, LoaderConfig(config.num_workers, config.prefetch_steps), name=f"data-{member}"
        )
        """Loads this member's micro-batches, ahead of the step with prefetch."""

    def _make_order(self, kind: str | None) -> GlobalOrder | StreamOrder:
        """The order of `kind` (None: the config's, else the default) for this dataset."""
        if self.stream:
            return StreamOrder()
        cfg = self.config
        return GlobalOrder(
            len(self.dataset),  # type: ignore[arg-type]
            cfg.seed,
            shuffle=cfg.shuffle,
            kind=kind or cfg.sample_order or DEFAULT_ORDER,
        )

    def microbatches(self, step: int) -> list[range]:
        """Positions of each of `step`'s micro-batches in the order."""
        cfg = self.config
        return self.data_pos.microbatches(step, cfg.global_batch_size, cfg.micro_batch_size)

    def ids(self, positions: range) -> list[int]:
        """The sample ids at `positions` of the order."""
        return self.order.ids(positions.start, positions.stop)

    def load(self, key: tuple[int, int], positions: range) -> Any:
        """Micro-batch `key` (step, index) at `positions`, collated."""
        return self.loader.get(key, self.ids(positions))

    def first_batch(self, committed: int) -> Any:
        """The next step's first micro-batch (a stream may no longer hold position 0)."""
        start = self.data_pos.start(committed, self.config.global_batch_size)
        return self.loader.fetch(self.order.ids(start, start + self.config.micro_batch_size))

    def meta(self, committed: int) -> dict[str, Any]:
        """The order's kind and the next step's position, as of `committed`."""
        pos = self.data_pos.at(committed, self.config.global_batch_size)
        return {"order": str(self.order.kind), "position": pos.to_json()}

    def order_problem(self, kind: Any) -> str | None:
        """Why this job cannot go on with state trained on the order `kind` (None: it can)."""
        if not isinstance(kind, str) or kind not in {k.value for k in OrderKind}:
            return f"it records an unknown sample order {kind!r}"
        if self.stream != (kind == OrderKind.STREAM):
            have = "a stream" if self.stream else "a map-style dataset"
            return f"it was trained on a {kind} order and this job's dataset is {have}"
        wanted = self.config.sample_order
        if not self.stream and wanted is not None and wanted != kind:
            return (
                f"it was trained with sample_order={kind!r} and this config says {wanted!r}: "
                f"set sample_order={kind!r} (or None: the checkpoint's) to resume it, or start "
                "in a fresh --run-dir"
            )
        return None

    def adopt(self, data: dict[str, Any]) -> None:
        """Take the order and position of a sender's or a checkpoint's state."""
        problem = self.order_problem(data.get("order"))
        if problem is not None:
            raise ValueError(f"the state's data order does not fit this job: {problem}")
        if data["order"] != self.order.kind:
            self.order = self._make_order(data["order"])
            self.loader.reset()
        self.data_pos = DataPosition.from_json(data.get("position"))

    def plan(self, step: int, mine: list[int | None]) -> None:
        """Tell the loader this member's micro-batches of `step` and the next
        `prefetch_steps` ones (under this generation's assignment)."""
        if not self.loader.config.background:
            return
        cfg = self.config
        wanted: list[tuple[tuple[int, int], list[int]]] = []
        for t in range(step, min(cfg.total_steps, step + 1 + cfg.prefetch_steps)):
            mbs = self.microbatches(t)
            wanted.extend(((t, i), self.ids(mbs[i])) for i in mine if i is not None)
        self.loader.plan(wanted)

"""Elastic data: a seeded global sample order, micro-batch assignment, streams,
and loading a member's micro-batches ahead of its steps."""

from elastrain.data.loader import BatchLoader, LoaderConfig, LoaderError, MapFetch, StreamFetch
from elastrain.data.order import (
    DEFAULT_ORDER,
    DataPosition,
    FeistelPermutation,
    GlobalOrder,
    OrderKind,
    assign_microbatches,
    assign_rounds,
    step_microbatches,
)
from elastrain.data.stream import (
    StreamEnded,
    StreamingDataset,
    StreamOrder,
    StreamReader,
    check_dataset,
    is_stream,
)

__all__ = [
    "DEFAULT_ORDER",
    "BatchLoader",
    "DataPosition",
    "FeistelPermutation",
    "GlobalOrder",
    "LoaderConfig",
    "LoaderError",
    "MapFetch",
    "OrderKind",
    "StreamEnded",
    "StreamFetch",
    "StreamOrder",
    "StreamReader",
    "StreamingDataset",
    "assign_microbatches",
    "assign_rounds",
    "check_dataset",
    "is_stream",
    "step_microbatches",
]

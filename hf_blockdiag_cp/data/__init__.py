"""Data: packing documents into packs (`packing`), the CP-aware sampler and dataloader
(`loader`), and the collator that pads and shards one pack (`collator`). The demo corpus of
the examples (`corpus`) is imported only by whoever uses it."""

from .collator import BlockdiagCPCollator
from .loader import (
    DocumentPiece,
    PackedBatchSampler,
    PackedDataLoader,
    PackedExamples,
    dataset_lengths,
    packed_dataloader,
)
from .packing import OVERSIZE_POLICIES, OversizeCount, PackingStats, first_fit_decreasing

__all__ = [
    "OVERSIZE_POLICIES",
    "BlockdiagCPCollator",
    "DocumentPiece",
    "OversizeCount",
    "PackedBatchSampler",
    "PackedDataLoader",
    "PackedExamples",
    "PackingStats",
    "dataset_lengths",
    "first_fit_decreasing",
    "packed_dataloader",
]

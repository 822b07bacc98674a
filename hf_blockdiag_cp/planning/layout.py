"""Layouts: which padded-pack position every local row of every CP rank holds.

A layout strategy is a function `(segment boundaries [n+1], cp_size, tolerance, kernel_cost)
-> slot positions [G, L]` registered under a name (`register_layout_strategy`): "contiguous" chunks
and "balanced" (`planning.balance`) ship here. Whatever the strategy, every rank holds
exactly L = S_pad / G rows in increasing pack order (`plan_rank` relies on that), and
documents are independent, so any such assignment is exact.

`Layout` caches the segment arithmetic that every later planning step reads (the inverse
slot table, each rank's runs of consecutive positions), so it is computed once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import torch

from ..registry import Registry
from .kernel_cost import DEFAULT_KERNEL_COST, KernelCost
from .segments import (
    Segments,
    document_ids_from_lengths,
    inverse_permutation,
    padded_length,
    position_intervals,
    run_bounds,
    run_starts,
    validate_document_ids,
)

DEFAULT_TOLERANCE = 0.05

# (boundaries [n_segments + 1], cp_size, tolerance, kernel_cost) -> slot positions [G, L]
LayoutStrategy = Callable[[torch.Tensor, int, float, KernelCost], torch.Tensor]


@dataclass(frozen=True)
class LayoutRecord:
    """A layout strategy under its name (`CPConfig.layout`, `plan_layout(strategy=)`)."""

    name: str
    slot_positions: LayoutStrategy


LAYOUTS: Registry[LayoutRecord] = Registry(
    "strategy", "a layout strategy", missing="{option}={name!r} is not supported; accepted values: {available}")


def register_layout_strategy(name: str, strategy: LayoutStrategy) -> LayoutStrategy:
    """Make `strategy` available as `plan_layout(..., strategy=name)` (and in `CPConfig.layout`)."""
    LAYOUTS.register(LayoutRecord(name, strategy))
    return strategy


def layout_strategies() -> tuple[str, ...]:
    return LAYOUTS.names()


def contiguous_slot_positions(
    boundaries: torch.Tensor, cp_size: int, tolerance: float = DEFAULT_TOLERANCE, kernel_cost: KernelCost = DEFAULT_KERNEL_COST
) -> torch.Tensor:
    """Rank r holds rows `[r·L, (r+1)·L)`: fewest split documents, least communication."""
    s_pad = int(boundaries[-1])
    return torch.arange(s_pad).view(cp_size, s_pad // cp_size)


register_layout_strategy("contiguous", contiguous_slot_positions)


@dataclass(frozen=True)
class Layout:
    """Which pack position every local row of every CP rank holds.

    `token_indices[r, i]` is the original pack position of rank r's row i, -1 for tail
    padding. `slot_positions` is the same with tail padding numbered past the pack, so every
    slot has a position in the padded pack. Gathered K/V rows come in slot order (rank-major).
    """

    strategy: str
    cp_size: int
    original_seq_len: int
    padded_seq_len: int
    slot_positions: torch.Tensor  # [G, L] int64, a permutation of range(padded_seq_len)
    document_ids: torch.Tensor  # [S_pad] int64, padded pack order, 0 = padding
    segments: Segments = field(repr=False)

    @property
    def local_len(self) -> int:
        return self.padded_seq_len // self.cp_size

    @property
    def token_indices(self) -> torch.Tensor:
        pos = self.slot_positions
        return torch.where(pos < self.original_seq_len, pos, torch.full_like(pos, -1))

    @property
    def document_lengths(self) -> list[int]:
        ids = self.document_ids[: self.original_seq_len]
        real = ids[ids > 0]
        return torch.unique_consecutive(real, return_counts=True)[1].tolist()

    def real_tokens_per_rank(self) -> list[int]:
        return (self.document_ids[self.slot_positions] > 0).sum(dim=1).tolist()

    @cached_property
    def slot_of_position(self) -> torch.Tensor:
        """[S_pad]: the slot (rank · L + row) holding each padded-pack position; `// L` is its owner."""
        return inverse_permutation(self.slot_positions.reshape(-1))

    def held_intervals(self, rank: int) -> torch.Tensor:
        """`[n, 2]` maximal runs of consecutive pack positions held by `rank`, as `[start, stop)`."""
        return self._held_intervals[rank]

    def query_runs(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(first, last) row of each run of `rank`: consecutive pack positions of one segment.

        A rank may hold two separate chunks of one document (head-tail layouts); each chunk is
        its own run, which bottom-right causal alignment in varlen kernels needs."""
        return self._query_runs[rank]

    @cached_property
    def _query_runs(self) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        runs = []
        for r in range(self.cp_size):
            pos = self.slot_positions[r]
            runs.append(run_bounds(run_starts(self.segments.segment_ids[pos], consecutive=pos)))
        return tuple(runs)

    @cached_property
    def _held_intervals(self) -> tuple[torch.Tensor, ...]:
        return tuple(position_intervals(self.slot_positions[r]) for r in range(self.cp_size))


def _pack_document_ids(documents, seq_len: int | None) -> torch.Tensor:
    """Document ids `[S]` from either form `plan_layout` accepts (see there)."""
    if isinstance(documents, torch.Tensor):
        if seq_len is not None and documents.numel() != seq_len:
            raise ValueError(f"document ids hold {documents.numel()} tokens but seq_len={seq_len}")
        return documents.reshape(-1).long().cpu()
    if isinstance(documents, (list, tuple)):
        if not documents or not all(isinstance(n, int) and not isinstance(n, bool) for n in documents):
            raise ValueError(f"document lengths must be a non-empty list of positive ints; got {list(documents)[:8]}")
        return document_ids_from_lengths(documents, seq_len)
    raise TypeError(
        "plan_layout takes document ids as a 1-D torch.Tensor (1-based, 0 = padding) or document lengths as a "
        f"list/tuple of ints; got {type(documents).__name__}"
    )


def plan_layout(
    documents: torch.Tensor | list[int] | tuple[int, ...],
    cp_size: int,
    strategy: str = "contiguous",
    *,
    seq_len: int | None = None,
    tolerance: float = DEFAULT_TOLERANCE,
    kernel_cost: KernelCost | None = None,
) -> Layout:
    """Plan which padded-pack positions every CP rank holds.

    `documents` is either the pack's document ids (a torch.Tensor `[S]` or `[1, S]`, 1-based,
    0 = padding at the end) or the documents' lengths (a list/tuple of ints, laid end to end
    and padded with id 0 up to `seq_len` if given). The pack is then padded to a multiple of 2·G.

    strategy "contiguous": rank r holds rows `[r·L, (r+1)·L)`. "balanced": each rank's
    predicted attention cost (`kernel_cost`, default `DEFAULT_KERNEL_COST`; `PAIR_COUNT`
    balances allowed pairs) is within `tolerance` of the ideal where the pack allows it
    (algorithm and bound: docs/layouts.md); it equals the contiguous layout whenever
    that is already balanced. Other strategies can be added with `register_layout_strategy`.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer; got {cp_size!r}")
    record = LAYOUTS.get(strategy)
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0; got {tolerance!r}")
    kernel_cost = DEFAULT_KERNEL_COST if kernel_cost is None else kernel_cost
    if not isinstance(kernel_cost, KernelCost):
        raise TypeError(f"kernel_cost must be a planning.KernelCost or None; got {type(kernel_cost).__name__}")
    ids = _pack_document_ids(documents, seq_len)
    validate_document_ids(ids)
    seq_len = ids.numel()
    s_pad = padded_length(seq_len, cp_size)
    padded = torch.cat([ids, torch.zeros(s_pad - seq_len, dtype=torch.long)])
    segments = Segments.from_document_ids(padded)
    slots = record.slot_positions(segments.boundaries, cp_size, tolerance, kernel_cost)
    if tuple(slots.shape) != (cp_size, s_pad // cp_size):
        raise AssertionError(f"layout strategy {strategy!r} returned shape {tuple(slots.shape)}, expected {(cp_size, s_pad // cp_size)}")
    return Layout(strategy, cp_size, seq_len, s_pad, slots, padded, segments)

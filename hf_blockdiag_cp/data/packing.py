"""Pure packing: which documents share a pack, and how full the packs are.

Nothing here touches torch or a process group, so the sampler can run it identically on
every rank (and in tests, exhaustively).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

# What happens to a document longer than a pack (`max_tokens`): cut into pack-sized pieces, each
# trained as its own document, or refused. "reject" is the earlier spelling of "raise".
OVERSIZE_POLICIES = ("split", "raise")
_OVERSIZE_SPELLINGS = {"split": "split", "raise": "raise", "reject": "raise"}


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bin-pack item indices by first-fit decreasing (FFD); every bin's total is <= `capacity`.

    Items are taken longest first (ties in index order, so the result is deterministic) and
    each goes into the first bin, in creation order, where it fits. FFD uses at most
    11/9·OPT + 6/9 bins (Dósa 2007). Zero-length items are allowed; an item longer than
    `capacity` raises ValueError.
    """
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
        raise ValueError(f"capacity must be a positive integer; got {capacity!r}")
    lengths = [checked_length(index, length) for index, length in enumerate(lengths)]
    for index, length in enumerate(lengths):
        if length > capacity:
            raise ValueError(f"item {index} has length {length}, more than the capacity {capacity}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep index order
    bins: list[list[int]] = []
    room: list[int] = []
    for index in order:
        length = lengths[index]
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(index)
                room[b] = free - length
                break
        else:
            bins.append([index])
            room.append(capacity - length)
    return bins


def checked_length(index: int, length) -> int:
    """An item length as a Python int (NumPy and torch integers accepted)."""
    try:
        value = operator.index(length)
    except TypeError:
        value = None
    if value is None or isinstance(length, bool) or value < 0:
        raise ValueError(f"lengths[{index}] must be a non-negative integer; got {length!r}")
    return value


@dataclass(frozen=True)
class PackingStats:
    """How well a set of packs is filled: `efficiency` = real tokens / pack tokens."""

    packs: int = 0
    real_tokens: int = 0  # document tokens
    pack_tokens: int = 0  # packs × pack length, padding included

    @property
    def efficiency(self) -> float:
        return self.real_tokens / self.pack_tokens if self.pack_tokens else 0.0

    @property
    def padding_tokens(self) -> int:
        return self.pack_tokens - self.real_tokens

    def merge(self, other: "PackingStats") -> "PackingStats":
        """Stats of both sets of packs together (e.g. over replicas or epochs)."""
        return PackingStats(
            self.packs + other.packs, self.real_tokens + other.real_tokens, self.pack_tokens + other.pack_tokens
        )

    __add__ = merge


def oversize_policy(value) -> str:
    """The canonical `oversize` policy ("split" or "raise"; "reject" is accepted for "raise")."""
    policy = _OVERSIZE_SPELLINGS.get(value) if isinstance(value, str) else None
    if policy is None:
        raise ValueError(f"oversize must be one of {', '.join(map(repr, OVERSIZE_POLICIES))}; got {value!r}")
    return policy


@dataclass(frozen=True)
class OversizeCount:
    """The documents of a dataset longer than a pack, and their tokens (all of them, not only the excess)."""

    documents: int = 0
    tokens: int = 0


def count_oversized(lengths: Sequence[int], max_tokens: int, policy: str) -> OversizeCount:
    """How many of `lengths` exceed `max_tokens` (policy "split": the sampler warns about them);
    policy "raise": ValueError naming the first one."""
    long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if long and policy == "raise":
        index, length = long[0]
        raise ValueError(
            f"document {index} has {length} tokens, more than max_tokens={max_tokens} (oversize='raise'; "
            f"{len(long)} of {len(lengths)} documents are longer): raise max_tokens, filter long documents out, "
            "or pass oversize='split' to cut them into pack-sized pieces"
        )
    return OversizeCount(len(long), sum(n for _, n in long))

"""First-fit decreasing and packing statistics, checked against independent references:
a brute-force optimum (Dósa's 11/9·OPT + 6/9 bound), the volume lower bound, and a naive
first fit over pre-sorted items."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.data.packing import PackingStats, first_fit_decreasing


@st.composite
def instances(draw, max_items=60):
    capacity = draw(st.integers(1, 64))
    lengths = draw(st.lists(st.integers(0, capacity), max_size=max_items))
    return lengths, capacity


def optimum_bins(lengths: list[int], capacity: int) -> int:
    """Exact minimum number of bins by depth-first search (small instances only)."""
    items = sorted((n for n in lengths if n), reverse=True)
    if not items:
        return 1 if lengths else 0
    best = len(items)

    def place(i: int, rooms: list[int]) -> None:
        nonlocal best
        if len(rooms) >= best:
            return
        if i == len(items):
            best = len(rooms)
            return
        tried = set()
        for b, room in enumerate(rooms):
            if items[i] <= room and room not in tried:
                tried.add(room)
                rooms[b] -= items[i]
                place(i + 1, rooms)
                rooms[b] += items[i]
        rooms.append(capacity - items[i])
        place(i + 1, rooms)
        rooms.pop()

    place(0, [])
    return best


def first_fit(order: list[int], lengths: list[int], capacity: int) -> list[list[int]]:
    bins: list[list[int]] = []
    for i in order:
        target = next((b for b in bins if sum(lengths[j] for j in b) + lengths[i] <= capacity), None)
        if target is None:
            bins.append([i])
        else:
            target.append(i)
    return bins


@settings(max_examples=200, deadline=None)
@given(instances())
def test_every_index_once_and_capacity_respected(instance):
    lengths, capacity = instance
    bins = first_fit_decreasing(lengths, capacity)
    flat = [i for b in bins for i in b]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins)
    assert len(bins) >= math.ceil(sum(lengths) / capacity)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_equals_first_fit_over_items_sorted_longest_first(instance):
    lengths, capacity = instance
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    assert first_fit_decreasing(lengths, capacity) == first_fit(order, lengths, capacity)


@settings(max_examples=200, deadline=None)
@given(instances())
def test_first_fit_invariants(instance):
    """No item could have gone into an earlier bin, so at most one bin is at most half full."""
    lengths, capacity = instance
    bins = first_fit_decreasing(lengths, capacity)
    rooms = [capacity - sum(lengths[i] for i in b) for b in bins]
    for j, b in enumerate(bins):
        for i in b:
            assert all(lengths[i] > rooms[k] for k in range(j)), (i, j, rooms)
    assert sum(1 for b in bins if 2 * sum(lengths[i] for i in b) <= capacity) <= 1


@settings(max_examples=150, deadline=None)
@given(instances(max_items=9))
def test_within_dosa_bound_of_the_optimum(instance):
    lengths, capacity = instance
    used = len(first_fit_decreasing(lengths, capacity))
    opt = optimum_bins(lengths, capacity)
    assert opt <= used <= 11 / 9 * opt + 6 / 9


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 64), data=st.data())
def test_equal_items_fill_bins_in_index_order(capacity, data):
    """Ties keep index order: n items of one length v fill bins of capacity // v consecutive
    indices each, and zero-length items (taken last) join the first bin."""
    length = data.draw(st.integers(1, capacity))
    n, zeros = data.draw(st.integers(0, 40)), data.draw(st.integers(0, 5))
    per_bin = capacity // length
    expected = [list(range(b, min(b + per_bin, n))) for b in range(0, n, per_bin)]
    if zeros:
        expected = expected or [[]]
        expected[0] += list(range(n, n + zeros))
    assert first_fit_decreasing([length] * n + [0] * zeros, capacity) == expected


@settings(max_examples=100, deadline=None)
@given(instances(), st.sampled_from([np.int64, np.int32, np.uint16]))
def test_deterministic_and_accepts_numpy_lengths(instance, dtype):
    lengths, capacity = instance
    as_numpy = np.asarray(lengths, dtype=dtype)
    assert first_fit_decreasing(as_numpy, capacity) == first_fit_decreasing(lengths, capacity)
    assert first_fit_decreasing(lengths, capacity) == first_fit_decreasing(list(lengths), capacity)


def test_oversized_and_invalid_items_are_named():
    with pytest.raises(ValueError, match=r"item 2 has length 9, more than the capacity 8"):
        first_fit_decreasing([1, 2, 9], 8)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a non-negative integer"):
        first_fit_decreasing([1, -2], 8)
    with pytest.raises(ValueError, match=r"lengths\[0\] must be a non-negative integer"):
        first_fit_decreasing([1.5], 8)
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        first_fit_decreasing([1], 0)


def test_packing_stats():
    a, b = PackingStats(2, 10, 16), PackingStats(1, 4, 8)
    assert a.efficiency == 10 / 16
    assert a.padding_tokens == 6
    assert a.merge(b) == a + b == PackingStats(3, 14, 24)
    assert PackingStats().efficiency == 0.0

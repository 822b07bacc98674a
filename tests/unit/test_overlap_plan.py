"""The overlap plan (`planning.plan_overlap`, `CPConfig(overlap=True)`) against brute force
(hypothesis, G = 1-8, random packs with interior padding, contiguous / balanced / head-tail
layouts, over the rows of every exchange that can overlap): the two parts hold every local query once; a query is in the local part exactly when
every key of its run (its document from the start up to the run's last query) is held by its own
rank, or is padding; each part's plan allows exactly the (query, key position) pairs the full plan
allows for its queries (padding queries: those of keys on the rank), with key rows that name
those positions; and the merge puts the parts back in
query order; `overlap_work` counts the local part's pairs, `key_local_work` every pair whose key the rank holds. Whole models under overlap on gloo: tests/multiprocess/test_overlap.py and the
parity matrix."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_blockdiag_cp  # noqa: F401  (registers the exchange records)
from hf_blockdiag_cp.planning import (
    exchange_records,
    get_exchange,
    key_local_work,
    overlap_work,
    plan_exchange,
    plan_key_overlap,
    plan_overlap,
    plan_rank,
    validate_rank_plan,
)
from hf_blockdiag_cp.planning.rank_plan import dense_allowed
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy


def _indices(queries) -> list[int]:
    return list(range(*queries)) if isinstance(queries, tuple) else queries.tolist()


def _rows(key_rows) -> torch.Tensor:
    return torch.arange(*key_rows) if isinstance(key_rows, tuple) else key_rows


def brute_local_queries(layout, rank: int) -> set[int]:
    """Local rows of padding or whose run's keys are all on `rank`: walk the rank's rows, grouping
    consecutive positions of one segment, and look up the owner of every position from the
    segment's start."""
    positions = layout.slot_positions[rank].tolist()
    owner = {p: r for r in range(layout.cp_size) for p in layout.slot_positions[r].tolist()}
    seg, starts = layout.segments.segment_ids.tolist(), layout.segments.segment_starts.tolist()
    local, row = set(), 0
    while row < len(positions):
        end = row
        while end + 1 < len(positions) and positions[end + 1] == positions[end] + 1 and seg[positions[end + 1]] == seg[positions[row]]:
            end += 1
        keys = range(starts[positions[row]], positions[end] + 1)
        if layout.document_ids[positions[row]] == 0 or all(owner[p] == rank for p in keys):
            local.update(range(row, end + 1))
        row = end + 1
    return local


def _allowed_pairs(plan, row_positions) -> set[tuple[int, int]]:
    """(query position, key position) pairs a plan allows, its keys read through its key rows."""
    keys = row_positions[_rows(plan.key_rows)]
    assert torch.equal(keys, plan.k_positions), "key rows do not name the plan's key positions"
    allowed = dense_allowed(plan.q_positions, plan.q_segments, plan.k_positions, plan.k_segments)
    q, k = torch.nonzero(allowed, as_tuple=True)
    return set(zip(plan.q_positions[q].tolist(), plan.k_positions[k].tolist()))


OVERLAPPING = [r.name for r in exchange_records() if r.begin is not None]


def test_the_k_v_exchanges_can_overlap():
    assert OVERLAPPING == [r.name for r in exchange_records() if not r.head_parallel] == ["allgather", "halo", "a2a"]


@settings(max_examples=150, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS),
       exchange=st.sampled_from(OVERLAPPING))
def test_parts_split_the_queries_exactly(runs, cp_size, kind, exchange):
    layout = make_layout(pack_ids(runs), cp_size, kind)
    record = get_exchange(exchange)
    xplan = plan_exchange(layout) if record.needs_plan else None
    work, key_work = (overlap_work(layout), key_local_work(layout)) if exchange == "allgather" else (None, None)
    for rank in range(cp_size):
        mine = record.plan(layout, xplan, rank)  # the rows the exchange returns, and the plan over them
        full, all_rows = mine.rank_plan, mine.row_positions
        split = plan_overlap(layout, rank, full, all_rows)
        local = [] if split.local is None else _indices(split.local.queries)
        remote = [] if split.remote is None else _indices(split.remote.queries)
        assert sorted(local + remote) == list(range(layout.local_len)), "every query in exactly one part"
        assert set(local) == brute_local_queries(layout, rank)
        brute_positions = set(layout.slot_positions[rank][sorted(brute_local_queries(layout, rank))].tolist())
        assert split.local_queries == len(local)
        full_pairs = _allowed_pairs(full, all_rows)
        parts = [(p, _indices(p.queries)) for p in (split.local, split.remote) if p is not None]
        for part, rows in parts:
            validate_rank_plan(part.plan, part.num_queries, part.plan.num_keys, num_rows=part.row_positions.numel())
            assert torch.equal(part.plan.q_positions, layout.slot_positions[rank][rows])
            mine = set(part.plan.q_positions.tolist())
            # Padding queries of the local part see only the padding rows this rank holds.
            held = set(layout.slot_positions[rank].tolist()) if part is split.local else None
            want = {(q, k) for q, k in full_pairs
                    if q in mine and (held is None or layout.document_ids[q] > 0 or k in held)}
            assert _allowed_pairs(part.plan, part.row_positions) == want
        if split.local is not None:  # the local part reads this rank's own rows only
            assert torch.equal(split.local.row_positions, layout.slot_positions[rank])
        if exchange == "allgather":  # the work that runs during the exchange, as the scaling model reads it
            held = set(layout.slot_positions[rank].tolist())
            pairs = [(q, k) for q, k in full_pairs if q in brute_positions]
            local_pairs = sum(1 for q, k in pairs if layout.document_ids[q] > 0 or k in held)
            assert int(work[rank]) == local_pairs
            # What the split by keys runs during the exchange: every pair whose key this rank holds.
            key_pairs = sum(1 for q, k in full_pairs if q in held and k in held)
            assert int(key_work[rank]) == key_pairs >= local_pairs
        # The merge restores query order from cat([local, remote]) (or cat([remote, local])).
        order = torch.tensor(remote + local if split.remote_first else local + remote)
        merged = order if split.merge_index is None else order[split.merge_index]
        assert merged.tolist() == list(range(layout.local_len))


def test_contiguous_shard_whose_first_document_continues_is_remote_first():
    # Documents of 6, 10 and 8 tokens over two ranks of 12 rows: rank 1's first run continues the
    # second document (remote), its last document starts on the rank (local).
    ids = torch.tensor([1] * 6 + [2] * 10 + [3] * 8)
    layout = make_layout(ids, 2, "contiguous")
    split = plan_overlap(layout, 1, plan_rank(layout, 1), layout.slot_positions.reshape(-1))
    assert split.remote.queries == (0, 4) and split.local.queries == (4, 12)
    assert split.remote_first and split.merge_index is None
    assert split.local.plan.key_rows == (4, 12)  # rank 1's own rows 4..11 hold positions 16..23


def _kernel_pairs(plan) -> list[tuple[int, int]]:
    """(query position, key position) pairs a varlen kernel computes from the plan's segment table:
    bottom-right causal per run (query j of q sees its first k - q + j + 1 keys), or every pair of the
    run when the plan is not causal. A list, so a pair computed twice shows."""
    cu_q, cu_k = plan.cu_seqlens_q.tolist(), plan.cu_seqlens_k.tolist()
    pairs = []
    for run in range(len(cu_q) - 1):
        qs = plan.q_positions[cu_q[run]:cu_q[run + 1]].tolist()
        ks = plan.k_positions[cu_k[run]:cu_k[run + 1]].tolist()
        for j, q in enumerate(qs):
            seen = ks if not plan.causal else ks[: len(ks) - len(qs) + j + 1]
            pairs += [(q, k) for k in seen]
    return pairs


@settings(max_examples=150, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(2, 8), kind=st.sampled_from(LAYOUT_KINDS),
       exchange=st.sampled_from(OVERLAPPING))
def test_a_split_by_keys_computes_every_pair_once(runs, cp_size, kind, exchange):
    """Split by keys: the local part holds every query over the keys its rank holds, causal; the remote
    part the runs with keys elsewhere over exactly those keys, all before the run (not causal). What a
    varlen kernel computes from each part's segment table, together, is every allowed pair once
    (padding queries: those of keys on the rank); key rows name the keys; the local part's work is
    `key_local_work`."""
    layout = make_layout(pack_ids(runs), cp_size, kind)
    record = get_exchange(exchange)
    xplan = plan_exchange(layout) if record.needs_plan else None
    key_work = key_local_work(layout) if exchange == "allgather" else None
    for rank in range(cp_size):
        mine = record.plan(layout, xplan, rank)
        full, all_rows = mine.rank_plan, mine.row_positions
        split = plan_key_overlap(layout, rank, full, all_rows)
        assert split.by_keys and split.local.queries == (0, layout.local_len)
        assert split.local.plan.causal and (split.remote is None or not split.remote.plan.causal)
        assert torch.equal(split.local.row_positions, layout.slot_positions[rank])
        held = set(layout.slot_positions[rank].tolist())
        want = sorted((q, k) for q, k in _allowed_pairs(full, all_rows) if layout.document_ids[q] > 0 or k in held)
        computed = []
        for part in (split.local, split.remote):
            if part is None:
                continue
            validate_rank_plan(part.plan, part.num_queries, part.plan.num_keys, num_rows=part.row_positions.numel())
            assert torch.equal(part.plan.q_positions, layout.slot_positions[rank][_indices(part.queries)])
            assert torch.equal(part.row_positions[_rows(part.plan.key_rows)], part.plan.k_positions)
            keys_held = {k in held for k in part.plan.k_positions.tolist()}
            assert keys_held <= {part is split.local}, "the local part reads held keys only, the remote part none"
            computed += _kernel_pairs(part.plan)
        assert sorted(computed) == want
        if exchange == "allgather":
            local_pairs = len(_kernel_pairs(split.local.plan))
            assert int(key_work[rank]) == local_pairs


def test_a_split_by_keys_of_a_document_over_two_ranks():
    # One 10-token document then one of 14, over two ranks of 12 rows: rank 1's first run (positions
    # 12..15) continues the second document, whose keys 10, 11 are on rank 0.
    ids = torch.tensor([1] * 10 + [2] * 14)
    layout = make_layout(ids, 2, "contiguous")
    split = plan_key_overlap(layout, 1, plan_rank(layout, 1), layout.slot_positions.reshape(-1))
    assert split.local.queries == (0, 12) and split.local.plan.key_rows == (0, 12)
    assert split.remote.queries == (0, 12)  # one run: the document's 12 rows on rank 1
    assert split.remote.plan.key_rows == (10, 12) and split.remote.plan.k_positions.tolist() == [10, 11]
    assert split.remote.plan.cu_seqlens_q.tolist() == [0, 12] and split.remote.plan.cu_seqlens_k.tolist() == [0, 2]
    assert plan_key_overlap(layout, 0, plan_rank(layout, 0), layout.slot_positions.reshape(-1)).remote is None

"""Needed-only exchange plans against brute force over the dense mask (hypothesis, G = 1-8,
random packs with interior padding, contiguous / balanced / head-tail layouts, sliding
windows). The real exchanges on gloo are in multiprocess/test_exchange_bytes.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import EXCHANGE_KINDS, choose_exchange, needed_rank_plan, plan_exchange, rank_routes
from hf_blockdiag_cp.planning import dense_allowed, head_groups, plan_layout, plan_rank
from hf_blockdiag_cp.planning.segments import expand
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy, window_strategy


def positions_of(intervals: torch.Tensor) -> set[int]:
    return set(expand(intervals).tolist())


# --------------------------------------------------------------------------- brute force


def brute_needed(layout, rank, window) -> set[int]:
    """Keys the dense mask allows for the rank's real queries, plus its own padding rows."""
    s_pad = layout.padded_seq_len
    all_pos = torch.arange(s_pad)
    seg = layout.segments.segment_ids
    q = layout.slot_positions[rank]
    real = layout.document_ids[q] > 0
    allowed = dense_allowed(q[real], seg[q[real]], all_pos, seg, window)
    needed = set(torch.nonzero(allowed.any(dim=0)).reshape(-1).tolist())
    return needed | set(q[~real].tolist())


@settings(max_examples=120, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS), window=window_strategy)
def test_needed_keys_equal_dense_mask(runs, cp_size, kind, window):
    ids = pack_ids(runs)
    layout = make_layout(ids, cp_size, kind)
    plan = plan_exchange(layout, window)
    unwindowed = plan_exchange(layout) if window is not None else plan
    held = [set(layout.slot_positions[r].tolist()) for r in range(cp_size)]
    for r in range(cp_size):
        needed = positions_of(plan.needed[r])
        assert needed == brute_needed(layout, r, window), f"rank {r}"
        assert needed <= positions_of(unwindowed.needed[r])  # a window only removes keys
        for src in range(cp_size):
            expect = 0 if src == r else len(needed & held[src])
            assert int(plan.traffic[src, r]) == expect, (src, r)
        # byte accounting from the same sets
        assert plan.rows_per_layer("a2a", r) == (len(needed - held[r]), sum(len(positions_of(plan.needed[d]) & held[r]) for d in range(cp_size) if d != r))
        assert plan.rows_per_layer("allgather", r) == ((cp_size - 1) * layout.local_len,) * 2
    # halo: every sender of a rank owns the position just before one of the rank's runs
    owner = {p: r for r in range(cp_size) for p in held[r]}
    halo_ok = all(
        any(owner.get(p - 1) == src for p in held[dst] if p - 1 not in held[dst])
        for dst in range(cp_size) for src in range(cp_size) if src != dst and int(plan.traffic[src, dst]) > 0
    )
    assert plan.halo_valid == halo_ok
    if kind == "contiguous":  # the classic statement: no needed document spans more than two ranks
        local = layout.local_len
        assert plan.halo_valid == all(min(positions_of(plan.needed[r])) >= max(r - 1, 0) * local for r in range(cp_size))


@settings(max_examples=100, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS), window=window_strategy)
def test_needed_rank_plan_attends_exactly_like_the_full_plan(runs, cp_size, kind, window):
    """Real queries see the same keys through the needed-only plan as through `plan_rank` (under
    the plan's window, if any); padding queries see only padding rows of their own segment on
    their own rank, and at least themselves."""
    layout = make_layout(pack_ids(runs), cp_size, kind)
    plan = plan_exchange(layout, window)
    s_pad = layout.padded_seq_len
    for r in range(cp_size):
        full, needed = plan_rank(layout, r), needed_rank_plan(layout, plan, r)
        rows = expand(plan.needed[r])  # what the exchange returns
        if isinstance(needed.key_rows, tuple):
            assert needed.key_rows == (0, rows.numel()) and torch.equal(needed.k_positions, rows)
        else:
            assert torch.equal(rows[needed.key_rows], needed.k_positions)
        assert set(needed.k_positions.tolist()) == set(rows.tolist())  # no row fetched in vain

        def as_matrix(p):
            m = torch.zeros(p.q_positions.numel(), s_pad, dtype=torch.bool)
            allowed = dense_allowed(p.q_positions, p.q_segments, p.k_positions, p.k_segments, window)
            m[:, p.k_positions] = allowed
            return m

        a, b = as_matrix(full), as_matrix(needed)
        real = layout.document_ids[full.q_positions] > 0
        assert torch.equal(a[real], b[real])
        own = torch.zeros(s_pad, dtype=torch.bool)
        own[layout.slot_positions[r]] = True
        assert not (b[~real] & ~own).any() and b[~real].any(dim=1).all()
        # varlen tables: the same query runs; a real run's keys are plan_rank's; every run's keys
        # are one block of its own segment ending at its last query (bottom-right alignment)
        assert torch.equal(needed.cu_seqlens_q, full.cu_seqlens_q)
        cu_q, cu_k, cu_f = needed.cu_seqlens_q.long(), needed.cu_seqlens_k.long(), full.cu_seqlens_k.long()
        assert int(cu_k[-1]) == needed.num_keys
        for i in range(cu_q.numel() - 1):
            keys = needed.k_positions[cu_k[i] : cu_k[i + 1]]
            last_q = needed.q_positions[cu_q[i + 1] - 1]
            assert (needed.k_segments[cu_k[i] : cu_k[i + 1]] == needed.q_segments[cu_q[i]]).all()
            assert int(keys[-1]) == int(last_q)
            if bool(real[cu_q[i]]):
                expect = full.k_positions[cu_f[i] : cu_f[i + 1]]
                if window is not None:  # from the window of the run's first query on
                    expect = expect[expect > needed.q_positions[cu_q[i]] - window]
                assert torch.equal(keys, expect)


@settings(max_examples=100, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS))
def test_routes_deliver_the_needed_rows(runs, cp_size, kind):
    """Simulate the exchange on the tables alone (payload = pack position): every rank ends up
    with exactly its needed keys in key order, and `auto` is never worse than all-gather."""
    layout = make_layout(pack_ids(runs), cp_size, kind)
    plan = plan_exchange(layout)
    routes = [rank_routes(layout, plan, r) for r in range(cp_size)]
    payload = layout.slot_positions
    outbox = {}
    for src, rt in enumerate(routes):
        sent = payload[src][rt.send_rows].split(list(rt.send_counts))
        for dst in range(cp_size):
            outbox[src, dst] = sent[dst]
    for dst, rt in enumerate(routes):
        out = torch.full((rt.num_keys,), -1, dtype=torch.long)
        out[rt.local_out] = payload[dst][rt.local_rows]
        recv = torch.cat([outbox[src, dst] for src in range(cp_size)])
        assert recv.numel() == sum(rt.recv_counts)
        out[rt.recv_out] = recv
        assert torch.equal(out, rt.key_positions)
        assert rt.key_positions.tolist() == sorted(positions_of(plan.needed[dst]))
    chosen = choose_exchange("auto", plan)
    assert chosen in EXCHANGE_KINDS
    if chosen == "halo":
        assert plan.halo_valid
    if cp_size > 1:
        assert plan.max_rows(chosen) <= plan.max_rows("allgather")
        assert plan.max_rows("a2a") <= plan.max_rows("allgather")
    assert choose_exchange("halo", plan) == ("halo" if plan.halo_valid else "a2a")
    assert choose_exchange("auto", plan, needed_only_allowed=False) == "allgather"


def test_plan_input_errors():
    layout = plan_layout(torch.tensor([1, 1, 2, 2, 2, 0]), 2)
    with pytest.raises(ValueError, match="sliding_window"):
        plan_exchange(layout, sliding_window=0)
    with pytest.raises(ValueError, match="kv_exchange"):
        choose_exchange("ring", plan_exchange(layout))
    with pytest.raises(ValueError, match="exchange must be one of"):
        plan_exchange(layout).rows_per_layer("ring", 0)


@pytest.mark.parametrize("heads", [1, 2, 3, 5, 8, 16, 32, 64])
@pytest.mark.parametrize("chunks", [1, 2, 3, 4, 8, 100])
def test_head_groups_cover_every_head_growing(heads, chunks):
    """The pipeline's KV-head groups: every head once, min(chunks, heads) groups, none empty, sizes
    non-decreasing (the exposed first exchange is the smallest), the last at least a third of all."""
    sizes = head_groups(heads, chunks)
    assert sum(sizes) == heads and len(sizes) == min(chunks, heads)
    assert all(s >= 1 for s in sizes) and list(sizes) == sorted(sizes)


def test_head_groups_refuse_bad_counts():
    with pytest.raises(ValueError, match="kv_chunks must be a positive integer"):
        head_groups(8, 0)
    with pytest.raises(ValueError, match="kv_chunks"):
        head_groups(8, True)
    with pytest.raises(ValueError, match="CPConfig|kv_chunks"):
        bdcp.CPConfig(kv_chunks=0)

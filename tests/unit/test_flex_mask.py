"""The FlexAttention mask_mod, the varlen segments and the interval block mask against the dense
per-segment causal mask, on random packs (documents and padding) under every layout kind
(contiguous, balanced, and a head-tail layout built by the test helpers): index-as-position fast
paths and the general gather path, with and without a window."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.kernels.attention.flex import _mask_mod
from hf_blockdiag_cp.planning import dense_allowed
from hf_blockdiag_cp.step import build_step
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy, window_strategy


@settings(max_examples=60, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 4), kind=st.sampled_from(LAYOUT_KINDS), window=window_strategy,
       fast_paths=st.booleans())
def test_mask_mod_matches_dense(runs, cp_size, kind, window, fast_paths):
    layout = make_layout(pack_ids(runs), cp_size, kind)
    for rank in range(cp_size):
        plan = build_step(layout, rank, None, torch.device("cpu"), "flex", "allgather").plan
        if not fast_paths:
            plan = dataclasses.replace(plan, q_offset=None, rows_are_positions=False)
        mod = _mask_mod(plan, window)
        q_idx = torch.arange(plan.q_positions.numel())[:, None]
        kv_idx = torch.arange(plan.row_positions.numel())[None, :]
        got = mod(0, 0, q_idx, kv_idx)
        want = dense_allowed(plan.q_positions, plan.q_segments, plan.row_positions, plan.row_segments, window)
        assert torch.equal(got, want), (rank, got.int(), want.int())


@settings(max_examples=60, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(2, 4), kind=st.sampled_from(LAYOUT_KINDS))
@example(runs=[(False, 24)], cp_size=2, kind="headtail")  # every rank holds two separate chunks of one document
def test_varlen_segments_match_dense(runs, cp_size, kind):
    """Every varlen segment, laid out with bottom-right causal alignment, allows exactly the
    dense mask's pairs, also when a rank holds two separate chunks of one document."""
    from hf_blockdiag_cp.planning import plan_rank

    layout = make_layout(pack_ids(runs), cp_size, kind)
    seg = layout.segments.segment_ids
    for rank in range(cp_size):
        rp = plan_rank(layout, rank)
        got = torch.zeros(rp.q_positions.numel(), rp.k_positions.numel(), dtype=torch.bool)
        cq, ck = rp.cu_seqlens_q.tolist(), rp.cu_seqlens_k.tolist()
        for i in range(len(cq) - 1):
            nq, nk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            for j in range(nq):  # bottom-right: query j sees keys [0, nk - nq + j]
                got[cq[i] + j, ck[i]: ck[i] + nk - nq + j + 1] = True
        # Keys may repeat across segments: compare the sets of allowed (query, key position) pairs.
        pairs = {(int(q), int(rp.k_positions[k])) for q, k in got.nonzero().tolist()}
        allowed = dense_allowed(rp.q_positions, seg[rp.q_positions], torch.arange(layout.padded_seq_len),
                                seg, None)
        want = {(int(q), int(k)) for q, k in allowed.nonzero().tolist()}
        assert pairs == want, (kind, rank)


@settings(max_examples=80, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 3), kind=st.sampled_from(LAYOUT_KINDS), window=window_strategy,
       exchange=st.sampled_from(["allgather", "a2a"]), block=st.sampled_from([2, 4, 8]))
def test_block_classes_against_dense(runs, cp_size, kind, window, exchange, block):
    """The interval block mask never drops an allowed pair: full tiles are exactly the tiles
    whose every pair is allowed (away from the sequence end), kept tiles hold every allowed pair.
    Contiguous rows on the all-gather are the tight case: a query tile's intervals are then
    adjacent, so a kept tile that meets their span holds an allowed pair."""
    from hf_blockdiag_cp.kernels.attention.flex import block_classes, query_intervals

    layout = make_layout(pack_ids(runs), cp_size, kind)
    for rank in range(cp_size):
        plan = build_step(layout, rank, None, torch.device("cpu"), "flex", exchange).plan
        lo, hi = query_intervals(plan, window)
        partial, full = block_classes(lo, hi, plan.row_positions, block)
        want = dense_allowed(plan.q_positions, plan.q_segments, plan.row_positions, plan.row_segments, window)
        n_q, n_k = partial.shape
        pad = torch.zeros(n_q * block, n_k * block, dtype=torch.bool)
        pad[: want.shape[0], : want.shape[1]] = want
        tiles = pad.view(n_q, block, n_k, block)
        any_allowed, all_allowed = tiles.any(dim=(1, 3)), tiles.all(dim=(1, 3))
        assert not (partial & full).any()
        assert torch.equal(full & ~all_allowed, torch.zeros_like(full)), "a full tile holds a masked pair"
        assert not (any_allowed & ~(partial | full)).any(), "an allowed pair fell into a dropped tile"
        inner = all_allowed.clone()  # tiles cut by the sequence end are never full
        if want.shape[0] % block:
            inner[-1] = False
        if want.shape[1] % block:
            inner[:, -1] = False
        assert torch.equal(full, inner), "a tile whose every pair is allowed was not marked full"
        if kind == "contiguous" and exchange == "allgather":  # the tight case: nothing kept in vain
            assert not (partial & ~any_allowed).any()

"""The head-parallel exchange's pure planning (docs/kernels.md, "Head-parallel"): the GQA head
split against brute force over head counts and CP sizes, its whole-pack plan and slot <-> pack
maps, its bytes per layer against a count of the two all-to-alls' buffers, and its place in the
registry (`auto` never takes it; its bytes need the query heads). The exchange on gloo:
multiprocess/test_heads_exchange.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.planning import (
    AttentionShape,
    ExchangeRecord,
    choose_exchange,
    get_exchange,
    head_split_reason,
    kv_head_repeats,
    kv_row_bytes,
    layout_cost,
    plan_exchange,
    plan_layout,
)
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy

HEADS = get_exchange("heads")


def splittable():
    """(query heads, kv heads, G) with G dividing the query heads and kv heads dividing them."""
    return st.tuples(st.integers(1, 8), st.integers(1, 6), st.integers(1, 8)).map(
        lambda t: (t[0] * t[1] * t[2], t[1], t[2]) if t[2] > 1 else (t[0] * t[1], t[1], 1)
    )


@settings(max_examples=200, deadline=None)
@given(split=splittable())
def test_every_rank_reads_the_kv_heads_of_its_query_heads(split):
    """Rank j holds query heads [j·H/G, (j+1)·H/G) and kv copies [j·E/G, (j+1)·E/G) of the kv heads
    repeated `kv_head_repeats` times; its kernel maps local query i to local kv i // (H/E) (GQA on
    its share). That must be kv head h // (H/Hkv) of the full layer, for every query head h."""
    heads, kv_heads, g = split
    assert head_split_reason(heads, kv_heads, g) is None
    repeats = kv_head_repeats(heads, kv_heads, g)
    sent = kv_heads * repeats
    assert sent % g == 0 and heads % sent == 0
    q_share, kv_share = heads // g, sent // g
    for rank in range(g):
        for i in range(q_share):
            copy = rank * kv_share + i // (q_share // kv_share)
            assert copy // repeats == (rank * q_share + i) // (heads // kv_heads), (split, rank, i)
    # no rank receives more copies than query heads, and G dividing Hkv sends each kv head once
    assert kv_share <= q_share and (repeats == 1) == (kv_heads % g == 0)


def test_head_split_refusals_name_the_heads_and_g():
    assert "query heads (4) divisible by the CP size G=3" in head_split_reason(4, 2, 3)
    assert "6 query heads are not a multiple of 4 kv heads" in head_split_reason(6, 4, 2)
    with pytest.raises(ValueError, match="G=3"):
        kv_head_repeats(4, 2, 3)
    assert HEADS.heads_reason(4, 2, 3) is not None and HEADS.heads_reason(4, 2, 4) is None
    assert get_exchange("allgather").heads_reason(4, 2, 3) is None  # K/V exchanges take any heads


@settings(max_examples=60, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 6), kind=st.sampled_from(LAYOUT_KINDS))
def test_the_kernel_sees_the_whole_pack_in_pack_order(runs, cp_size, kind):
    """Every rank's plan: every position as a query, in pack order; the routes put the all-to-all's
    slot-ordered rows in pack order and back (None where they already agree)."""
    layout = make_layout(pack_ids(runs), cp_size, kind)
    s_pad = layout.padded_seq_len
    slots = layout.slot_positions.reshape(-1)  # pack position of each row as the all-to-all delivers them
    for rank in range(cp_size):
        mine = HEADS.plan(layout, None, rank)
        assert torch.equal(mine.row_positions, torch.arange(s_pad))
        assert torch.equal(mine.rank_plan.q_positions, torch.arange(s_pad))
        routes = mine.routes
        assert (routes.rank, routes.cp_size) == (rank, cp_size)
        if torch.equal(slots, torch.arange(s_pad)):
            assert routes.to_pack is None and routes.to_slots is None
        else:
            assert torch.equal(slots[routes.to_pack], torch.arange(s_pad))  # row to_pack[p] holds position p
            assert torch.equal(torch.arange(s_pad)[routes.to_slots], slots)


# (query heads, kv heads, G, kv copies sent in all: the smallest multiple of the kv heads that G divides)
BYTE_CASES = [(4, 2, 2, 2), (4, 2, 4, 4), (12, 6, 4, 12), (8, 1, 4, 4), (6, 3, 3, 3), (32, 8, 8, 8)]


@pytest.mark.parametrize("heads, kv_heads, g, sent_kv", BYTE_CASES)
def test_bytes_per_layer_count_both_all_to_alls(heads, kv_heads, g, sent_kv):
    """Forward: (G-1) blocks of L rows of this rank's q, k, v (kv copies as sent) come in, then
    (G-1) blocks of its own rows' outputs of the other head groups; backward the same again."""
    dk, dv, elem = 8, 6, 2
    layout = plan_layout([5, 19, 3, 11, 7], g)
    plan, rows = plan_exchange(layout), layout.local_len
    first = (g - 1) * rows * (heads // g * dk + sent_kv // g * (dk + dv)) * elem
    second = (g - 1) * rows * (heads // g * dv) * elem
    for rank in range(g):
        got = HEADS.layer_bytes(plan, rank, AttentionShape(heads, kv_heads, dk, dv, elem))
        assert (got.forward, got.backward) == (first + second, first + second)


def test_layout_cost_compares_heads_with_the_kv_exchanges():
    """With the query heads, `layout_cost` lists `heads` beside the K/V exchanges: MHA at G = 4 moves
    half the all-gather's bytes (2/G), GQA 32 / 8 at G = 8 (32 + 8) / 8 / 8 of them."""
    lengths = [300, 41, 700, 23]
    mha = layout_cost(plan_layout(lengths, 4), kv_heads=8, heads=8)
    assert 2 * mha.exchange_bytes["heads"][0] == mha.exchange_bytes["allgather"][0]
    gqa = layout_cost(plan_layout(lengths, 8), kv_heads=8, heads=32)
    assert 8 * 8 * gqa.exchange_bytes["heads"][0] == (32 + 8) * gqa.exchange_bytes["allgather"][0]
    assert "heads" not in layout_cost(plan_layout(lengths, 4)).exchange_bytes  # no query heads given
    assert "heads" not in layout_cost(plan_layout(lengths, 3), heads=8).exchange_bytes  # 8 heads over G = 3
    plan = plan_exchange(plan_layout(lengths, 4))
    with pytest.raises(ValueError, match="its bytes need the layer's heads"):
        HEADS.bytes_per_layer(plan, 0, kv_row_bytes(8, 128, 128, 2))


def test_auto_never_takes_a_head_parallel_record():
    plan = plan_exchange(plan_layout([30, 2, 40], 4))
    assert HEADS.auto_priority is None and choose_exchange("auto", plan) != "heads"
    assert choose_exchange("heads", plan) == "heads" and choose_exchange("heads", None) == "heads"
    with pytest.raises(ValueError, match="needs auto_priority=None"):
        ExchangeRecord(name="eager_heads", plan=HEADS.plan, rows_per_layer=HEADS.rows_per_layer, transport=HEADS.transport,
                       head_parallel=True, unsupported_heads=HEADS.unsupported_heads, row_bytes=HEADS.row_bytes, auto_priority=1)
    with pytest.raises(ValueError, match="needs unsupported_heads and row_bytes"):
        ExchangeRecord(name="bare_heads", plan=HEADS.plan, rows_per_layer=HEADS.rows_per_layer, transport=HEADS.transport,
                       head_parallel=True)

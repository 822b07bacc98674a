"""Exchange plans against brute force over the dense mask (hypothesis, G = 1-8, random packs
with interior padding, contiguous / balanced / head-tail layouts, sliding windows): the needed
keys and traffic, every registered exchange's per-rank plan, the choice among the records, and
the registry's spellings. The real exchanges on gloo are in multiprocess/test_exchange_bytes.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import (
    ExchangeRecord,
    choose_exchange,
    dense_allowed,
    exchange_names,
    exchange_records,
    get_exchange,
    needed_rank_plan,
    needed_rows_per_layer,
    plan_exchange,
    plan_layout,
    plan_rank,
    rank_routes,
    register_exchange,
    validate_rank_plan,
)
from hf_blockdiag_cp.planning.segments import expand
from helpers.exchanges import registered_exchange
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
        # row accounting from the same sets
        sent = sum(len(positions_of(plan.needed[d]) & held[r]) for d in range(cp_size) if d != r)
        assert needed_rows_per_layer(plan, r) == (len(needed - held[r]), sent)
        assert get_exchange("allgather").rows_per_layer(plan, r) == ((cp_size - 1) * layout.local_len,) * 2
    # halo: every sender of a rank owns the position just before one of the rank's runs
    owner = {p: r for r in range(cp_size) for p in held[r]}
    halo_ok = all(
        any(owner.get(p - 1) == src for p in held[dst] if p - 1 not in held[dst])
        for dst in range(cp_size) for src in range(cp_size) if src != dst and int(plan.traffic[src, dst]) > 0
    )
    halo_valid = get_exchange("halo").reason(plan) is None
    assert halo_valid == halo_ok
    if kind == "contiguous":  # the classic statement: no needed document spans more than two ranks
        local = layout.local_len
        assert halo_valid == all(min(positions_of(plan.needed[r])) >= max(r - 1, 0) * local for r in range(cp_size))


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
    check_choice(plan)


def check_choice(plan):
    """`auto` takes the cheapest record that serves the plan (ties: lowest priority); a named one
    runs itself or its fallback; across nodes `auto` keeps off single-node exchanges."""
    serving = [r for r in exchange_records() if r.auto_priority is not None and r.reason(plan) is None]
    chosen = get_exchange(choose_exchange("auto", plan))
    assert chosen in serving
    cheapest = min(r.max_rows(plan) for r in serving)
    assert chosen.max_rows(plan) == cheapest
    assert chosen.auto_priority == min(r.auto_priority for r in serving if r.max_rows(plan) == cheapest)
    across_nodes = get_exchange(choose_exchange("auto", plan, cross_node_ok=False))
    assert not across_nodes.needs_single_node
    for record in exchange_records():
        ran = choose_exchange(record.name, plan)
        assert ran == (record.name if record.reason(plan) is None else record.fallback)
    # the shipped records: halo when valid, else a2a, and never more rows than the all-gather
    assert choose_exchange("halo", plan) == ("halo" if get_exchange("halo").reason(plan) is None else "a2a")
    assert chosen.max_rows(plan) <= get_exchange("allgather").max_rows(plan)
    assert across_nodes.name == "allgather"


@settings(max_examples=40, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS))
def test_every_exchange_plans_exact_attention(runs, cp_size, kind):
    """Every registered exchange's per-rank plan is valid over the rows it returns, and its real
    queries (the rank's rows; every position for a head-parallel exchange, whose kernel sees the
    whole pack) see exactly the keys of the dense mask: a new record is checked here."""
    layout = make_layout(pack_ids(runs), cp_size, kind)
    plan = plan_exchange(layout)
    s_pad = layout.padded_seq_len
    every, segments = torch.arange(s_pad), layout.segments.segment_ids
    for record in exchange_records():
        for r in range(cp_size):
            mine = record.plan(layout, plan if record.needs_plan else None, r)
            rank_plan, rows = mine.rank_plan, mine.row_positions
            validate_rank_plan(rank_plan, record.plan_queries(layout), rank_plan.num_keys, num_rows=rows.numel())
            keys = rows[slice(*rank_plan.key_rows)] if isinstance(rank_plan.key_rows, tuple) else rows[rank_plan.key_rows]
            assert torch.equal(keys, rank_plan.k_positions), (record.name, r)
            queries = every if record.head_parallel else layout.slot_positions[r]
            assert torch.equal(rank_plan.q_positions, queries), (record.name, r)
            real = layout.document_ids[queries] > 0
            want = dense_allowed(queries, segments[queries], every, segments, None)
            seen = torch.zeros(queries.numel(), s_pad, dtype=torch.bool)
            seen[:, rank_plan.k_positions] = dense_allowed(
                rank_plan.q_positions, rank_plan.q_segments, rank_plan.k_positions, rank_plan.k_segments, None
            )
            assert torch.equal(want[real], seen[real]), (record.name, r)
            forward, backward = record.rows_per_layer(plan, r)
            assert forward >= 0 and backward >= 0


def test_plan_input_errors():
    layout = plan_layout(torch.tensor([1, 1, 2, 2, 2, 0]), 2)
    with pytest.raises(ValueError, match="sliding_window"):
        plan_exchange(layout, sliding_window=0)
    with pytest.raises(ValueError, match="kv_exchange='ring' is not an exchange; available: allgather, halo, a2a"):
        choose_exchange("ring", plan_exchange(layout))
    with pytest.raises(ValueError, match="kv_exchange='ring' is not an exchange"):
        get_exchange("ring")


# --------------------------------------------------------------------------- the registry


def _toy(name: str, **fields) -> ExchangeRecord:
    """A record that reuses a2a's plan and transport under another name."""
    a2a = get_exchange("a2a")
    return ExchangeRecord(name=name, plan=a2a.plan, rows_per_layer=a2a.rows_per_layer, transport=a2a.transport, **fields)


def test_config_spellings_come_from_the_registry():
    assert bdcp.CPConfig(kv_exchange="All-To-All").kv_exchange == "a2a"
    assert bdcp.CPConfig(kv_exchange="LEFT_HALO").kv_exchange == "halo"
    with pytest.raises(ValueError, match=r"accepted values: auto, allgather, halo, a2a, heads \(synonyms: .*all_to_all_v"):
        bdcp.CPConfig(kv_exchange="ring")
    with pytest.raises(TypeError, match="kv_exchange must be a string"):
        bdcp.CPConfig(kv_exchange=3)
    with registered_exchange(_toy("ring", aliases=("ring-attention",))):
        assert bdcp.CPConfig(kv_exchange="Ring_Attention").kv_exchange == "ring"
        with pytest.raises(ValueError, match="accepted values: auto, allgather, halo, a2a, heads, ring "):
            bdcp.CPConfig(kv_exchange="zigzag")
    assert exchange_names() == ("allgather", "halo", "a2a", "heads")
    with pytest.raises(ValueError, match="kv_exchange='ring_attention' is not supported"):
        bdcp.CPConfig(kv_exchange="ring_attention")


def test_registry_refuses_ambiguous_records():
    with pytest.raises(ValueError, match="the spelling 'all_to_all' already names 'a2a'"):
        register_exchange(_toy("ring", aliases=("all-to-all",)))
    with pytest.raises(ValueError, match="the spelling 'auto' already names the per-step choice"):
        register_exchange(_toy("auto"))
    with pytest.raises(ValueError, match="cannot fall back to itself"):
        _toy("ring", fallback="ring")
    with pytest.raises(ValueError, match="needs no plan must serve every layout"):
        _toy("ring", needs_plan=False, unsupported_reason=lambda plan: "never")
    assert exchange_names() == ("allgather", "halo", "a2a", "heads")


def test_auto_iterates_the_records():
    """A record with a better priority wins `auto`'s ties and never needs a named case in the chooser;
    one that cannot serve the layout hands an explicit request to its fallback, or raises."""
    layout = plan_layout(torch.tensor([1] * 7 + [2] * 5), 3)  # document 1 spans ranks 0-1, 2 spans 1-2
    plan = plan_exchange(layout)
    assert choose_exchange("auto", plan) == "halo"
    with registered_exchange(_toy("eager", auto_priority=1)):
        assert choose_exchange("auto", plan) == "eager"  # as cheap as halo, preferred
    with registered_exchange(_toy("picky", unsupported_reason=lambda plan: "too picky", fallback="halo", auto_priority=1)):
        assert choose_exchange("auto", plan) == "halo"
        assert choose_exchange("picky", plan) == "halo"
    with registered_exchange(_toy("stubborn", unsupported_reason=lambda plan: "never")):
        with pytest.raises(ValueError, match="kv_exchange='stubborn' cannot serve this layout \\(stubborn: never\\)"):
            choose_exchange("stubborn", plan)

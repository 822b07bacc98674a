"""Needed-only exchange plans against brute force over the dense mask (hypothesis, G = 1-8,
random packs with interior padding, contiguous / balanced / head-tail layouts, sliding
windows), and the real exchanges on gloo: rows, gradients and bytes moved equal the plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.comm import ExchangeMeter, exchange_kv
from hf_blockdiag_cp.planning import (
    EXCHANGE_KINDS,
    choose_exchange,
    kv_row_bytes,
    needed_rank_plan,
    plan_exchange,
    rank_routes,
)
from hf_blockdiag_cp.planning import dense_allowed, layout_strategies, plan_layout, plan_rank
from hf_blockdiag_cp.planning.segments import expand

LAYOUT_STRATEGIES = layout_strategies()

# --------------------------------------------------------------------------- packs and layouts


def pack_ids(runs: list[tuple[bool, int]]) -> torch.Tensor:
    """Document ids from runs of (is_padding, length): documents numbered 1.. in order, padding 0."""
    parts, doc = [], 0
    for is_pad, n in runs:
        if not is_pad:
            doc += 1
        parts.append(torch.full((n,), 0 if is_pad else doc))
    return torch.cat(parts)


def headtail_layout(ids: torch.Tensor, cp_size: int):
    """Zig-zag layout built here, independent of the library: rank r holds chunks r and 2G-1-r."""
    base = plan_layout(ids, cp_size)
    chunk = base.padded_seq_len // (2 * cp_size)
    rows = [
        torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp_size - 1 - r) * chunk, (2 * cp_size - r) * chunk)])
        for r in range(cp_size)
    ]
    return dataclasses.replace(base, strategy="headtail", slot_positions=torch.stack(rows))


def make_layout(ids, cp_size, kind):
    return headtail_layout(ids, cp_size) if kind == "headtail" else plan_layout(ids, cp_size, kind)


LAYOUT_KINDS = tuple(LAYOUT_STRATEGIES) + ("headtail",)

runs_strategy = st.lists(st.tuples(st.booleans(), st.integers(1, 24)), min_size=1, max_size=10)
window_strategy = st.one_of(st.none(), st.integers(1, 12))


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


# --------------------------------------------------------------------------- real exchanges on gloo

HKV, DK, DV = 2, 5, 3  # un-repeated GQA heads and unequal head dims (the MLA-like case of DESIGN §5)


class ByteCounter:
    """Wraps the torch.distributed calls the exchanges use and counts the bytes each rank receives."""

    NAMES = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "batch_isend_irecv")

    def __init__(self, rank):
        self.rank, self.received, self.originals = rank, [], {}

    def __enter__(self):
        for name in self.NAMES:
            fn = getattr(dist, name, None)
            if fn is not None:
                self.originals[name] = fn
                setattr(dist, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc):
        for name, fn in self.originals.items():
            setattr(dist, name, fn)

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.received.append(self._bytes(name, args, kwargs))
            return fn(*args, **kwargs)

        return counted

    def _bytes(self, name, args, kwargs):
        if name == "batch_isend_irecv":
            return sum(op.tensor.nbytes for op in args[0] if op.op.__name__ == "irecv")
        out, inp = args[0], args[1]
        if name.startswith("all_gather"):
            return out.nbytes - inp.nbytes
        if name.startswith("reduce_scatter"):
            return inp.nbytes - out.nbytes
        splits = kwargs.get("output_split_sizes") or args[2]
        return out.nbytes - splits[self.rank] * out[0].nbytes if out.shape[0] else 0

    def take(self):
        total, self.received = sum(self.received), []
        return total


EXCHANGE_LAYOUTS = (
    ("contiguous", [(False, 3), (False, 17), (False, 2), (True, 4), (False, 9)]),
    ("contiguous", [(False, 40), (True, 3)]),  # one document over every rank
    ("headtail", [(False, 5), (False, 30), (True, 2), (False, 11)]),
    ("balanced", [(False, 2), (False, 3), (False, 33), (False, 1), (False, 12)]),
)


def exchange_bytes_case(rank, world_size, group):
    """For every layout and exchange: rows, gradients (float64 reference) and received bytes vs the plan."""
    report = []
    for kind, runs in EXCHANGE_LAYOUTS:
        if kind not in LAYOUT_KINDS:
            continue
        layout = make_layout(pack_ids(runs), world_size, kind)
        plan = plan_exchange(layout)
        s_pad = layout.padded_seq_len
        gen = torch.Generator().manual_seed(7)
        k_all = torch.randn(s_pad, HKV, DK, generator=gen, dtype=torch.float64)
        v_all = torch.randn(s_pad, HKV, DV, generator=gen, dtype=torch.float64)
        mine = layout.slot_positions[rank]
        routes = rank_routes(layout, plan, rank)
        for name in EXCHANGE_KINDS:
            if name == "halo" and not plan.halo_valid:
                continue
            k = k_all[mine].float().requires_grad_()
            v = v_all[mine].float().requires_grad_()
            meter = ExchangeMeter()
            with ByteCounter(rank) as counter:
                out_k, out_v = exchange_kv(name, k, v, group, world_size, routes=routes, meter=meter)
                fwd = counter.take()
                # Row weights seeded by the receiving rank; laid out [D, H, K] so the incoming
                # gradients have non-standard strides (DESIGN §5: gloo and strides).
                rows = routes.key_positions if name != "allgather" else layout.slot_positions.reshape(-1)
                wk = _weights(rank, rows.numel(), DK).permute(2, 1, 0)
                wv = _weights(rank, rows.numel(), DV, offset=1).permute(2, 1, 0)
                loss = (out_k.permute(2, 1, 0) * wk).sum() + (out_v.permute(2, 1, 0) * wv).sum()
                loss.backward()
                bwd = counter.take()
            torch.testing.assert_close(out_k.double(), k_all[rows], rtol=0, atol=1e-6)
            torch.testing.assert_close(out_v.double(), v_all[rows], rtol=0, atol=1e-6)
            gk, gv = _expected_grads(layout, plan, rank, world_size, name)
            torch.testing.assert_close(k.grad.double(), gk, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(v.grad.double(), gv, rtol=1e-5, atol=1e-5)
            planned = plan.bytes_per_layer(name, rank, kv_row_bytes(HKV, DK, DV, 4))
            report.append((kind, name, (fwd, bwd), (planned.forward, planned.backward), (meter.forward_bytes, meter.backward_bytes)))
    return report


def _weights(receiver, rows, dim, offset=0):
    gen = torch.Generator().manual_seed(1000 * receiver + offset)
    return torch.randn(rows, HKV, dim, generator=gen, dtype=torch.float64).float()


def _expected_grads(layout, plan, rank, world_size, name):
    """d(sum over receivers of their weighted outputs) / d(this rank's rows), in float64."""
    s_pad = layout.padded_seq_len
    gk = torch.zeros(s_pad, HKV, DK, dtype=torch.float64)
    gv = torch.zeros(s_pad, HKV, DV, dtype=torch.float64)
    for receiver in range(world_size):
        rows = layout.slot_positions.reshape(-1) if name == "allgather" else expand(plan.needed[receiver])
        gk.index_add_(0, rows, _weights(receiver, rows.numel(), DK).double())
        gv.index_add_(0, rows, _weights(receiver, rows.numel(), DV, offset=1).double())
    mine = layout.slot_positions[rank]
    return gk[mine], gv[mine]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchanges_move_what_the_plan_says(gloo, world_size):
    results = gloo(world_size).run(exchange_bytes_case)
    seen = set()
    for rank, report in enumerate(results):
        for kind, name, measured, planned, metered in report:
            seen.add(name)
            assert measured == planned, f"rank {rank} {kind} {name}: moved (fwd, bwd) {measured} bytes, plan {planned}"
            assert metered == planned, f"rank {rank} {kind} {name}: step meter {metered}, plan {planned}"
    assert seen == set(EXCHANGE_KINDS)

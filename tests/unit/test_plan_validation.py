"""Host-side validation of the varlen metadata (invariant I7, docs/design.md): every plan the
planners build passes `validate_rank_plan` (hypothesis, contiguous / balanced / head-tail
layouts, G = 1-8, all-gather and needed-only plans); hand-corrupted plans raise a ValueError
naming the field. A bad plan on one rank of a real group: multiprocess/test_plan_consensus.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.planning import exchange_names, get_exchange, needed_rank_plan, plan_exchange
from hf_blockdiag_cp.planning import plan_layout, plan_rank, validate_rank_plan
from hf_blockdiag_cp.step import DevicePlan, build_step
from helpers.exchanges import registered_exchange
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy, window_strategy

CPU = torch.device("cpu")


def _validate(plan, layout, num_rows=None, num_keys=None):
    validate_rank_plan(plan, layout.local_len, plan.num_keys if num_keys is None else num_keys, num_rows=num_rows)


@settings(max_examples=150, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS), window=window_strategy)
def test_every_planned_rank_plan_passes(runs, cp_size, kind, window):
    layout = make_layout(pack_ids(runs), cp_size, kind)
    exchange = plan_exchange(layout, window)
    for rank in range(cp_size):
        _validate(plan_rank(layout, rank), layout, num_rows=layout.padded_seq_len)
        _validate(needed_rank_plan(layout, exchange, rank), layout, num_rows=exchange.num_keys(rank))


@pytest.mark.parametrize("strategy", ["contiguous", "balanced"])
@pytest.mark.parametrize("exchange", exchange_names())
def test_cp_step_builds_validated_plans(strategy, exchange):
    layout = plan_layout([5, 40, 3, 9, 1, 22], 4, strategy)
    for rank in range(4):
        step = build_step(layout, rank, None, CPU, "dense", exchange)
        assert step.plan.cu_seqlens_q.dtype == torch.int32 and step.plan.cu_seqlens_q.device == CPU


# --------------------------------------------------------------------------- corrupted plans


def _plan():
    """Rank 1 of a contiguous G=2 layout: its first segment continues a document of rank 0 (keys > queries)."""
    layout = plan_layout([5, 9, 3, 7], 2)
    plan = plan_rank(layout, 1)
    assert int(plan.cu_seqlens_k[1]) > int(plan.cu_seqlens_q[1])
    return layout, plan


def _corrupt(plan, **changes):
    return dataclasses.replace(plan, **changes)


def _int32(values):
    return torch.tensor(values, dtype=torch.int32)


CORRUPTIONS = {
    "wrong dtype q": (lambda p: _corrupt(p, cu_seqlens_q=p.cu_seqlens_q.long()), "cu_seqlens_q", "int32"),
    "wrong dtype k": (lambda p: _corrupt(p, cu_seqlens_k=p.cu_seqlens_k.float()), "cu_seqlens_k", "int32"),
    "2-D": (lambda p: _corrupt(p, cu_seqlens_q=p.cu_seqlens_q[None]), "cu_seqlens_q", "1-D"),
    "too short": (lambda p: _corrupt(p, cu_seqlens_k=_int32([0])), "cu_seqlens_k", "at least two"),
    "not from 0": (lambda p: _corrupt(p, cu_seqlens_q=p.cu_seqlens_q + 1), "cu_seqlens_q", "start at 0"),
    "non-monotone": (
        lambda p: _corrupt(p, cu_seqlens_k=_int32([0, 9, 4, int(p.cu_seqlens_k[-1])])),
        "cu_seqlens_k",
        "non-decreasing",
    ),
    "length mismatch": (
        lambda p: _corrupt(p, cu_seqlens_q=torch.cat([p.cu_seqlens_q[:1], p.cu_seqlens_q])),
        "cu_seqlens_q and cu_seqlens_k",
        "same length",
    ),
    "bad terminal q": (
        lambda p: _corrupt(p, cu_seqlens_q=torch.cat([p.cu_seqlens_q[:-1], p.cu_seqlens_q[-1:] + 1])),
        "cu_seqlens_q",
        "end at the number of local queries",
    ),
    "bad terminal k": (
        lambda p: _corrupt(p, cu_seqlens_k=torch.cat([p.cu_seqlens_k[:-1], p.cu_seqlens_k[-1:] - 1])),
        "cu_seqlens_k",
        "end at the number of selected keys",
    ),
    "empty query segment": (
        lambda p: _corrupt(
            p,
            cu_seqlens_q=torch.cat([p.cu_seqlens_q[:1], p.cu_seqlens_q]),
            cu_seqlens_k=torch.cat([p.cu_seqlens_k[:1], p.cu_seqlens_k]),
        ),
        "cu_seqlens_q",
        "at least one query",
    ),
    "more queries than keys": (
        # move the first segment's extra keys to the second: segment 1 then has fewer keys than queries
        lambda p: _corrupt(p, cu_seqlens_k=torch.cat([p.cu_seqlens_k[:1], p.cu_seqlens_k[1:2] + 3, p.cu_seqlens_k[2:]])),
        "cu_seqlens_k",
        "at least as many keys as queries",
    ),
    "wrong max q": (lambda p: _corrupt(p, max_seqlen_q=p.max_seqlen_q + 1), "max_seqlen_q", "exact maximum"),
    "wrong max k": (lambda p: _corrupt(p, max_seqlen_k=p.max_seqlen_k - 1), "max_seqlen_k", "exact maximum"),
    "max as tensor": (lambda p: _corrupt(p, max_seqlen_k=torch.tensor(p.max_seqlen_k)), "max_seqlen_k", "exact maximum"),
    "k_positions length": (lambda p: _corrupt(p, k_positions=p.k_positions[:-1]), "k_positions", "entries"),
    "q_positions length": (lambda p: _corrupt(p, q_positions=p.q_positions[:-1]), "q_positions", "entries"),
    "key_rows out of range": (
        lambda p: _corrupt(p, key_rows=(p.key_rows[0] + 100, p.key_rows[1] + 100)),
        "key_rows",
        "range of",
    ),
    "key_rows index out of range": (
        lambda p: _corrupt(p, key_rows=torch.arange(p.num_keys) + 100),
        "key_rows",
        "inside [0,",
    ),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corrupted_plan_raises_naming_the_field(case):
    layout, plan = _plan()
    _validate(plan, layout, num_rows=layout.padded_seq_len)
    corrupt, field_name, expectation = CORRUPTIONS[case]
    bad = corrupt(plan)
    with pytest.raises(ValueError) as info:
        _validate(bad, layout, num_rows=layout.padded_seq_len, num_keys=plan.num_keys)
    message = str(info.value)
    assert field_name in message and expectation in message, message


def test_cuda_offsets_are_refused_on_the_host():
    layout, plan = _plan()
    meta = _corrupt(plan, cu_seqlens_q=plan.cu_seqlens_q.to("meta"))
    with pytest.raises(ValueError, match="cu_seqlens_q must be on the CPU"):
        _validate(meta, layout)


@pytest.mark.parametrize("exchange", exchange_names())
def test_cp_step_refuses_a_bad_plan(exchange):
    """Whatever an exchange record plans is validated before the step exists."""
    layout, _ = _plan()
    record = get_exchange(exchange)

    def corrupted(layout, exchange_plan, rank):
        mine = record.plan(layout, exchange_plan, rank)
        return dataclasses.replace(mine, rank_plan=_corrupt(mine.rank_plan, max_seqlen_k=mine.rank_plan.max_seqlen_k + 1))

    with registered_exchange(dataclasses.replace(record, plan=corrupted)):
        with pytest.raises(ValueError, match="max_seqlen_k"):
            build_step(layout, 1, None, CPU, "dense", exchange)


def test_device_plan_checks_the_moved_offsets():
    layout, plan = _plan()
    rows = layout.slot_positions.reshape(-1)
    args = (rows, layout.segments.segment_ids[rows], layout.segments.segment_starts[plan.q_positions])
    DevicePlan.from_rank_plan(plan, CPU, *args)
    with pytest.raises(ValueError, match="cu_seqlens_k must have dtype torch.int32"):
        DevicePlan.from_rank_plan(_corrupt(plan, cu_seqlens_k=plan.cu_seqlens_k.long()), CPU, *args)

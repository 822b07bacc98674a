"""The needed-key gather (`attention.dispatch.needed_keys`) against a float64 `index_select` reference:
its occurrence levels (`planning.key_row_levels`) and its gradient, on random layouts of every
kind with the all-gather's rows and the needed-only exchanges' rows (hypothesis, G = 1-8)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.attention.dispatch import needed_keys
from hf_blockdiag_cp.planning import key_row_levels
from hf_blockdiag_cp.step import build_step
from helpers.layouts import LAYOUT_KINDS, make_layout, pack_ids, runs_strategy


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(st.integers(0, 12), max_size=40))
def test_key_row_levels_name_each_occurrence_once(rows):
    key_rows = torch.tensor(rows, dtype=torch.long)
    levels = key_row_levels(key_rows)
    seen: dict[int, int] = {}
    expected_level = []
    for r in rows:  # the l-th occurrence of a row (in key order) belongs to level l
        expected_level.append(seen.get(r, 0))
        seen[r] = seen.get(r, 0) + 1
    got = {}
    for level, (pos, row) in enumerate(levels):
        assert torch.equal(key_rows[pos], row)
        assert bool((row[1:] > row[:-1]).all()), "rows ascend and occur once per level"
        for p in pos.tolist():
            assert p not in got
            got[p] = level
    assert got == dict(enumerate(expected_level))
    assert len(levels) == max(seen.values(), default=0)


@settings(max_examples=60, deadline=None)
@given(runs=runs_strategy, cp_size=st.integers(1, 8), kind=st.sampled_from(LAYOUT_KINDS),
       exchange=st.sampled_from(["allgather", "a2a", "halo"]), seed=st.integers(0, 2**16))
def test_needed_key_gradient_equals_index_select(runs, cp_size, kind, exchange, seed):
    layout = make_layout(pack_ids(runs), cp_size, kind)
    gen = torch.Generator().manual_seed(seed)
    for rank in range(cp_size):
        step = build_step(layout, rank, None, torch.device("cpu"), "dense", exchange)
        plan = step.plan
        num_rows = plan.row_positions.numel()
        rows_k = torch.randn(num_rows, 2, 3, generator=gen, dtype=torch.float64, requires_grad=True)
        rows_v = torch.randn(num_rows, 2, 5, generator=gen, dtype=torch.float64, requires_grad=True)
        k, v = needed_keys(plan, rows_k, rows_v)
        grad_k, grad_v = torch.randn_like(k), torch.randn_like(v)
        torch.autograd.backward((k, v), (grad_k, grad_v))
        index = (torch.arange(*plan.key_range) if plan.key_index is None else plan.key_index)
        ref_k, ref_v = rows_k.detach().clone().requires_grad_(), rows_v.detach().clone().requires_grad_()
        torch.autograd.backward((ref_k.index_select(0, index), ref_v.index_select(0, index)), (grad_k, grad_v))
        assert torch.equal(k, ref_k.index_select(0, index).detach()) and torch.equal(v, ref_v.index_select(0, index).detach())
        torch.testing.assert_close(rows_k.grad, ref_k.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(rows_v.grad, ref_v.grad, rtol=1e-12, atol=1e-12)

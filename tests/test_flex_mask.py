"""The FlexAttention mask_mod equals the dense per-segment causal mask for every plan shape:
index-as-position fast paths and the general gather path, with and without a window."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_blockdiag_cp.kernels.flex import _mask_mod
from hf_blockdiag_cp.layout import dense_allowed, plan_layout
from hf_blockdiag_cp.state import CPStep


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("cp_size", [1, 3])
@pytest.mark.parametrize("fast_paths", [True, False])
def test_mask_mod_matches_dense(window, cp_size, fast_paths):
    doc_ids = torch.tensor([1] * 5 + [2] * 9 + [3] + [0] * 2 + [4] * 7)
    layout = plan_layout(doc_ids, cp_size)
    for rank in range(cp_size):
        plan = CPStep.for_rank(layout, rank, None, torch.device("cpu"), "flex", "allgather").plan
        if not fast_paths:
            plan = dataclasses.replace(plan, q_offset=None, rows_are_positions=False)
        mod = _mask_mod(plan, window)
        q_idx = torch.arange(plan.q_positions.numel())[:, None]
        kv_idx = torch.arange(plan.row_positions.numel())[None, :]
        got = mod(0, 0, q_idx, kv_idx)
        want = dense_allowed(plan.q_positions, plan.q_segments, plan.row_positions, plan.row_segments, window)
        assert torch.equal(got, want), (rank, got.int(), want.int())

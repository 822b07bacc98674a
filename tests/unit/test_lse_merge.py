"""The merge of two partial softmaxes (`kernels.attention.lse`), against float64 softmax attention over the
union of the two key sets: the value, and every gradient (outputs and log-sum-exps) by
`torch.autograd.gradcheck`, for a range of rows and an index of rows."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.kernels.attention.lse import merge_into


def _partial(q, k, v):
    """Softmax attention of q [n,H,D] over k, v [m,H,D] -> (out [n,H,D], lse [n,H])."""
    scores = torch.einsum("nhd,mhd->hnm", q, k)
    return torch.einsum("hnm,mhd->nhd", torch.softmax(scores, -1), v), torch.logsumexp(scores, -1).T


@pytest.mark.parametrize("rows", [(2, 5), torch.tensor([0, 3, 4])], ids=["range", "index"])
def test_merged_rows_are_the_softmax_over_both_key_sets(rows):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 2, 4, generator=gen, dtype=torch.float64)
    k, v = torch.randn(2, 7, 2, 4, generator=gen, dtype=torch.float64)
    k2, v2 = torch.randn(2, 5, 2, 4, generator=gen, dtype=torch.float64)
    out, lse = _partial(q, k, v)
    index = torch.arange(*rows) if isinstance(rows, tuple) else rows
    other_out, other_lse = _partial(q[index], k2, v2)
    merged = merge_into(out, lse, rows, other_out, other_lse)
    union_out, _ = _partial(q[index], torch.cat([k, k2]), torch.cat([v, v2]))
    torch.testing.assert_close(merged[index], union_out, rtol=1e-12, atol=1e-12)
    untouched = torch.ones(6, dtype=torch.bool)
    untouched[index] = False
    assert torch.equal(merged[untouched], out[untouched])
    inputs = [t.detach().clone().requires_grad_(True) for t in (out, lse, other_out, other_lse)]
    assert torch.autograd.gradcheck(lambda a, b, c, d: merge_into(a, b, rows, c, d), inputs)

"""Random q, k, v (fp64) over a planned contiguous layout, for the kernel feature tests."""

from __future__ import annotations

import torch

from hf_blockdiag_cp.planning import document_ids_from_lengths, plan_layout


def kernel_inputs(world_size, lengths=(5, 7, 3, 9, 4, 2), heads=4, kv_heads=2, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = document_ids_from_lengths(list(lengths))
    layout = plan_layout(ids, world_size)
    s_pad = layout.padded_seq_len
    q = torch.randn(s_pad, heads, dk, generator=g, dtype=torch.float64)
    k = torch.randn(s_pad, kv_heads, dk, generator=g, dtype=torch.float64)
    v = torch.randn(s_pad, kv_heads, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    return layout, q, k, v, sinks

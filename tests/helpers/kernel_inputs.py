"""Random q, k, v (fp64) over a planned contiguous layout, and the fp64 attention reference over the
whole pack (per-document causal, window, softcap, sinks), for the kernel feature tests."""

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


def naive_attention(q, k, v, doc_ids, *, scale, window=None, softcap=None, sinks=None):
    """fp64 reference over the whole pack: q/k/v [S,H*,D], per-document causal, window, softcap, sinks."""
    q, k, v = q.double(), k.double(), v.double()
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[0])
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)

"""FlexAttention kernel: a document-causal block mask over pack positions.

The block mask is built once per step and sliding window (first layer), then reused by
every layer and by recompute. On CUDA both the mask builder and the kernel are compiled
once per process; FlexAttention has no CPU backward, so `auto` never picks it on CPU.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from ..state import CPStep


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _mask_mod(q_pos, q_seg, k_pos, k_seg, sliding_window):
    def mask_mod(b, h, q_idx, kv_idx):
        allowed = (q_seg[q_idx] == k_seg[kv_idx]) & (k_pos[kv_idx] <= q_pos[q_idx])
        if sliding_window is not None:
            allowed = allowed & (k_pos[kv_idx] > q_pos[q_idx] - sliding_window)
        return allowed

    return mask_mod


def build_block_mask(step: CPStep, sliding_window: int | None):
    plan = step.plan
    device = plan.q_positions.device
    mask_mod = _mask_mod(plan.q_positions, plan.q_segments, plan.k_positions, plan.k_segments, sliding_window)
    return create_block_mask(
        mask_mod,
        None,
        None,
        plan.q_positions.numel(),
        plan.k_positions.numel(),
        device=device,
        _compile=device.type == "cuda",
    )


def flex_attention_kernel(q, k, v, step: CPStep, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,Dk], k [K,Hkv,Dk], v [K,Hkv,Dv] -> [L,H,Dv]."""
    block_mask = step.cached(("flex", sliding_window), lambda: build_block_mask(step, sliding_window))
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out = fn(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)

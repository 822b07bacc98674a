"""Dense kernel: SDPA with a boolean [L, K_needed] per-segment causal mask.

The reference and last fallback: exact, runs anywhere (CPU fp32 training included), but
memory and time grow with L·K. Never used on a fast path by `auto` on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..layout import dense_allowed
from ..state import CPStep


def dense_attention(q, k, v, step: CPStep, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,Dk], k [K,Hkv,Dk], v [K,Hkv,Dv] -> [L,H,Dv]."""
    plan = step.plan
    mask = step.cached(
        ("dense", sliding_window),
        lambda: dense_allowed(plan.q_positions, plan.q_segments, plan.k_positions, plan.k_segments, sliding_window),
    )
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)

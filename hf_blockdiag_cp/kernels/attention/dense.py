"""Dense kernel: attention over a boolean [L, K_needed] per-segment causal mask.

The reference and last fallback: exact, runs anywhere (CPU fp32 training included), but
memory and time grow with L·K. Never used on a fast path by `auto` on CUDA.

Plain layers run SDPA with the mask. Layers with a logit softcap (Gemma2) or attention sinks
(GPT-OSS) need the scores themselves, so they run `attention_with_features`: explicit math
on `[H, L, K_needed]` scores, still nothing of size S².
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...planning.rank_plan import dense_allowed
from .registry import KernelRecord, register_kernel


def attention_with_features(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor | None,
    *,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Softmax attention with the features SDPA lacks. q [H,L,Dk], k [Hkv,K,Dk], v [Hkv,K,Dv] -> [H,L,Dv]
    (with `return_lse`, and the log-sum-exp [H,L] of the scores, sinks included, `kernels.attention.lse`).

    `allowed` is a boolean mask broadcastable to [H,L,K] (None: every key); `bias` an additive
    float mask (the eager convention). Query head h reads key head h // (H // Hkv), as
    Transformers' `repeat_kv` does, without materialising the repeat. `softcap` maps scores to
    `softcap·tanh(s/softcap)` before masking; `sinks [H]` adds one extra logit per head to the
    softmax denominator (its probability mass is dropped), i.e. once to the final log-sum-exp.
    Scores and softmax are computed in at least float32.
    """
    heads, q_len, head_dim_k = q.shape
    kv_heads, k_len, _ = k.shape
    group = heads // kv_heads
    grouped_q = q.reshape(kv_heads, group * q_len, head_dim_k)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(grouped_q, k.transpose(1, 2)).view(heads, q_len, k_len).to(acc) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias.to(acc)
    if allowed is not None:
        # Finite, like the eager path's additive mask: a fully masked row (left padding outside a
        # step) stays finite instead of turning into NaN that later layers would pick up.
        scores = scores.masked_fill(~allowed, torch.finfo(acc).min)
    if sinks is None and not return_lse:
        probs = torch.softmax(scores, dim=-1)
    else:
        total = torch.logsumexp(scores, dim=-1, keepdim=True)
        if sinks is not None:
            total = torch.logaddexp(total, sinks.to(acc).reshape(heads, 1, 1))
        probs = torch.exp(scores - total)
    out = torch.matmul(probs.to(v.dtype).view(kv_heads, group * q_len, k_len), v).view(heads, q_len, v.shape[-1])
    return (out, total.squeeze(-1)) if return_lse else out


def _run_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total)


def _run_mask(plan, sliding_window: int | None) -> torch.Tensor:
    """The dense mask, restricted to each query run's own keys (`cu_seqlens_q/k`).

    A rank may hold two separate chunks of one document (head-tail layouts); each chunk is
    its own run whose keys repeat the document's earlier keys, so a key position can appear
    once per run. Matching runs makes every (query, key position) pair count once.
    """
    allowed = dense_allowed(plan.q_positions, plan.q_segments, plan.k_positions, plan.k_segments, sliding_window)
    q_run = _run_ids(plan.cu_seqlens_q, plan.q_positions.numel())
    k_run = _run_ids(plan.cu_seqlens_k, plan.k_positions.numel())
    return allowed & (q_run[:, None] == k_run[None, :])


def dense_attention(
    q,
    k,
    v,
    step,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """q [L,H,Dk], k [K,Hkv,Dk], v [K,Hkv,Dv] -> [L,H,Dv] (with `return_lse`, and lse [L,H], `kernels.attention.lse`).

    The mask comes from pack positions and segments, so a plan that is not causal (every key
    before its run's queries) needs nothing else."""
    plan = step.plan
    mask = step.cached(("dense", sliding_window), lambda: _run_mask(plan, sliding_window))
    if softcap is not None or sinks is not None or return_lse:
        out = attention_with_features(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), mask, scale=scale, softcap=softcap, sinks=sinks,
            return_lse=return_lse,
        )
        if return_lse:
            out, lse = out
            return out.transpose(0, 1), lse.transpose(0, 1)
        return out.transpose(0, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        attn_mask=mask[None, None],
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


register_kernel(
    KernelRecord(
        name="dense",
        aliases=("sdpa",),
        fn=dense_attention,
        check=lambda device, dtype, head_dim_k, head_dim_v: None,  # exact anywhere: the reference and the CPU path
        features=frozenset({"softcap", "sinks"}),
        auto_priority=100,  # last resort on every device; the only kernel that trains on CPU
        auto_devices=None,
        lse_check=lambda device, dtype, head_dim_k, head_dim_v: None,  # explicit scores: autograd through the lse
    )
)

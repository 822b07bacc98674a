"""FlexAttention kernel: a document-causal block mask over pack positions.

The block mask is built once per step and sliding window (first layer), then reused by
every layer and by recompute. On CUDA both the mask builder and the kernel are compiled
once per process; FlexAttention has no CPU backward, so `auto` never picks it on CPU.

A logit softcap (Gemma2) is a `score_mod`. Attention sinks (GPT-OSS) cannot be a
`score_mod` (they add a logit that has no key), so the kernel returns its log-sum-exp and
rescales the output by `exp(lse - logaddexp(lse, sink)) = sigmoid(lse - sink)`.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from ..state import CPStep


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _mask_mod(plan, sliding_window):
    """Segments are contiguous runs of pack positions, so "same segment and causal" is one
    interval per query: q_start <= k <= q. When the rows or the queries are a plain range of
    positions (contiguous layout, all-gather), the index is the position: fewer loads in the
    kernel's partial blocks."""
    q_start, q_positions, k_positions = plan.q_starts, plan.q_positions, plan.row_positions
    q_offset, rows_are_positions = plan.q_offset, plan.rows_are_positions

    def mask_mod(b, h, q_idx, kv_idx):
        key = kv_idx if rows_are_positions else k_positions[kv_idx]
        query = q_idx + q_offset if q_offset is not None else q_positions[q_idx]
        lower = q_start[q_idx]
        if sliding_window is not None:
            lower = torch.maximum(lower, query - sliding_window + 1)
        return (key >= lower) & (key <= query)

    return mask_mod


def build_block_mask(step: CPStep, sliding_window: int | None):
    plan = step.plan
    device = plan.q_positions.device
    return create_block_mask(
        _mask_mod(plan, sliding_window),
        None,
        None,
        plan.q_positions.numel(),
        plan.row_positions.numel(),
        device=device,
        _compile=device.type == "cuda",
    )


def block_mask(step: CPStep, sliding_window: int | None):
    """The step's block mask for this window: built once (by the shard step or the first layer)."""
    return step.cached(("flex", sliding_window), lambda: build_block_mask(step, sliding_window))


@functools.cache
def _softcap_score_mod(softcap: float):
    # One function object per value: compiled kernels guard on the score_mod's identity.
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_attention_kernel(
    q,
    k,
    v,
    step: CPStep,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [L,H,Dk], k/v: every exchange row [R,Hkv,D] (masked by pack position) -> [L,H,Dv]."""
    mask = block_mask(step, sliding_window)
    fn = _compiled_flex() if q.is_cuda else flex_attention
    extra = {}
    if softcap is not None:
        extra["score_mod"] = _softcap_score_mod(float(softcap))
    if sinks is not None:
        extra["return_aux"] = AuxRequest(lse=True)
    out = fn(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        **extra,
    )
    if sinks is not None:
        out, aux = out
        lse = aux.lse[0].float()  # [H, L], natural log
        out = out * torch.sigmoid(lse - sinks.float().reshape(-1, 1)).unsqueeze(-1).to(out.dtype)
    return out[0].transpose(0, 1)

"""Transformer Engine kernel (`transformer_engine.pytorch.DotProductAttention`). Experimental: not verified on a GPU,
so `auto` never picks it; it engages only when asked for and its package imports.

The same varlen segments as the torch varlen kernel, in TE's packed `thd` layout with
`attn_mask_type="padding_causal_bottom_right"`: causality is aligned to the bottom-right of
each segment, which is what a run that continues an earlier document (more keys than
queries) needs. GQA is native (`num_gqa_groups`); no softcap, no sinks. One module per
(heads, kv heads, head dim, scale, device), built at the first call and reused.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ...registry import optional_import
from .registry import KernelRecord, half_precision_cuda_reason, register_kernel


def _te_module():
    """`transformer_engine.pytorch`, or None when it does not import (not installed, no CUDA build)."""
    return optional_import("transformer_engine.pytorch")[0]


def available() -> bool:
    return _te_module() is not None


@functools.cache
def _attention(heads: int, kv_heads: int, head_dim: int, scale: float, device: torch.device):
    te = _te_module()
    module = te.DotProductAttention(
        heads,
        head_dim,
        num_gqa_groups=kv_heads,
        attention_dropout=0.0,
        qkv_format="thd",
        attn_mask_type="padding_causal_bottom_right",
        softmax_scale=scale,
    )
    return module.to(device)


@functools.cache
def _forward_accepts_window() -> bool:
    te = _te_module()
    return te is not None and "window_size" in inspect.signature(te.DotProductAttention.forward).parameters


def te_attention_kernel(q, k, v, step, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,D], k [K,Hkv,D], v [K,Hkv,D] -> [L,H,D]."""
    if _te_module() is None:
        raise ValueError("attn_backend='te' needs Transformer Engine (transformer_engine.pytorch), which does not import here")
    extra = {}
    if sliding_window is not None:
        if not _forward_accepts_window():
            raise ValueError(
                "attn_backend='te': this Transformer Engine release takes no window_size in DotProductAttention.forward, "
                "so it cannot run a sliding-window layer; use attn_backend='varlen' / 'flex'"
            )
        extra["window_size"] = (sliding_window - 1, 0)
    plan = step.plan
    attention = _attention(q.shape[1], k.shape[1], q.shape[2], float(scale), q.device)
    out = attention(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q=plan.cu_seqlens_q,
        cu_seqlens_kv=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q,
        max_seqlen_kv=plan.max_seqlen_k,
        **extra,
    )
    return out.view(q.shape[0], q.shape[1], v.shape[2])


def _check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    package = "Transformer Engine (transformer_engine.pytorch)"
    if (error := optional_import("transformer_engine.pytorch")[1]) is not None:
        return f"{package} does not import in this environment: {error} (the [te] extra)"
    return half_precision_cuda_reason(package, device, dtype, head_dim_k, head_dim_v)


register_kernel(
    KernelRecord(
        name="te",
        aliases=("transformer_engine", "transformerengine"),
        fn=te_attention_kernel,
        check=_check,
    )
)

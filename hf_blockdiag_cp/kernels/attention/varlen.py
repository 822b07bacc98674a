"""torch varlen kernel (`torch.nn.attention.varlen.varlen_attn`, FlashAttention underneath).

One varlen segment per run of consecutive local queries of one document; its keys run from
the document's start to the run's last query. A run that does not start its document (the
first run of a contiguous shard, any chunk of a head-tail split) has more keys than queries,
and `window_size=(left, 0)` aligns causality bottom-right, which is exactly what such a run
needs. GQA is native; K/V heads are never repeated.
"""

from __future__ import annotations

import functools
import inspect

import torch

from .registry import KernelRecord, calibrated_cost, half_precision_cuda_reason, register_kernel

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # pragma: no cover - depends on the torch build
    varlen_attn = None


@functools.cache
def _accepts_enable_gqa() -> bool:
    return varlen_attn is not None and "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_attention_kernel(q, k, v, step, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,Dk], k [K,Hkv,Dk], v [K,Hkv,Dv] -> [L,H,Dv]."""
    plan = step.plan
    left = -1 if sliding_window is None else sliding_window - 1
    extra = {"enable_gqa": True} if _accepts_enable_gqa() and q.shape[1] != k.shape[1] else {}
    return varlen_attn(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        plan.cu_seqlens_q,
        plan.cu_seqlens_k,
        plan.max_seqlen_q,
        plan.max_seqlen_k,
        scale=scale,
        window_size=(left, 0),
        **extra,
    )


def _check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    if varlen_attn is None:
        return "torch.nn.attention.varlen is not available in this torch build"
    return half_precision_cuda_reason("varlen_attn", device, dtype, head_dim_k, head_dim_v)


register_kernel(
    KernelRecord(
        name="varlen",
        aliases=("torch_varlen", "varlen_attn"),
        fn=varlen_attention_kernel,
        check=_check,
        auto_priority=10,  # after fa4 (docs/performance.md compares them)
        cost=calibrated_cost("varlen"),
    )
)

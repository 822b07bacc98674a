"""flash-attn kernel (`flash_attn.flash_attn_varlen_func`). Experimental: not verified on a GPU,
so `auto` never picks it; it engages only when asked for and its package imports.

Same segments as the torch varlen kernel: one varlen segment per run of local queries of one
document, its keys from the document's start (or the window's) to the run's last query. A run
that continues a document begun before it has more keys than queries; flash-attn >= 2.1
(the floor of the `[flash]` extra) aligns `causal=True` bottom-right, which is what such a
run needs, so one call does everything. GQA is native; no softcap, no sinks.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ...registry import optional_import
from .registry import KernelRecord, half_precision_cuda_reason, register_kernel


def _flash_module():
    """The imported `flash_attn` package, or None when it does not import (not installed, broken build)."""
    return optional_import("flash_attn")[0] if _varlen()[1] is None else None


def _varlen():
    return optional_import("flash_attn", "flash_attn_varlen_func")


def available() -> bool:
    return _flash_module() is not None


@functools.cache
def _accepts_window() -> bool:
    fa = _flash_module()
    return fa is not None and "window_size" in inspect.signature(fa.flash_attn_varlen_func).parameters


def _window_kwargs(sliding_window: int | None) -> dict:
    if sliding_window is None:
        return {}
    if not _accepts_window():
        raise ValueError(
            "attn_backend='flash': this flash-attn release has no window_size argument (added in 2.3), so it cannot "
            "run a sliding-window layer; upgrade flash-attn or use attn_backend='varlen' / 'flex'"
        )
    return {"window_size": (sliding_window - 1, 0)}


def flash_attention_kernel(q, k, v, step, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,D], k [K,Hkv,D], v [K,Hkv,D] -> [L,H,D]."""
    fa = _flash_module()
    if fa is None:
        raise ValueError("attn_backend='flash' needs the flash-attn package, which does not import here")
    plan = step.plan
    return fa.flash_attn_varlen_func(
        q.contiguous(), k.contiguous(), v.contiguous(), plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q,
        plan.max_seqlen_k, softmax_scale=scale, causal=True, **_window_kwargs(sliding_window),
    )


def _check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    package = "flash-attn (flash_attn)"
    if (error := _varlen()[1]) is not None:
        return f"{package} does not import in this environment: {error} (the [flash] extra)"
    if head_dim_k > 256:
        return f"flash-attn supports head dims up to 256, got {head_dim_k}"
    return half_precision_cuda_reason(package, device, dtype, head_dim_k, head_dim_v)


register_kernel(
    KernelRecord(
        name="flash",
        aliases=("flash_attn", "flashattention", "flash_attention", "fa2"),
        fn=flash_attention_kernel,
        check=_check,
    )
)

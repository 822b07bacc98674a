"""FlashAttention-4 kernel (`flash_attn.cute.flash_attn_varlen_func`, CuTe-DSL kernels with SM90
and SM100 forward and backward; the `[fa4]` extra).

The same varlen segments as the torch varlen kernel: one segment per run of local queries of
one document, its keys from the document's start (or the window's) to the run's last query.
`causal=True` aligns bottom-right, which is what a run that continues an earlier document
(more keys than queries) needs. GQA is native; a logit softcap and learnable attention sinks
(one logit per head, added once to the softmax denominator) are kernel arguments, forward and
backward; Dk may differ from Dv where the kernel supports it.

Refused where it was not verified on a GPU: only SM90 / SM100 devices, fp16 / bf16, and the
(Dk, Dv) pairs in `VERIFIED_HEAD_DIMS` (checked fwd+bwd against an fp32 reference on an H200;
at head dim 16 the backward was silently wrong, so nothing outside the list runs).
"""

from __future__ import annotations


import torch

from ...registry import optional_import
from .registry import HALF, KernelRecord, calibrated_cost, register_kernel

# (Dk, Dv) pairs whose forward and backward matched an fp32 reference on the H200 (docs/kernels.md).
VERIFIED_HEAD_DIMS = frozenset({(64, 64), (128, 128), (256, 256), (192, 128)})
# Of those, the pairs whose lse output and backward through it (the split by keys) matched float64 on the
# H200, with softcap and sinks, causal and not (tests/gpu/test_lse_kernels_gpu.py; (192, 128) failed there).
LSE_VERIFIED_HEAD_DIMS = frozenset({(64, 64), (128, 128)})
SUPPORTED_ARCH_MAJOR = (9, 10)  # SM90 (Hopper), SM100 (Blackwell)


def _varlen_func():
    """`flash_attn.cute.flash_attn_varlen_func`, or None when flash-attn-4 does not import here."""
    return optional_import("flash_attn.cute", "flash_attn_varlen_func")[0]


def available() -> bool:
    return _varlen_func() is not None


def fa4_attention_kernel(
    q, k, v, step, *, scale: float, sliding_window: int | None, softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """q [L,H,Dk], k [K,Hkv,Dk], v [K,Hkv,Dv] -> [L,H,Dv] (with `return_lse`, and lse [L,H] float32).

    A plan that is not causal (`RankPlan.causal`: every key before its run) runs with
    `causal=False`; the split by keys gives such plans no window (`attention.entry`)."""
    fn = _varlen_func()
    if fn is None:
        raise ValueError("attn_backend='fa4' needs flash-attn-4 (flash_attn.cute), which does not import here")
    plan = step.plan
    if not plan.causal and sliding_window is not None:
        raise ValueError("the fa4 kernel runs a plan that is not causal without a sliding window only")
    window = (None, None) if sliding_window is None else (sliding_window - 1, 0)
    out = fn(
        q.contiguous(), k.contiguous(), v.contiguous(),
        cu_seqlens_q=plan.cu_seqlens_q, cu_seqlens_k=plan.cu_seqlens_k,
        max_seqlen_q=plan.max_seqlen_q, max_seqlen_k=plan.max_seqlen_k,
        softmax_scale=scale, causal=plan.causal, window_size=window,
        learnable_sink=None if sinks is None else sinks.float().reshape(-1),
        softcap=0.0 if softcap is None else float(softcap),
        **({"return_lse": True} if return_lse else {}),
    )
    if return_lse:
        out, lse = out
        return out, lse.transpose(0, 1)  # flash-attn-4's varlen lse is [H, total_q]
    return out[0] if isinstance(out, tuple) else out


def _check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    error = optional_import("flash_attn.cute", "flash_attn_varlen_func")[1]
    if error is not None:
        return f"flash-attn-4 (flash_attn.cute) does not import in this environment: {error} (the [fa4] extra)"
    if device.type != "cuda":
        return "flash-attn-4 needs a CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major not in SUPPORTED_ARCH_MAJOR:
        return f"flash-attn-4 runs on SM90 / SM100 here; this device is SM{major}{minor}"
    if dtype not in HALF:
        return f"flash-attn-4 needs float16 or bfloat16, got {dtype}"
    if (head_dim_k, head_dim_v) not in VERIFIED_HEAD_DIMS:
        return (
            f"flash-attn-4 was verified on a GPU only for (Dk, Dv) in {sorted(VERIFIED_HEAD_DIMS)}; got "
            f"({head_dim_k}, {head_dim_v}) (at head dim 16 its backward is silently wrong)"
        )
    return None


def _lse_check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    if (head_dim_k, head_dim_v) not in LSE_VERIFIED_HEAD_DIMS:
        return (
            f"flash-attn-4's log-sum-exp and its backward were verified on a GPU only for (Dk, Dv) in "
            f"{sorted(LSE_VERIFIED_HEAD_DIMS)}; got ({head_dim_k}, {head_dim_v})"
        )
    return None


register_kernel(
    KernelRecord(
        name="fa4",
        aliases=("flash_attn_4", "flashattention4", "flash4", "flash_attention_4"),
        fn=fa4_attention_kernel,
        check=_check,
        features=frozenset({"softcap", "sinks"}),
        auto_priority=5,  # first: the fastest kernel measured (docs/performance.md)
        cost=calibrated_cost("fa4"),
        lse_check=_lse_check,
    )
)

"""Local attention kernels behind one signature, and the choice among them.

Every kernel takes this rank's queries `q [L, H, Dk]` and the keys/values it needs
`k [K, Hkv, Dk]`, `v [K, Hkv, Dv]` (in the step plan's key order) and returns `[L, H, Dv]`.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import flash as _flash
from . import te as _te
from . import varlen as _varlen
from .dense import dense_attention
from .flash import flash_attention_kernel
from .flex import flex_attention_kernel
from .te import te_attention_kernel
from .varlen import varlen_attention_kernel

KERNELS: dict[str, Callable] = {
    "dense": dense_attention,
    "flex": flex_attention_kernel,
    "varlen": varlen_attention_kernel,
    # Experimental (unverified on a GPU): engage only when their package imports; never chosen by `auto`.
    "flash": flash_attention_kernel,
    "te": te_attention_kernel,
}
EXPERIMENTAL_KERNELS = frozenset({"flash", "te"})

# Kernels that take every row the exchange returns (and mask by position themselves) instead of
# the needed keys only: constant shapes step to step, so compiled kernels are reused.
ROW_KERNELS = frozenset({"flex"})

# Attention features beyond block-causal softmax that a layer may ask for (see runtime), and
# the kernels that implement each. A kernel missing one of a layer's features is skipped by
# `auto` for that layer and refused when chosen explicitly.
FEATURES = ("softcap", "sinks")
KERNEL_FEATURES: dict[str, frozenset[str]] = {
    "dense": frozenset({"softcap", "sinks"}),
    "flex": frozenset({"softcap", "sinks"}),  # sinks via the returned log-sum-exp
    "varlen": frozenset(),
    "flash": frozenset(),
    "te": frozenset(),
}

# Preference of `auto` on CUDA with half precision (see README, Performance). flash and te stay out
# until a measurement puts them ahead of varlen.
_AUTO_ORDER_CUDA = ("varlen", "flex", "dense")


def unsupported_reason(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim_k: int,
    head_dim_v: int,
    features: frozenset[str] = frozenset(),
) -> str | None:
    """Why kernel `name` cannot run this attention call (with these `features`), or None if it can."""
    if name not in KERNELS:
        return f"attn_backend={name!r} is not available in this installation (available: {', '.join(KERNELS)})"
    missing = sorted(set(features) - KERNEL_FEATURES.get(name, frozenset()))
    if missing:
        return f"the {name} kernel does not implement {' and '.join(missing)}, which this attention layer uses"
    if name == "varlen":
        if not _varlen.available():
            return "torch.nn.attention.varlen is not available in this torch build"
        if device.type != "cuda":
            return "varlen_attn needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"varlen_attn needs float16 or bfloat16, got {dtype}"
        if head_dim_k != head_dim_v:
            return f"varlen_attn needs equal key and value head dims, got {head_dim_k} and {head_dim_v}"
    if name in ("flash", "te"):
        package = "flash-attn (flash_attn)" if name == "flash" else "Transformer Engine (transformer_engine.pytorch)"
        if not (_flash.available() if name == "flash" else _te.available()):
            return f"{package} does not import in this environment (not installed, or a build without CUDA)"
        if device.type != "cuda":
            return f"{package} needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"{package} needs float16 or bfloat16, got {dtype}"
        if head_dim_k != head_dim_v:
            return f"{package} needs equal key and value head dims here, got {head_dim_k} and {head_dim_v}"
        if name == "flash" and head_dim_k > 256:
            return f"flash-attn supports head dims up to 256, got {head_dim_k}"
    if name == "flex" and device.type not in ("cuda", "cpu"):
        return f"FlexAttention does not run on {device.type}"
    if name == "flex" and device.type == "cuda" and min(head_dim_k, head_dim_v) < 16:
        # Inductor's flex lowering refuses smaller head dims at compile time (a LoweringException deep
        # inside the first step); say so before any kernel is built.
        return f"compiled FlexAttention needs head dims of at least 16, got {head_dim_k} (key) and {head_dim_v} (value)"
    return None


def choose_kernel(
    requested: str,
    device: torch.device,
    dtype: torch.dtype,
    head_dim_k: int,
    head_dim_v: int,
    features: frozenset[str] = frozenset(),
) -> str:
    """Resolve `auto` to a kernel for one layer's call, or check an explicit choice; raise a clear error if it cannot run."""
    unknown = sorted(set(features) - set(FEATURES))
    if unknown:
        raise ValueError(f"unknown attention features {unknown}; known: {', '.join(FEATURES)}")
    if requested != "auto":
        reason = unsupported_reason(requested, device, dtype, head_dim_k, head_dim_v, features)
        if reason is not None:
            raise ValueError(f"attn_backend={requested!r} cannot run here: {reason}")
        return requested
    # FlexAttention has no backward on CPU, so CPU training must use the dense kernel.
    order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("dense",)
    for name in order:
        if unsupported_reason(name, device, dtype, head_dim_k, head_dim_v, features) is None:
            return name
    return "dense"

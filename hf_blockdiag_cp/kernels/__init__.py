"""Local attention kernels behind one signature, and the choice among them.

Every kernel takes this rank's queries `q [L, H, Dk]` and the keys/values it needs
`k [K, Hkv, Dk]`, `v [K, Hkv, Dv]` (in the step plan's key order) and returns `[L, H, Dv]`.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import varlen as _varlen
from .dense import dense_attention
from .flex import flex_attention_kernel
from .varlen import varlen_attention_kernel

KERNELS: dict[str, Callable] = {
    "dense": dense_attention,
    "flex": flex_attention_kernel,
    "varlen": varlen_attention_kernel,
}

# Preference of `auto` on CUDA with half precision (see README, Performance).
_AUTO_ORDER_CUDA = ("varlen", "flex", "dense")


def unsupported_reason(name: str, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    """Why kernel `name` cannot run this attention call, or None if it can."""
    if name not in KERNELS:
        return f"attn_backend={name!r} is not available in this installation (available: {', '.join(KERNELS)})"
    if name == "varlen":
        if not _varlen.available():
            return "torch.nn.attention.varlen is not available in this torch build"
        if device.type != "cuda":
            return "varlen_attn needs a CUDA device"
        if dtype not in (torch.float16, torch.bfloat16):
            return f"varlen_attn needs float16 or bfloat16, got {dtype}"
        if head_dim_k != head_dim_v:
            return f"varlen_attn needs equal key and value head dims, got {head_dim_k} and {head_dim_v}"
    if name == "flex" and device.type not in ("cuda", "cpu"):
        return f"FlexAttention does not run on {device.type}"
    return None


def choose_kernel(requested: str, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str:
    """Resolve `auto` to a kernel, or check an explicit choice; raise a clear error if it cannot run."""
    if requested != "auto":
        reason = unsupported_reason(requested, device, dtype, head_dim_k, head_dim_v)
        if reason is not None:
            raise ValueError(f"attn_backend={requested!r} cannot run here: {reason}")
        return requested
    # FlexAttention has no backward on CPU, so CPU training must use the dense kernel.
    order = _AUTO_ORDER_CUDA if device.type == "cuda" else ("dense",)
    for name in order:
        if unsupported_reason(name, device, dtype, head_dim_k, head_dim_v) is None:
            return name
    return "dense"

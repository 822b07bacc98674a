"""Local attention kernels, one record each (`registry.KernelRecord`), registered by their modules.

`dense` (SDPA with a boolean mask; the reference and the CPU path), `flex` (FlexAttention with a
block mask built once per step), `varlen` (torch varlen, FlashAttention underneath), `fa4`
(FlashAttention-4, the `[fa4]` extra), and the experimental `flash` (flash-attn) and `te`
(Transformer Engine); `lse` merges partial outputs by their log-sum-exp. Adding a kernel is one
module that registers its record, plus its tests.
"""

from . import dense, fa4, flash, flex, te, varlen  # noqa: F401  (each registers its record)
from .registry import (
    FEATURES,
    KernelRecord,
    KernelUnavailableError,
    auto_order,
    calibrated_cost,
    canonical_kernel_name,
    choose_kernel,
    get_kernel,
    kernel_names,
    register_kernel,
    unsupported_reason,
)

__all__ = [
    "FEATURES",
    "KernelRecord",
    "KernelUnavailableError",
    "auto_order",
    "calibrated_cost",
    "canonical_kernel_name",
    "choose_kernel",
    "get_kernel",
    "kernel_names",
    "register_kernel",
    "unsupported_reason",
]

"""Fused linear cross-entropy (Liger-Kernel) under block-diagonal CP: no `[tokens, vocab]` logits.

On a long pack the fp32 logits, not attention, cap what one GPU trains (docs/performance.md).
`enable_fused_cross_entropy(model)` replaces the causal LM's loss by Liger's fused linear
cross-entropy on this model instance only (no other Liger kernel: RMSNorm, RoPE and MLP stay
stock, so the model's numerics change only in the loss). The shard step's outputs reach it
unchanged: `shift_labels` (pre-shifted on the global pack) and `num_items_in_batch` (global
targets / G), so each rank's loss is still `local token-loss sum · G / N` (invariant I2,
docs/design.md). In eval mode the model computes logits as before.

Liger's kernels are Triton kernels: without CUDA (or without the `[liger]` extra) the stock
loss stays and the function says so once. `TrainingArguments(use_liger_kernel=True)` with
`BlockdiagCPTrainer` applies Liger through the Trainer instead (all of its kernels by default).
"""

from __future__ import annotations

import functools
import importlib.util
import logging

import torch

from ..compat import liger as liger_compat

logger = logging.getLogger(__name__)

# Only the loss: every other Liger kernel off (keys a family's apply function lacks are ignored).
_LOSS_ONLY = dict(
    fused_linear_cross_entropy=True, cross_entropy=False, rope=False, rms_norm=False, swiglu=False, geglu=False,
    layer_norm=False,
)


def fused_cross_entropy_unavailable(model: torch.nn.Module | None = None) -> str | None:
    """Why fused linear cross-entropy cannot be used here (None if it can)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (the [liger] extra)"
    if importlib.util.find_spec("triton") is None or not torch.cuda.is_available():
        return "Liger's kernels need Triton and a CUDA device"
    if model is not None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in liger_compat.model_types():
            return f"Liger has no fused cross-entropy for model_type {model_type!r}"
    return None


@functools.cache
def _say_once(reason: str) -> None:
    logger.warning("blockdiag_cp: fused cross-entropy is off, the stock loss path stays: %s", reason)


def enable_fused_cross_entropy(model: torch.nn.Module) -> bool:
    """Use Liger's fused linear cross-entropy as `model`'s training loss; False (said once) where it cannot run."""
    reason = fused_cross_entropy_unavailable(model)
    if reason is not None:
        _say_once(reason)
        return False
    liger_compat.apply_to_instance(model, **_LOSS_ONLY)
    return True

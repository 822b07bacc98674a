"""Liger-Kernel internals that have no public equivalent (checked with liger-kernel 0.8.5,
`tests/unit/test_compat.py`, which runs where Liger imports: CUDA with Triton)."""

from __future__ import annotations

import torch

TESTED = "liger-kernel 0.8.5"


def model_types() -> frozenset[str]:
    """The model types Liger has kernels for (`monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN`'s keys)."""
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply_to_instance(model: torch.nn.Module, **kernels: bool) -> None:
    """Liger's kernels on this model instance only, each named in `kernels` on or off (a kernel the
    family lacks is ignored): `_apply_liger_kernel_to_instance`, exported by `liger_kernel.transformers`
    under a private name; `Trainer(use_liger_kernel=True)` calls it too."""
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=model, **kernels)

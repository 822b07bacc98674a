"""Local kernels, by kind: `attention` (one record per local attention kernel: dense, flex, varlen,
fa4, flash, te) and `mixers` (one record per kernel of each recurrent token-mixer operation: torch
and, where verified, fla). Both kinds keep their records in a `hf_blockdiag_cp.registry.Registry`;
`calibration.json` holds the attention kernels' fitted cost constants.
"""

from . import attention, mixers
from .attention import (
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
from .mixers import (
    MIXER_OPS,
    MixerDims,
    MixerKernelRecord,
    RunTable,
    canonical_mixer_backend,
    choose_mixer_kernel,
    mixer_kernel_names,
    register_mixer_kernel,
)

__all__ = [
    "FEATURES",
    "MIXER_OPS",
    "KernelRecord",
    "KernelUnavailableError",
    "MixerDims",
    "MixerKernelRecord",
    "RunTable",
    "attention",
    "auto_order",
    "calibrated_cost",
    "canonical_kernel_name",
    "canonical_mixer_backend",
    "choose_kernel",
    "choose_mixer_kernel",
    "get_kernel",
    "kernel_names",
    "mixer_kernel_names",
    "mixers",
    "register_kernel",
    "register_mixer_kernel",
    "unsupported_reason",
]

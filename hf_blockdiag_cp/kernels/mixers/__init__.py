"""Kernels of the recurrent token mixers' operations, one record each (`registry.MixerKernelRecord`).

The gated delta rule (`delta_rule`) and KDA (`kda`), the short convolution (`short_conv`), Mamba2's
SSD scan (`ssd`), Mamba1's selective scan (`selective_scan`) and MiniMax's lightning attention
(`lightning`): each in torch (the model family's own rule, exact, everywhere) and, where verified on
a GPU, in flash-linear-attention (`fla`: its import and verified sets). The torch kernels batch
their runs by length (`buckets`).
"""

from . import delta_rule, kda, lightning, selective_scan, short_conv, ssd  # noqa: F401  (each registers its records)
from .registry import (
    MIXER_OPS,
    MixerDims,
    MixerKernelRecord,
    RunTable,
    canonical_mixer_backend,
    choose_mixer_kernel,
    mixer_kernel_names,
    mixer_refusals,
    register_mixer_kernel,
)

__all__ = [
    "MIXER_OPS",
    "MixerDims",
    "MixerKernelRecord",
    "RunTable",
    "canonical_mixer_backend",
    "choose_mixer_kernel",
    "mixer_kernel_names",
    "mixer_refusals",
    "register_mixer_kernel",
]

"""Local attention kernels, one record each (`registry.KernelRecord`), registered by their modules.

`dense` (SDPA with a boolean mask; the reference and the CPU path), `flex` (FlexAttention
with a block mask built once per step), `varlen` (torch varlen, FlashAttention underneath),
`fa4` (FlashAttention-4, the `[fa4]` extra), and the experimental `flash` (flash-attn) and
`te` (Transformer Engine). Adding a kernel is
one module that registers its record, plus its tests.

Recurrent token mixers have their own records (`mixer_registry.MixerKernelRecord`): the gated
delta rule (`delta_rule`) and the short convolution (`short_conv`), each in torch and fla,
Mamba2's SSD scan (`ssd`) in torch (mamba-ssm refused until verified), Mamba1's selective scan
(`selective_scan`) in torch, KDA (`kda`) in torch (fla's chunk_kda refused until verified), and
MiniMax's lightning attention (`lightning`) in torch.
"""

from . import delta_rule, dense, fa4, flash, flex, kda, lightning, selective_scan, short_conv, ssd, te, varlen  # noqa: F401  (each registers its record)
from .mixer_registry import (
    MIXER_OPS,
    MixerDims,
    MixerKernelRecord,
    RunTable,
    canonical_mixer_backend,
    choose_mixer_kernel,
    mixer_kernel_names,
    register_mixer_kernel,
)
from .registry import (
    FEATURES,
    KernelRecord,
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
    "MIXER_OPS",
    "KernelRecord",
    "MixerDims",
    "MixerKernelRecord",
    "RunTable",
    "auto_order",
    "calibrated_cost",
    "canonical_kernel_name",
    "choose_kernel",
    "get_kernel",
    "canonical_mixer_backend",
    "choose_mixer_kernel",
    "kernel_names",
    "mixer_kernel_names",
    "register_kernel",
    "register_mixer_kernel",
    "unsupported_reason",
]

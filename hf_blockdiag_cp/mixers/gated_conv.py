"""The short gated convolution token mixer (LFM2, LFM2-MoE `ShortConv` layers) over a packed row,
exact per document, on one rank or over a CP group.

The layer computes y = C ⊙ conv(B ⊙ x) from its projections: the gates B and C act per row, so
only the depthwise causal convolution mixes tokens. The mixer convolves the gated input with the
window restarted at every document, by the kernel the context chose (`kernels.mixers.short_conv`). Under
CP it runs by state passing: the `W - 1` rows before each piece come from the ranks that hold them
(`state_passing.conv_with_halo`), a few rows per piece, so there is nothing for a head- or
channel-parallel transport to save. The model patch (`model_patches.lfm2`) reads a
`GatedConvLayer` off the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.mixers.registry import MixerDims
from .context import MixerContext
from .state_passing import conv_with_halo


@dataclass(frozen=True)
class GatedConvLayer:
    """What the mixer reads of one short-convolution layer: its name (for errors) and the depthwise
    convolution `conv_weight [C, W]`, `conv_bias [C]` or None (no activation)."""

    name: str
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None


def gated_conv_mix(layer: GatedConvLayer, x: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
    """The convolution of this rank's gated input `x [L, C]` per document -> `[L, C]`."""
    conv = ctx.kernel("short_conv", x, MixerDims())
    if ctx.world_size == 1:
        ctx.choices["transport"] = "local"
        return conv.fn(x, layer.conv_weight, layer.conv_bias, None, ctx.table("pack", lambda: ctx.runs, x.device))
    if ctx.transport == "heads":
        raise ValueError(
            f"blockdiag_cp: {layer.name}: mixer_transport='heads' cannot run a short convolution layer: it runs by "
            "state passing (its halo is kernel - 1 rows per piece); use 'states' or 'auto'"
        )
    ctx.choices["transport"] = "states"
    return conv_with_halo(ctx, conv, x, layer.conv_weight, layer.conv_bias, None)[0]

"""Mamba1's selective-scan token mixer (Mamba, FalconMamba, Jamba layers) over a packed row, exact per
document, on one rank or over a CP group.

From the layer's pre-convolution channels `x [L, Dc]` to its scan output `[L, Dc]` (D skip included,
before the SiLU gate): the depthwise causal convolution, the layer's own projection of the
convolved rows to (dt, B, C) (`project`: `x_proj`, Jamba's and FalconMamba's norms, `dt_proj`),
then the selective scan, convolution and scan restarted at every document, with the kernels the
context chose (`short_conv`, `selective_scan`) and the step's transport: "local" (one rank) or
"states" (state passing at any G: `state_passing.conv_with_halo` and `selective_scan_with_states`;
the transition of a run is a decay per channel and state entry). The model patch
(`model_patches.mamba1`) reads a `SelectiveScanLayer` off the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.mixers.registry import MixerDims
from ..planning.mixer_plan import MixerShape
from .context import MixerContext
from .state_passing import conv_rows, selective_scan_with_states


@dataclass(frozen=True)
class SelectiveScanLayer:
    """What the mixer reads of one Mamba1 layer: its `channels` and `state_size`, the depthwise
    convolution (`conv_weight [Dc, W]`), A_log `[Dc, N]`, D `[Dc]`, the time steps' bias
    (`dt_proj.bias`), and the family's torch `mamba_selective_scan` (the torch kernel runs it)."""

    name: str
    channels: int
    state_size: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    activation: str | None
    A_log: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor | None
    torch_scan: Callable

    def shape(self, bytes_per_element: int) -> MixerShape:
        """As one head of `channels` values, each with `state_size` state entries, each its own decay."""
        return MixerShape(1, self.state_size, 1, self.channels, self.channels, self.conv_weight.shape[-1],
                          bytes_per_element, decay="entry", head_parallel=False)


def time_steps(layer: SelectiveScanLayer, dt: torch.Tensor) -> torch.Tensor:
    """`dt [L, Dc]` through the bias and softplus, in its dtype, as the stock torch scan does."""
    if layer.dt_bias is not None:
        dt = dt + layer.dt_bias.float().to(dt.dtype)
    return F.softplus(dt)


def selective_scan_mix(layer: SelectiveScanLayer, x: torch.Tensor, project: Callable, ctx: MixerContext) -> torch.Tensor:
    """The layer's scan output `[L, Dc]` (fp32) from this rank's pre-convolution `x [L, Dc]`; `project(xc)`
    maps the convolved rows to raw `dt [L, Dc]`, `B`, `C [L, N]` as the stock forward does."""
    x, gathered = conv_rows(ctx, layer.name, layer.shape(x.element_size()), x, layer.conv_weight, layer.conv_bias,
                            layer.activation)
    dt, B, C = project(x)
    dt, A, D = time_steps(layer, dt), -layer.A_log.float().exp(), layer.D.float()
    scan = ctx.kernel("selective_scan", x, MixerDims(layer.state_size, layer.channels))
    if gathered is not None:
        return selective_scan_with_states(ctx, scan, x, dt, A, B, C, D, layer.torch_scan, gathered)
    return scan.fn(x, dt, A, B, C, D, ctx.table("pack", lambda: ctx.runs, x.device), None, False, layer.torch_scan)[0]

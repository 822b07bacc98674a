"""Mamba2's SSD token mixer (Mamba2, NemotronH, Bamba, GraniteMoeHybrid, FalconH1, Zamba2 layers)
over a packed row, exact per document, on one rank or over a CP group.

From the layer's projections (pre-convolution x|B|C `xbc` and the raw time steps `dt`) to its scan
output `[L, H, P]` (D skip included, before the gated norm): the depthwise causal convolution, then
the chunked SSD scan, both restarted at every document, with the kernels the context chose
(`kernels.mixers.registry`: `short_conv`, `ssd_scan`) and the step's transport: "local" (one rank)
or "states" (state passing, any G: `state_passing.conv_with_halo` and `ssd_with_states`). There is
no head-parallel transport: B and C are shared by the heads of a group, which a head split would
have to copy. The model patch (`model_patches.mamba2`) reads an `SsdLayer` off the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.mixers.registry import MixerDims
from ..planning.mixer_plan import MixerShape
from .context import MixerContext
from .state_passing import conv_rows, ssd_with_states


@dataclass(frozen=True)
class SsdLayer:
    """What the mixer reads of one Mamba2 layer: `heads` of `head_dim`, `groups` of B and C of
    `state_size`, the scan's `chunk_size`, the depthwise convolution (`conv_weight [C, W]`, C =
    H·P + 2·G·N in x|B|C order), A_log, dt_bias, D `[H]`, the clamp of the time steps
    (`time_step_limit`), and the family's torch `mamba2_chunk_scan` (the torch kernel runs it)."""

    name: str
    heads: int
    head_dim: int
    groups: int
    state_size: int
    chunk_size: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    activation: str | None
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    D: torch.Tensor
    time_step_limit: tuple[float, float]
    torch_scan: Callable

    def shape(self, bytes_per_element: int) -> MixerShape:
        return MixerShape(self.groups, self.state_size, self.heads, self.head_dim, self.conv_weight.shape[0],
                          self.conv_weight.shape[-1], bytes_per_element, decay="head", head_parallel=False)


def time_steps(layer: SsdLayer, dt: torch.Tensor) -> torch.Tensor:
    """`dt [L, H]` through the bias, softplus and clamp, in its dtype, as the stock torch scan does."""
    dt = F.softplus(dt + layer.dt_bias.to(dt.dtype))
    return torch.clamp(dt, min=layer.time_step_limit[0], max=layer.time_step_limit[1])


def _split(layer: SsdLayer, xbc: torch.Tensor):
    rows, width = xbc.shape[0], layer.groups * layer.state_size
    x, B, C = xbc.split([layer.heads * layer.head_dim, width, width], dim=-1)
    return (x.reshape(rows, layer.heads, layer.head_dim), B.reshape(rows, layer.groups, layer.state_size),
            C.reshape(rows, layer.groups, layer.state_size))


def ssd_mix(layer: SsdLayer, xbc: torch.Tensor, dt: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
    """The layer's scan output `[L, H, P]` from this rank's `xbc [L, H·P + 2·G·N]` and raw `dt [L, H]`."""
    xbc, gathered = conv_rows(ctx, layer.name, layer.shape(xbc.element_size()), xbc, layer.conv_weight,
                              layer.conv_bias, layer.activation)
    x, B, C = _split(layer, xbc)
    dt, A = time_steps(layer, dt), -layer.A_log.float().exp()
    scan = ctx.kernel("ssd_scan", x, MixerDims(layer.state_size, layer.head_dim))
    if gathered is not None:
        return ssd_with_states(ctx, scan, x, dt, A, B, C, layer.D, layer.torch_scan, layer.chunk_size, gathered)
    table = ctx.table("pack", lambda: ctx.runs, x.device)
    return scan.fn(x, dt, A, B, C, layer.D, table, None, False, layer.torch_scan, layer.chunk_size)[0]

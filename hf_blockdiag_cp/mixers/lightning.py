"""MiniMax's lightning attention (`MiniMaxLightningAttention` layers) over a packed row, exact per
document, on one rank or over a CP group.

From the layer's activated q, k, v to its core output `[L, H, Dv]` (before the layer's norm, gate and
projection): linear attention with a constant decay per head, S_t = λ_h·S_{t-1} + k_tᵀ v_t,
o_t = q_t·S_t, λ_h = exp(-slope_h), restarted at every document, with the kernel the context chose
(`lightning_attention`) and the step's transport: "local" (one rank) or "states" (state passing at
any G: a run's transition is λ^n, `state_passing.lightning_with_states`). The layer has no
convolution and no head-parallel transport. The model patch (`model_patches.minimax`) reads a
`LightningLayer` off the module.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels.mixers.registry import MixerDims
from ..planning.mixer_plan import MixerShape
from .context import MixerContext
from .state_passing import lightning_with_states


@dataclass(frozen=True)
class LightningLayer:
    """What the mixer reads of one lightning-attention layer: its name (for errors), `heads` of
    `head_dim` (q, k and v alike), the decay rates `slope [H]` (buffers) and `block_size`, the rows
    the torch kernel takes at a time."""

    name: str
    heads: int
    head_dim: int
    slope: torch.Tensor
    block_size: int

    def shape(self, bytes_per_element: int) -> MixerShape:
        return MixerShape(self.heads, self.head_dim, self.heads, self.head_dim, 0, 0, bytes_per_element,
                          decay="head", head_parallel=False)


def lightning_mix(layer: LightningLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
    """The layer's core output `[L, H, D]` from this rank's `q`, `k`, `v [L, H, D]`."""
    try:
        states = ctx.transport_for(layer.shape(q.element_size())) == "states"
    except ValueError as exc:
        raise ValueError(f"blockdiag_cp: {layer.name}: {exc}") from None
    kernel = ctx.kernel("lightning_attention", q, MixerDims(layer.head_dim, layer.head_dim, states=states))
    if states:
        return lightning_with_states(ctx, kernel, q, k, v, layer.slope, layer.block_size)
    table = ctx.table("pack", lambda: ctx.runs, q.device)
    return kernel.fn(q, k, v, layer.slope, table, None, False, layer.block_size)[0]

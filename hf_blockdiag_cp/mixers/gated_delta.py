"""The gated delta-rule token mixers over a packed row, exact per document, on one rank or over a CP
group: the gated delta rule of Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo-Hybrid (one decay per value
head) and KDA, Kimi Linear's and Bailing-Hybrid's (one decay per key channel). Both act on the state
along its key axis, so one mixer serves them; the layer record names the kernel operation.

From the layer's projections (pre-convolution q|k|v `mixed`, and the gate inputs `b`, `a`) to its
core output `[L, Hv, Dv]`: the short causal convolution, then the chunked delta rule, both
restarted at every document, with the kernels the context chose (`kernels.mixers.registry`) and the
transport of the step (`planning.mixer_plan`): "local" (one rank), "heads" (head-parallel: the
whole pack for a group of heads) or "states" (state passing: this rank's rows, states from the
ranks before). The model patches (`model_patches.gated_delta`, `model_patches.kda`) read a
`GatedDeltaLayer` off the module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from ..comm.head_shards import heads_to_seq, seq_to_heads
from ..kernels.mixers.registry import MixerDims
from ..planning.mixer_plan import MixerShape
from .context import MixerContext
from .state_passing import conv_with_halo, delta_rule_with_states


@dataclass(frozen=True)
class HeadDecay:
    """The gates of the gated delta rule with one decay per value head, as the stock forwards compute
    them: beta = sigmoid(b)·beta_scale (2 where OLMo-Hybrid allows negative eigenvalues) and the
    log-decay g = -exp(A_log)·softplus(a + dt_bias) in fp32, for the value heads `heads`."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    beta_scale: float = 1.0

    def __call__(self, b, a, heads: slice):
        beta = b.sigmoid() if self.beta_scale == 1.0 else b.sigmoid() * self.beta_scale
        return beta, -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])


@dataclass(frozen=True)
class GatedDeltaLayer:
    """What the mixer reads of one delta-rule layer: head counts and dims, the depthwise convolution
    (`conv_weight [C, W]`, C = 2·Hk·Dk + Hv·Dv in q|k|v order), `gates(b, a, heads) -> (beta [rows, h],
    g)` for the value heads `heads` (`HeadDecay`, or KDA's per-channel decay), the kernel operation
    `op` (`gated_delta_rule` or `kda`), the channels of `a` per value head (`gate_width`: 1, or Dk for
    KDA) and the family's torch chunked rule (the torch kernel runs it)."""

    name: str
    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    activation: str | None
    gates: Callable
    torch_rule: Callable
    op: str = "gated_delta_rule"
    gate_width: int = 1

    def shape(self, bytes_per_element: int) -> MixerShape:
        return MixerShape(self.key_heads, self.key_dim, self.value_heads, self.value_dim,
                          self.conv_weight.shape[0], self.conv_weight.shape[-1], bytes_per_element,
                          gate_width=self.gate_width)


def _split(mixed, key_heads: int, key_dim: int, value_heads: int, value_dim: int):
    rows = mixed.shape[0]
    q, k, v = mixed.split([key_heads * key_dim, key_heads * key_dim, value_heads * value_dim], dim=-1)
    return q.reshape(rows, key_heads, key_dim), k.reshape(rows, key_heads, key_dim), v.reshape(rows, value_heads, value_dim)


def _mix_rows(layer: GatedDeltaLayer, ctx: MixerContext, mixed, b, a, states: bool) -> torch.Tensor:
    """Every head over this rank's rows: the whole pack ("local") or its shard ("states")."""
    conv = ctx.kernel("short_conv", mixed, MixerDims())
    weight = layer.conv_weight
    if states:
        mixed, gathered = conv_with_halo(ctx, conv, mixed, weight, layer.conv_bias, layer.activation)
    else:
        table = ctx.table("pack", lambda: ctx.runs, mixed.device)
        mixed = conv.fn(mixed, weight, layer.conv_bias, layer.activation, table)
    q, k, v = _split(mixed, layer.key_heads, layer.key_dim, layer.value_heads, layer.value_dim)
    beta, g = layer.gates(b, a, slice(None))
    rule = ctx.kernel(layer.op, q, MixerDims(layer.key_dim, layer.value_dim, states=states))
    if states:
        return delta_rule_with_states(ctx, rule, q, k, v, g, beta, layer.torch_rule, gathered)
    return rule.fn(q, k, v, g, beta, ctx.table("pack", lambda: ctx.runs, q.device), None, False, layer.torch_rule)[0]


def _owned_channels(layer: GatedDeltaLayer, world_size: int, rank: int, device) -> torch.Tensor:
    """Convolution channels (q, k, v rows of the depthwise kernel) of head group `rank`."""
    kq, vq = layer.key_heads * layer.key_dim // world_size, layer.value_heads * layer.value_dim // world_size
    key_width = layer.key_heads * layer.key_dim
    return torch.cat([
        torch.arange(rank * kq, (rank + 1) * kq),
        key_width + torch.arange(rank * kq, (rank + 1) * kq),
        2 * key_width + torch.arange(rank * vq, (rank + 1) * vq),
    ]).to(device)


def _mix_heads(layer: GatedDeltaLayer, ctx: MixerContext, mixed, b, a) -> torch.Tensor:
    """Head-parallel: the whole pack for head group `rank`, between two all-to-alls."""
    g_size, rank, rows = ctx.world_size, ctx.rank, mixed.shape[0]
    key_width = layer.key_heads * layer.key_dim
    q, k, v = mixed.split([key_width, key_width, layer.value_heads * layer.value_dim], dim=-1)
    send = torch.cat([t.reshape(rows, g_size, -1) for t in (q, k, v, b.to(mixed.dtype), a.to(mixed.dtype))], dim=-1)
    routes = ctx.cached(("head_routes", str(mixed.device)), lambda: _head_routes(ctx, mixed.device))
    pack = seq_to_heads(send, ctx.group, g_size, routes[0])
    hk, hv = layer.key_heads // g_size, layer.value_heads // g_size
    conv_width = 2 * hk * layer.key_dim + hv * layer.value_dim
    pack_mixed, pack_b, pack_a = pack.split([conv_width, hv, hv * layer.gate_width], dim=-1)
    channels = ctx.cached(("owned_channels", layer.conv_weight.shape, str(mixed.device)),
                          lambda: _owned_channels(layer, g_size, rank, mixed.device))
    weight = layer.conv_weight.index_select(0, channels)
    bias = None if layer.conv_bias is None else layer.conv_bias.index_select(0, channels)
    conv = ctx.kernel("short_conv", pack_mixed, MixerDims())
    table = ctx.table("pack", lambda: ctx.runs, mixed.device)
    pack_mixed = conv.fn(pack_mixed, weight, bias, layer.activation, table)
    qh, kh, vh = _split(pack_mixed, hk, layer.key_dim, hv, layer.value_dim)
    beta, g = layer.gates(pack_b, pack_a, slice(rank * hv, (rank + 1) * hv))
    rule = ctx.kernel(layer.op, qh, MixerDims(layer.key_dim, layer.value_dim))
    out = rule.fn(qh, kh, vh, g, beta, table, None, False, layer.torch_rule)[0]
    back = heads_to_seq(out.reshape(out.shape[0], -1), ctx.group, g_size, routes[1])
    return back.reshape(rows, layer.value_heads, layer.value_dim)


def _head_routes(ctx: MixerContext, device):
    """(slot -> pack, pack -> slot) maps of the step's layout on `device`; None when they are the identity."""
    layout = ctx.layout
    slots = layout.slot_positions.reshape(-1)
    if torch.equal(slots, torch.arange(slots.numel())):
        return None, None
    return layout.slot_of_position.to(device), slots.to(device)


def gated_delta_mix(layer: GatedDeltaLayer, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, ctx: MixerContext) -> torch.Tensor:
    """The layer's core output `[L, Hv, Dv]` from this rank's `mixed [L, C]`, `b [L, Hv]` and
    `a [L, Hv·gate_width]`."""
    try:
        transport = ctx.transport_for(layer.shape(mixed.element_size()))
    except ValueError as exc:
        raise ValueError(f"blockdiag_cp: {layer.name}: {exc}") from None
    if transport == "heads":
        return _mix_heads(layer, ctx, mixed, b, a)
    return _mix_rows(layer, ctx, mixed, b, a, states=transport == "states")

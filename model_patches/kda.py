"""Kimi Linear and Bailing-Hybrid: exact packed KDA (Kimi Delta Attention) layers, at cp = 1 and
under CP.

Why: these models mix softmax (MLA) attention, which goes through the attention interface, with
`*DeltaAttention` layers that do not: a short causal convolution and the chunked delta rule with
a decay per key channel. Transformers never passes document boundaries to either, so on a packed
row both cross documents, and under CP each rank would see only its shard. The patch replaces each
DeltaAttention instance's `forward` (its parameters unchanged) with one that projects as the stock
forward does, then runs the delta-rule mixer of `hf_blockdiag_cp.mixers.gated_delta` with the `kda`
kernels (convolution and recurrence restarted at every document; under CP head-parallel or by
state passing), then the gated norm and output projection. The forget gate is the family's own
arithmetic (`KimiDecay`, `BailingDecay`), applied per head group after the head-parallel
all-to-all, as the gated delta rule's gates are. When the packed path runs is `packed_mixer`'s rule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_blockdiag_cp.mixers import GatedDeltaLayer, gated_delta_mix

from .packed_mixer import family_function, layer_name, register_mixer_patch

MODEL_TYPES = ("kimi_linear", "bailing_hybrid")


def _head_channels(x: torch.Tensor, head_dim: int, heads: slice) -> torch.Tensor:
    """`x [H·Dk]` (a per-channel parameter) -> `[h, Dk]` for the heads `heads`, in fp32."""
    return x.float().view(-1, head_dim)[heads]


@dataclass(frozen=True)
class KimiDecay:
    """Kimi Linear's gates (`KimiLinearForgetGate`): g = -exp(A_log)·softplus(a + dt_bias), softplus(x)
    taken as x above 20, in fp32; beta = sigmoid(b). `a [rows, h·Dk]` is `f_b_proj(f_a_proj(x))`."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    head_dim: int

    def __call__(self, b, a, heads: slice):
        g = a.float().view(a.shape[0], -1, self.head_dim) + _head_channels(self.dt_bias, self.head_dim, heads)
        softplus = torch.where(g > 20.0, g, torch.log(1.0 + torch.exp(g)))
        return b.sigmoid(), -self.A_log.float().exp().reshape(-1)[heads][:, None] * softplus


@dataclass(frozen=True)
class BailingDecay:
    """Bailing-Hybrid's gates (`BailingHybridForgetGate`): with u = a + dt_bias in fp32 and r = exp(A_log),
    g = lower_bound·sigmoid(r·u) (its "safe" gate) or -r·softplus(u); beta = sigmoid(b). `a [rows, h·Dk]`
    is `f_proj(x)`. g stays in fp32, where the stock gate rounds it to the layer's input dtype (equal in
    fp32 and under autocast; in a bf16 model the KDA rule, which computes in fp32, gets the unrounded g)."""

    A_log: torch.Tensor
    dt_bias: torch.Tensor
    head_dim: int
    safe_gate: bool
    lower_bound: float

    def __call__(self, b, a, heads: slice):
        u = a.float().view(a.shape[0], -1, self.head_dim) + _head_channels(self.dt_bias, self.head_dim, heads)
        rate = self.A_log.exp().reshape(-1)[heads][:, None]
        g = self.lower_bound * torch.sigmoid(rate * u) if self.safe_gate else -rate * F.softplus(u)
        return b.sigmoid(), g


def is_kda_layer(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("DeltaAttention") and all(
        hasattr(module, p) for p in ("conv1d", "forget_gate", "b_proj", "o_norm", "o_proj", "q_proj"))


def _decay(module):
    gate = module.forget_gate
    if hasattr(gate, "f_proj"):
        return BailingDecay(gate.A_log, gate.dt_bias, module.head_dim, gate.safe_gate, gate.lower_bound)
    return KimiDecay(gate.A_log, gate.dt_bias, module.head_dim)


def mixer_layer(module) -> GatedDeltaLayer:
    """What the token mixer reads of a DeltaAttention module (its parameters, not copies)."""
    heads, dim = module.num_heads, module.head_dim
    return GatedDeltaLayer(
        name=layer_name(module), key_heads=heads, key_dim=dim, value_heads=heads,
        value_dim=dim, conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias,
        activation=module.activation, gates=_decay(module), torch_rule=family_function(module, "chunk_kimi_delta_attention"), op="kda", gate_width=dim,
    )


def input_projections(module, x: torch.Tensor):
    """Rows `[L, D]` -> q|k|v `[L, 3·H·Dk]`, the output gate `[L, H, Dk]`, b `[L, H]` and the forget
    gate's projection a `[L, H·Dk]`, as the stock forward builds them."""
    mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
    gate = module.forget_gate
    a = gate.f_proj(x) if hasattr(gate, "f_proj") else gate.f_b_proj(gate.f_a_proj(x))
    out_gate = module.g_proj(x) if hasattr(module, "g_proj") else module.g_b_proj(module.g_a_proj(x))
    return mixed, out_gate.view(x.shape[0], -1, module.head_dim), module.b_proj(x), a


def forward_rows(self, x, mix, kwargs):
    """DeltaAttention on one packed row `x [L, D]`: the stock projections, the KDA mixer per document, the
    gated norm and the output projection."""
    rows = x.shape[0]
    mixed, out_gate, b, a = input_projections(self, x)
    core = mix(mixed, b, a)
    return self.o_proj(self.o_norm(core[None], out_gate[None]).reshape(1, rows, -1))


PATCH = register_mixer_patch(
    "kda_packed", MODEL_TYPES, layer_types=("linear_attention",), is_layer=is_kda_layer, layer="KDA DeltaAttention layer",
    mixer_layer=mixer_layer, mix=gated_delta_mix, forward=forward_rows, torch_function="chunk_kimi_delta_attention",
    why="KDA layers (convolution and recurrence) must restart at every document and see the whole pack",
)
apply = PATCH.apply

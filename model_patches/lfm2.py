"""LFM2 and LFM2-MoE: exact packed short gated convolution layers, at cp = 1 and under CP.

Why: these models mix softmax attention (through the attention interface) with `ShortConv`
layers, y = out_proj(C ⊙ conv(B ⊙ x)), that do not. On a packed row Transformers' torch path runs
the depthwise causal convolution across document boundaries (the `seq_idx` it passes reaches only
the causal-conv1d kernel), and under CP each rank would see only its shard. The patch replaces
each ShortConv instance's `forward` (its parameters unchanged) with one that projects and gates as
the stock forward does, then convolves per document with `hf_blockdiag_cp.mixers.gated_conv`
(under CP by state passing of the convolution's halo, at any CP size), then gates and projects
out. Outputs, loss and gradients equal the stock model run on each document alone. When the
packed path runs is `packed_mixer`'s rule (stock outside a step without `cu_seq_lens_q`, and in
cached generation).
"""

from __future__ import annotations

import torch

from hf_blockdiag_cp.mixers import GatedConvLayer, gated_conv_mix

from .packed_mixer import layer_name, register_mixer_patch

MODEL_TYPES = ("lfm2", "lfm2_moe")


def is_short_conv(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("ShortConv") and all(hasattr(module, p) for p in ("conv", "in_proj", "out_proj"))


def mixer_layer(module) -> GatedConvLayer:
    """What the token mixer reads of a ShortConv module (its parameters, not copies)."""
    return GatedConvLayer(layer_name(module), module.conv.weight.squeeze(1), module.conv.bias)


def forward_rows(self, x, mix, kwargs):
    """ShortConv on one packed row `x [L, D]`: the stock gates around the convolution per document."""
    gate_in, gate_out, values = self.in_proj(x).chunk(3, dim=-1)
    return self.out_proj(gate_out * mix(gate_in * values))[None]


PATCH = register_mixer_patch(
    "short_conv_packed", MODEL_TYPES, layer_types=("conv",), is_layer=is_short_conv,
    layer="ShortConv layer with conv, in_proj and out_proj", mixer_layer=mixer_layer, mix=gated_conv_mix,
    forward=forward_rows,
    why="short gated convolution layers must restart at every document and see the rows before their shard",
)
apply = PATCH.apply

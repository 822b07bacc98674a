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

from .packed_mixer import install, mix_documents, packed_forward
from .registry import ModelPatch, register_patch

MODEL_TYPES = ("lfm2", "lfm2_moe")


def has_conv_layers(config) -> bool:
    """Whether the config has short-convolution layers (unknown layer types: assume so)."""
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "conv" in layer_types


def is_short_conv(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("ShortConv") and all(hasattr(module, p) for p in ("conv", "in_proj", "out_proj"))


def mixer_layer(module) -> GatedConvLayer:
    """What the token mixer reads of a ShortConv module (its parameters, not copies)."""
    return GatedConvLayer(f"{type(module).__name__} (layer {module.layer_idx})", module.conv.weight.squeeze(1),
                          module.conv.bias)


def conv_documents(module, x, context) -> torch.Tensor:
    """The convolution of `module` (its `mixer_layer`) over the pack's documents."""
    return gated_conv_mix(mixer_layer(module), x, context)


@packed_forward
def forward_packed(self, step, x, kwargs):
    """ShortConv forward that keeps the documents of a packed row apart (see the module docstring)."""
    gate_in, gate_out, values = self.in_proj(x).chunk(3, dim=-1)
    mixed = mix_documents(conv_documents, self, step, kwargs, x.shape[0], gate_in * values)
    return self.out_proj(gate_out * mixed)[None]


def apply(model: torch.nn.Module) -> None:
    install(model, is_short_conv, forward_packed, "model_patches.lfm2: no ShortConv layer with conv, in_proj and out_proj")


PATCH = register_patch(
    ModelPatch(
        name="short_conv_packed",
        model_types=MODEL_TYPES,
        needed=has_conv_layers,
        apply=apply,
        why="short gated convolution layers must restart at every document and see the rows before their shard",
    )
)

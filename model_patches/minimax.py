"""MiniMax: exact packed lightning-attention layers, at cp = 1 and under CP.

Why: MiniMax mixes softmax attention (through the attention interface) with
`MiniMaxLightningAttention` layers that do not: linear attention with a constant decay per head.
On a packed row Transformers runs their state across document boundaries (it takes no boundaries
at all), and under CP each rank would see only its shard. The patch replaces each such instance's
`forward` (its parameters and decay buffers unchanged) with one that projects and activates q, k, v
as the stock forward does, runs the token mixer of `hf_blockdiag_cp.mixers.lightning` (the state
restarted at every document; under CP by state passing), then the RMS norm, the sigmoid output gate
and the output projection. Outputs, loss and gradients equal the stock model run on each document
alone.

When the packed path runs is `packed_mixer`'s rule: outside a CP step the layer is stock unless the
caller passes `cu_seq_lens_q`; a `MiniMaxCache` holding this layer's state from earlier tokens
(generation) runs the stock forward outside a step and raises inside one; a fresh cache is left
unwritten by the packed path.
"""

from __future__ import annotations

import torch

from hf_blockdiag_cp.mixers import LightningLayer, lightning_mix

from .packed_mixer import layer_name, register_mixer_patch

MODEL_TYPES = ("minimax",)
_ATTRIBUTES = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "block_size", "head_dim",
               "num_attention_heads", "layer_idx")


def is_lightning_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("LightningAttention") and all(hasattr(module, a) for a in _ATTRIBUTES)


def mixer_layer(module) -> LightningLayer:
    """What the token mixer reads of a lightning-attention module (its buffers, not copies)."""
    return LightningLayer(layer_name(module), module.num_attention_heads,
                          module.head_dim, module.slope_rate.reshape(-1), module.block_size)


def _cached_state(module, cache) -> bool:
    """Whether `cache` (a MiniMaxCache) holds this layer's state from earlier tokens."""
    states = getattr(cache, "linear_cache", None) or []
    return module.layer_idx < len(states) and isinstance(states[module.layer_idx], torch.Tensor)


def forward_rows(self, x, mix, kwargs):
    """The layer on one packed row `x [L, D]` -> (`[1, L, D]`, None), as the stock forward's pair: q, k, v
    projected and activated (padding rows out after the activation, as the stock forward), the lightning
    attention per document, the RMS norm, the sigmoid output gate and the output projection."""
    rows, heads, dim = x.shape[0], self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(x))
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2:
        qkv = (qkv * mask[0, :, None]).to(qkv.dtype)
    q, k, v = qkv.reshape(rows, heads, 3 * dim).split(dim, dim=-1)
    core = mix(q, k, v)
    core = self.norm(core.reshape(1, rows, heads * dim).to(x.dtype))
    return self.out_proj(torch.sigmoid(self.output_gate(x[None])) * core), None


PATCH = register_mixer_patch(
    "lightning_attention_packed", MODEL_TYPES, layer_types=("linear_attention",), is_layer=is_lightning_attention,
    layer=f"lightning-attention layer with {', '.join(_ATTRIBUTES)}", mixer_layer=mixer_layer, mix=lightning_mix,
    forward=forward_rows, cached_state=_cached_state,
    why="lightning-attention layers (a decaying linear-attention state) must restart at every document and see the whole pack",
)
apply = PATCH.apply

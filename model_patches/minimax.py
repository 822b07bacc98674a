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
from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .packed_mixer import install, mix_documents, packed_rows
from .registry import ModelPatch, register_patch

MODEL_TYPES = ("minimax",)
_ATTRIBUTES = ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn", "slope_rate", "block_size", "head_dim",
               "num_attention_heads", "layer_idx")


def has_lightning_layers(config) -> bool:
    """Whether the config has lightning-attention layers (no layer types: assume so)."""
    layer_types = getattr(config, "layer_types", None)
    return layer_types is None or "linear_attention" in layer_types


def is_lightning_attention(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("LightningAttention") and all(hasattr(module, a) for a in _ATTRIBUTES)


def mixer_layer(module) -> LightningLayer:
    """What the token mixer reads of a lightning-attention module (its buffers, not copies)."""
    return LightningLayer(f"{type(module).__name__} (layer {module.layer_idx})", module.num_attention_heads,
                          module.head_dim, module.slope_rate.reshape(-1), module.block_size)


def _cached_state(module, cache) -> bool:
    """Whether `cache` (a MiniMaxCache) holds this layer's state from earlier tokens."""
    states = getattr(cache, "linear_cache", None) or []
    return module.layer_idx < len(states) and isinstance(states[module.layer_idx], torch.Tensor)


def attention_documents(module, q, k, v, context) -> torch.Tensor:
    """The lightning attention of `module` (its `mixer_layer`) over the pack's documents."""
    return lightning_mix(mixer_layer(module), q, k, v, context)


def _mix_rows(self, step, x, kwargs):
    """The layer on one packed row `x [L, D]` -> (`[1, L, D]`, None), as the stock forward's pair."""
    rows, heads, dim = x.shape[0], self.num_attention_heads, self.head_dim
    qkv = self.act_fn(self.qkv_proj(x))
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2:  # as the stock forward: padding rows out after the activation
        qkv = (qkv * mask[0, :, None]).to(qkv.dtype)
    q, k, v = qkv.reshape(rows, heads, 3 * dim).split(dim, dim=-1)
    core = mix_documents(attention_documents, self, step, kwargs, rows, q, k, v)
    core = self.norm(core.reshape(1, rows, heads * dim).to(x.dtype))
    return self.out_proj(torch.sigmoid(self.output_gate(x[None])) * core), None


def forward_packed(self, hidden_states, *args, **kwargs):
    """MiniMaxLightningAttention forward that keeps the documents of a packed row apart (see the module
    docstring). `packed_rows` decides where it runs; it is given no cache, whose generic previous-state
    query a MiniMaxCache does not answer: this layer's cached state is checked here."""
    if _cached_state(self, kwargs.get("cache")):
        if (kwargs.get(STEP_KWARG) or active_step()) is not None:
            raise ValueError(f"blockdiag_cp: {type(self).__name__} cannot continue from a cache inside a CP step")
        return type(self).forward(self, hidden_states, *args, **kwargs)
    entry = packed_rows(self, hidden_states, args, {k: v for k, v in kwargs.items() if k != "cache"})
    if entry is None:
        return type(self).forward(self, hidden_states, *args, **kwargs)
    return _mix_rows(self, *entry, kwargs)


def apply(model: torch.nn.Module) -> None:
    install(model, is_lightning_attention, forward_packed,
            f"model_patches.minimax: no lightning-attention layer with {', '.join(_ATTRIBUTES)}")


PATCH = register_patch(
    ModelPatch(
        name="lightning_attention_packed",
        model_types=MODEL_TYPES,
        needed=has_lightning_layers,
        apply=apply,
        why="lightning-attention layers (a decaying linear-attention state) must restart at every document and see the whole pack",
    )
)

"""Qwen3.5, Qwen3.5-MoE, Qwen3-Next and OLMo-Hybrid: exact packed gated delta-rule layers, at cp = 1
and under CP.

Why: these models mix softmax attention (through the attention interface) with
`*GatedDeltaNet` linear-attention layers that do not. On a packed row Transformers runs their
short causal convolution and their chunked gated delta rule across document boundaries, and
under CP each rank would see only its shard. The patch replaces each GatedDeltaNet
instance's `forward` (its parameters unchanged) with one that projects as the stock forward
does, then runs the token mixer of `hf_blockdiag_cp.mixers` (convolution and delta rule
restarted at every document; under CP head-parallel or by state passing, whichever the step
chooses; torch or fla kernels), then the gated norm and output projection. Outputs, loss and
gradients equal the stock model run on each document alone. OLMo-Hybrid's layer differs only in
its separate projections, its names (`o_norm`, `o_proj`) and beta doubled when it allows negative
eigenvalues (`linear_allow_neg_eigval`).

When the packed path runs is `packed_mixer`'s rule: outside a CP step the layer is stock unless
the caller passes `cu_seq_lens_q`; a cache holding earlier state (generation) always runs the
stock forward; a fresh cache is left unwritten by the packed path.
"""

from __future__ import annotations

import torch

from hf_blockdiag_cp.mixers import GatedDeltaLayer, HeadDecay, gated_delta_mix
from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .packed_mixer import family_function, layer_name, register_mixer_patch, stock_torch_kernels  # noqa: F401 (re-exported)

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next", "olmo_hybrid")
_PARAMETERS = ("conv1d", "A_log", "dt_bias")
_VISION_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")


def _norm_and_out(module):
    """The gated output norm and projection (Qwen: `norm`, `out_proj`; OLMo-Hybrid: `o_norm`, `o_proj`)."""
    if hasattr(module, "norm"):
        return module.norm, module.out_proj
    return module.o_norm, module.o_proj


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    return (type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, p) for p in _PARAMETERS)
            and (all(hasattr(module, p) for p in ("norm", "out_proj")) or all(hasattr(module, p) for p in ("o_norm", "o_proj"))))


def mixer_layer(module) -> GatedDeltaLayer:
    """What the token mixer reads of a GatedDeltaNet module (its parameters, not copies)."""
    return GatedDeltaLayer(
        name=layer_name(module), key_heads=module.num_k_heads,
        key_dim=module.head_k_dim, value_heads=module.num_v_heads, value_dim=module.head_v_dim,
        conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=module.activation,
        gates=HeadDecay(module.A_log, module.dt_bias, 2.0 if getattr(module, "allow_neg_eigval", False) else 1.0),
        torch_rule=family_function(module, "torch_chunk_gated_delta_rule"),
    )


def input_projections(module, hidden: torch.Tensor):
    """Rows `[L, D]` -> pre-convolution q|k|v `[L, 2·Hk·Dk + Hv·Dv]` (head-major), z `[L, Hv, Dv]`,
    b and a `[L, Hv]`, exactly as the stock forward builds them."""
    x = hidden[None]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (q, k, v)], dim=-1)
    elif hasattr(module, "q_proj"):  # OLMo-Hybrid: separate projections, the output gate from g_proj
        mixed = torch.cat([module.q_proj(x), module.k_proj(x), module.v_proj(x)], dim=-1)
        z = module.g_proj(x).reshape(1, x.shape[1], -1, module.head_v_dim)
        b, a = module.b_proj(x), module.a_proj(x)
    else:  # Qwen3.5, Qwen3.5-MoE
        mixed = module.in_proj_qkv(x)
        z = module.in_proj_z(x).reshape(1, x.shape[1], -1, module.head_v_dim)
        b, a = module.in_proj_b(x), module.in_proj_a(x)
    return mixed[0], z[0], b[0], a[0]


def forward_rows(self, x, mix, kwargs):
    """GatedDeltaNet on one packed row `x [L, D]`: the stock projections, the delta-rule mixer per
    document, the gated norm and the output projection."""
    rows = x.shape[0]
    mixed, z, b, a = input_projections(self, x)
    core = mix(mixed, b, a)
    norm, out_proj = _norm_and_out(self)
    core = norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return out_proj(core.reshape(1, rows, -1))


def _refuse_vision_in_step(module, args, kwargs):
    """Qwen3.5 VL outer model: a CP step is text-only (image features and mRoPE need the full pack)."""
    if (kwargs.get(STEP_KWARG) or active_step()) is not None and any(kwargs.get(k) is not None for k in _VISION_INPUTS):
        raise ValueError(
            f"blockdiag_cp ({type(module).__name__}): CP steps with images or videos are not supported for this model "
            "yet (only its text stack is patched); pass text-only batches, without pixel_values"
        )
    return None


def _hook_vision_models(model: torch.nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "visual") and hasattr(module, "language_model"):
            module.register_forward_pre_hook(_refuse_vision_in_step, with_kwargs=True)


PATCH = register_mixer_patch(
    "gated_delta_packed", MODEL_TYPES, layer_types=("linear_attention",), is_layer=is_gated_delta_net,
    layer=f"GatedDeltaNet layer with {', '.join(_PARAMETERS)}, a gated norm and an output projection",
    mixer_layer=mixer_layer, mix=gated_delta_mix, forward=forward_rows, torch_function="torch_chunk_gated_delta_rule",
    prepare=_hook_vision_models,
    why="gated delta-rule layers (convolution and recurrence) must restart at every document and see the whole pack",
)
apply = PATCH.apply

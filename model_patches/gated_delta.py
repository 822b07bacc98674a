"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: exact packed gated delta-rule layers, at cp = 1 and under CP.

Why: these models mix softmax attention (through the attention interface) with
`*GatedDeltaNet` linear-attention layers that do not. On a packed row Transformers runs their
short causal convolution and their chunked gated delta rule across document boundaries, and
under CP each rank would see only its shard. The patch replaces each GatedDeltaNet
instance's `forward` (its parameters unchanged) with one that projects as the stock forward
does, then runs the token mixer of `hf_blockdiag_cp.mixers` (convolution and delta rule
restarted at every document; under CP head-parallel or by state passing, whichever the step
chooses; torch or fla kernels), then the gated norm and output projection. Outputs, loss and
gradients equal the stock model run on each document alone.

Outside a CP step the layer is stock, unless the caller passes `cu_seq_lens_q` (a packed row
without CP), which is then honoured. A cache holding earlier state (generation) always runs
the stock forward; a fresh cache is left unwritten by the packed path.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import types

import torch

from hf_blockdiag_cp.mixers import GatedDeltaLayer, MixerContext, gated_delta_mix
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .registry import ModelPatch, register_patch

MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
_PARAMETERS = ("conv1d", "A_log", "dt_bias", "norm", "out_proj")
_VISION_INPUTS = ("pixel_values", "pixel_values_videos", "mm_encoder_outputs")


def has_linear_layers(config) -> bool:
    """Whether the (text) config has gated delta-rule layers (unknown layer types: assume so)."""
    text = getattr(config, "text_config", None) or config
    layer_types = getattr(text, "layer_types", None)
    return layer_types is None or "linear_attention" in layer_types


def is_gated_delta_net(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet") and all(hasattr(module, p) for p in _PARAMETERS)


def _torch_rule(module):
    """Transformers' torch `torch_chunk_gated_delta_rule` of the module's family, never a hub/fla replacement."""
    rule = getattr(sys.modules[type(module).__module__], "torch_chunk_gated_delta_rule", None)
    if rule is None:
        raise RuntimeError(f"model_patches.gated_delta: {type(module).__module__} has no torch_chunk_gated_delta_rule")
    return inspect.unwrap(rule)


def mixer_layer(module) -> GatedDeltaLayer:
    """What the token mixer reads of a GatedDeltaNet module (its parameters, not copies)."""
    return GatedDeltaLayer(
        name=f"{type(module).__name__} (layer {module.layer_idx})", key_heads=module.num_k_heads,
        key_dim=module.head_k_dim, value_heads=module.num_v_heads, value_dim=module.head_v_dim,
        conv_weight=module.conv1d.weight.squeeze(1), conv_bias=module.conv1d.bias, activation=module.activation,
        A_log=module.A_log, dt_bias=module.dt_bias, torch_rule=_torch_rule(module),
    )


def _project(module, hidden: torch.Tensor):
    """Rows `[L, D]` -> pre-convolution q|k|v `[L, 2·Hk·Dk + Hv·Dv]` (head-major), z `[L, Hv, Dv]`,
    b and a `[L, Hv]`, exactly as the stock forward builds them."""
    x = hidden[None]
    if hasattr(module, "in_proj_qkvz"):  # Qwen3-Next: interleaved per key-head group
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(x), module.in_proj_ba(x))
        mixed = torch.cat([t.reshape(1, t.shape[1], -1) for t in (q, k, v)], dim=-1)
    else:  # Qwen3.5, Qwen3.5-MoE
        mixed = module.in_proj_qkv(x)
        z = module.in_proj_z(x).reshape(1, x.shape[1], -1, module.head_v_dim)
        b, a = module.in_proj_b(x), module.in_proj_a(x)
    return mixed[0], z[0], b[0], a[0]


# --------------------------------------------------------------------------- the patched forward


def _has_previous_state(module, cache) -> bool:
    if cache is None:
        return False
    state = getattr(cache, "has_previous_state", False)
    return bool(state(module.layer_idx) if callable(state) else state)


def _context(module, step, kwargs, rows: int) -> MixerContext:
    if step is None:
        return MixerContext.from_runs(MixerRuns.documents(kwargs["cu_seq_lens_q"], rows))
    if rows != step.local_len:
        raise ValueError(
            f"blockdiag_cp: {type(module).__name__} got {rows} rows in a CP step whose shards hold {step.local_len}; "
            "feed the local batch returned by make_cp_blockdiag_batch_and_ctx"
        )
    return MixerContext.from_step(step)


@torch.compiler.disable
def _mix_documents(module, step, kwargs, rows: int, mixed, b, a) -> torch.Tensor:
    """The token mixer over the pack's documents: eager, a graph break under `torch.compile`, so the
    pack's runs and the step stay out of compiled graphs (no recompile per pack)."""
    return gated_delta_mix(mixer_layer(module), mixed, b, a, _context(module, step, kwargs, rows))


def packed_forward(self, hidden_states, *args, **kwargs):
    """GatedDeltaNet forward that keeps the documents of a packed row apart (see the module docstring)."""
    step = kwargs.get(STEP_KWARG) or active_step()
    cache = kwargs.get("cache", kwargs.get("cache_params"))
    stock = type(self).forward
    if step is None and kwargs.get("cu_seq_lens_q") is None:
        return stock(self, hidden_states, *args, **kwargs)
    if _has_previous_state(self, cache):
        if step is None:
            return stock(self, hidden_states, *args, **kwargs)
        raise ValueError(f"blockdiag_cp: {type(self).__name__} cannot continue from a cache inside a CP step")
    if args or hidden_states.shape[0] != 1:
        raise ValueError(
            f"blockdiag_cp: packed {type(self).__name__} takes one packed row, hidden_states [1, L, D] and keyword "
            f"arguments; got shape {tuple(hidden_states.shape)} and {len(args)} positional arguments"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2:
        hidden_states = (hidden_states * mask[:, :, None]).to(hidden_states.dtype)
    rows = hidden_states.shape[1]
    mixed, z, b, a = _project(self, hidden_states[0])
    core = _mix_documents(self, step, kwargs, rows, mixed, b, a)
    core = self.norm(core.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(core.reshape(1, rows, -1))


@contextlib.contextmanager
def stock_torch_kernels(model: torch.nn.Module):
    """Run the stock (unpatched) model's gated delta-rule layers on Transformers' own torch
    convolution and chunked delta rule even where flash-linear-attention or causal-conv1d is
    installed (Transformers swaps those in at import): a stock baseline or reference then uses
    the same kernels as the patch's torch path. No-op for a model without such layers."""
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    names = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
    saved = [(mod, name, getattr(mod, name)) for mod in modules for name in names if hasattr(mod, name)]
    for mod, name, fn in saved:
        setattr(mod, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


# --------------------------------------------------------------------------- installing it


def _refuse_vision_in_step(module, args, kwargs):
    """Qwen3.5 VL outer model: a CP step is text-only (image features and mRoPE need the full pack)."""
    if (kwargs.get(STEP_KWARG) or active_step()) is not None and any(kwargs.get(k) is not None for k in _VISION_INPUTS):
        raise ValueError(
            f"blockdiag_cp ({type(module).__name__}): CP steps with images or videos are not supported for this model "
            "yet (only its text stack is patched); pass text-only batches, without pixel_values"
        )
    return None


def apply(model: torch.nn.Module) -> None:
    patched = 0
    for module in model.modules():
        if is_gated_delta_net(module):
            _torch_rule(module)  # fail now, not at the first step, if the family lacks it
            module.forward = types.MethodType(packed_forward, module)
            patched += 1
        elif hasattr(module, "visual") and hasattr(module, "language_model"):
            module.register_forward_pre_hook(_refuse_vision_in_step, with_kwargs=True)
    if patched == 0:
        raise RuntimeError(
            f"model_patches.gated_delta: no GatedDeltaNet layer with {', '.join(_PARAMETERS)} found in "
            f"{type(model).__name__}"
        )


PATCH = register_patch(
    ModelPatch(
        name="gated_delta_packed",
        model_types=MODEL_TYPES,
        needed=has_linear_layers,
        apply=apply,
        why="gated delta-rule layers (convolution and recurrence) must restart at every document and see the whole pack",
    )
)

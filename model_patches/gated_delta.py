"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: exact packed gated delta-rule layers, at cp = 1 and under CP.

Why: these models mix softmax attention (through the attention interface) with
`*GatedDeltaNet` linear-attention layers that do not. On a packed row Transformers runs their
short causal convolution and their chunked gated delta rule across document boundaries, and
under CP each rank would see only its shard. The patch replaces each GatedDeltaNet
instance's `forward` (its parameters unchanged) with one that restarts both at every document
of the pack, so outputs, loss and gradients equal the stock model run on each document alone.

Under CP (G > 1) it runs head-parallel: one all-to-all (`comm.head_shards`) gives every rank the
whole pack, in pack order, for Hk/G key heads and their value heads (pre-convolution q, k, v
channels and the a, b gate inputs); the rank convolves with its rows of the depthwise kernel
and runs the delta rule over every document; a second all-to-all returns [local rows, all
heads], and the gated norm and output projection run locally. Each rank's A_log, dt_bias and
kernel rows get the gradient of every rank's loss for its heads only, so the mean over the
group is the non-CP gradient (I2), as for K/V exchanges. Needs Hk % G == 0.

Outside a CP step the layer is stock, unless the caller passes `cu_seq_lens_q` (a packed row
without CP), which is then honoured. A cache holding earlier state (generation) always runs
the stock forward; a fresh cache is left unwritten by the packed path.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types

import torch
import torch.nn.functional as F

from hf_blockdiag_cp.comm.head_shards import heads_to_seq, seq_to_heads
from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .gated_delta_kernels import (
    PackDocs,
    causal_conv_per_doc,
    delta_rule_per_doc,
    docs_from_cu_seqlens,
    docs_from_layout,
    fla_conv,
    fla_delta_rule,
    fla_refusal,
)
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


# --------------------------------------------------------------------------- projections per family


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


def _check_heads(module, world_size: int) -> None:
    if module.num_k_heads % world_size or module.num_v_heads % world_size:
        raise ValueError(
            f"blockdiag_cp: {type(module).__name__} (layer {module.layer_idx}) has linear_num_key_heads="
            f"{module.num_k_heads} and linear_num_value_heads={module.num_v_heads}; head-parallel CP needs both "
            f"divisible by the CP size G={world_size}. Choose a CP size that divides {module.num_k_heads}"
        )


def _owned_channels(module, world_size: int, rank: int, device) -> torch.Tensor:
    """Convolution channels (q, k, v rows of the depthwise kernel) of head group `rank`."""
    kq = module.key_dim // world_size
    vq = module.value_dim // world_size
    return torch.cat([
        torch.arange(rank * kq, (rank + 1) * kq),
        module.key_dim + torch.arange(rank * kq, (rank + 1) * kq),
        2 * module.key_dim + torch.arange(rank * vq, (rank + 1) * vq),
    ]).to(device)


def _to_head_groups(module, mixed, b, a, world_size: int) -> torch.Tensor:
    """`[L, G, c]`: for each head group, its q, k, v channels and its b, a columns."""
    rows = mixed.shape[0]
    q, k, v = mixed.split([module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return torch.cat([t.reshape(rows, world_size, -1) for t in (q, k, v, b.to(mixed.dtype), a.to(mixed.dtype))], dim=-1)


# --------------------------------------------------------------------------- the token mixer


def _kernels(module, x: torch.Tensor):
    """(convolution, delta rule), both per document: fla's where verified, else the torch reference."""
    if fla_refusal(x) is None:
        return fla_conv, fla_delta_rule
    return causal_conv_per_doc, functools.partial(delta_rule_per_doc, _torch_rule(module))


def _mix_heads(module, mixed, b, a, docs: PackDocs, world_size: int, rank: int) -> torch.Tensor:
    """Convolution and delta rule of head group `rank` over rows in pack order -> `[S, Hv/G, Dv]`."""
    hk, hv = module.num_k_heads // world_size, module.num_v_heads // world_size
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias
    if world_size > 1:
        channels = _owned_channels(module, world_size, rank, mixed.device)
        weight = weight.index_select(0, channels)
        bias = None if bias is None else bias.index_select(0, channels)
    conv, rule = _kernels(module, mixed)
    mixed = conv(mixed, weight, bias, module.activation, docs)
    rows = mixed.shape[0]
    q, k, v = mixed.split([hk * module.head_k_dim, hk * module.head_k_dim, hv * module.head_v_dim], dim=-1)
    q, k = q.reshape(rows, hk, module.head_k_dim), k.reshape(rows, hk, module.head_k_dim)
    v = v.reshape(rows, hv, module.head_v_dim)
    heads = slice(rank * hv, (rank + 1) * hv)
    beta = b.sigmoid()
    g = -module.A_log[heads].float().exp() * F.softplus(a.float() + module.dt_bias[heads])
    return rule(q, k, v, g, beta, docs)


def token_mixer(module, mixed, b, a, docs: PackDocs, group, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of the gated delta rule over the whole pack -> `[L, Hv, Dv]`."""
    if world_size == 1:
        if docs.to_pack is not None:
            raise AssertionError("a single rank holds the pack in order")
        return _mix_heads(module, mixed, b, a, docs, 1, 0)
    _check_heads(module, world_size)
    rows = mixed.shape[0]
    gathered = seq_to_heads(_to_head_groups(module, mixed, b, a, world_size), group, world_size, docs.to_pack)
    hk, hv = module.num_k_heads // world_size, module.num_v_heads // world_size
    conv_width = 2 * hk * module.head_k_dim + hv * module.head_v_dim
    mixed_h, b_h, a_h = gathered.split([conv_width, hv, hv], dim=-1)
    out = _mix_heads(module, mixed_h, b_h, a_h, docs, world_size, rank)
    out = heads_to_seq(out.reshape(out.shape[0], -1), group, world_size, docs.to_slots)
    return out.reshape(rows, module.num_v_heads, module.head_v_dim)


# --------------------------------------------------------------------------- the patched forward


def _has_previous_state(module, cache) -> bool:
    if cache is None:
        return False
    state = getattr(cache, "has_previous_state", False)
    return bool(state(module.layer_idx) if callable(state) else state)


def _docs(module, step, kwargs, rows: int, device) -> PackDocs:
    if step is None:
        return docs_from_cu_seqlens(kwargs["cu_seq_lens_q"], rows, device)
    if rows != step.local_len:
        raise ValueError(
            f"blockdiag_cp: {type(module).__name__} got {rows} rows in a CP step whose shards hold {step.local_len}; "
            "feed the local batch returned by make_cp_blockdiag_batch_and_ctx"
        )
    return step.cached(("gated_delta_docs", str(device)), lambda: docs_from_layout(step.layout, device))


@torch.compiler.disable
def _mix_documents(module, step, kwargs, rows: int, mixed, b, a) -> torch.Tensor:
    """The token mixer over the pack's documents: eager, a graph break under `torch.compile`, so the
    pack's document list and the step stay out of compiled graphs (no recompile per pack)."""
    docs = _docs(module, step, kwargs, rows, mixed.device)
    group, world_size, rank = (None, 1, 0) if step is None else (step.group, step.world_size, step.rank)
    return token_mixer(module, mixed, b, a, docs, group, world_size, rank)


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

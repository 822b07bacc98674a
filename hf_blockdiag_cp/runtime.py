"""Attention entry points: the Transformers attention function and an SDPA drop-in.

During a CP step every causal softmax-attention call runs: K/V exchange over the CP group,
then the local kernel over this rank's queries and the keys they need. Outside a step both
entry points are exactly Transformers' `sdpa` / `F.scaled_dot_product_attention` (I8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .exchange import exchange_kv
from .kernels import KERNELS, choose_kernel
from .state import STEP_KWARG, CPStep, active_step

# Keyword arguments a model may send that change the attention function; each needs kernel
# support before it can be accepted during a step (never silently ignored, I7).
_UNSUPPORTED_FEATURES = ("softcap", "s_aux")


def _check_call(step: CPStep, query, key, value, dropout: float, kwargs) -> None:
    for name in _UNSUPPORTED_FEATURES:
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"blockdiag_cp: attention argument {name!r} is not supported during a CP step yet; "
                "the model would be trained with wrong attention. Use a model without it or disable CP."
            )
    if dropout:
        raise NotImplementedError(
            f"blockdiag_cp: attention dropout ({dropout}) is not supported during a CP step; set the model's "
            "attention_dropout to 0"
        )
    if query.shape[0] != 1 or key.shape[0] != 1:
        raise ValueError(f"blockdiag_cp: a CP step needs batch size 1 (one packed row); query has batch {query.shape[0]}")
    if query.shape[2] != step.local_len or key.shape[2] != step.local_len:
        raise ValueError(
            f"blockdiag_cp: attention got {query.shape[2]} query and {key.shape[2]} key rows, but this rank's "
            f"shard holds {step.local_len} tokens; feed the model the local batch from "
            "make_cp_blockdiag_batch_and_ctx and run it with use_cache=False"
        )
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"blockdiag_cp: {query.shape[1]} query heads are not a multiple of {key.shape[1]} key heads")


def blockdiag_attention(step: CPStep, query, key, value, *, scale: float | None, sliding_window: int | None):
    """Block-diagonal CP attention. query [1,H,L,Dk], key [1,Hkv,L,Dk], value [1,Hkv,L,Dv] -> [1,L,H,Dv]."""
    k, v = exchange_kv(step.kv_exchange, key[0].transpose(0, 1), value[0].transpose(0, 1), step.group, step.world_size)
    out = local_attention(step, query[0].transpose(0, 1), k, v, scale=scale, sliding_window=sliding_window)
    step.attention_calls += 1
    return out.unsqueeze(0)


def local_attention(step: CPStep, q, exchanged_k, exchanged_v, *, scale: float | None, sliding_window: int | None):
    """This rank's share: q [L,H,Dk] against the keys it needs among the exchange's output rows -> [L,H,Dv]."""
    head_dim_k, head_dim_v = q.shape[-1], exchanged_v.shape[-1]
    kernel_name = step.cached(
        ("kernel", q.device, q.dtype, head_dim_k, head_dim_v),
        lambda: choose_kernel(step.attn_backend, q.device, q.dtype, head_dim_k, head_dim_v),
    )
    plan = step.plan
    if plan.key_range is not None:
        start, stop = plan.key_range
        k, v = exchanged_k[start:stop], exchanged_v[start:stop]
    else:
        k, v = exchanged_k.index_select(0, plan.key_index), exchanged_v.index_select(0, plan.key_index)
    if scale is None:
        scale = head_dim_k**-0.5
    return KERNELS[kernel_name](q, k, v, step, scale=scale, sliding_window=sliding_window)


def blockdiag_cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The function registered as `"blockdiag_cp"` in Transformers' `AttentionInterface`."""
    step = kwargs.pop(STEP_KWARG, None) or active_step()
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if step is None or not is_causal:
        # Outside a step, or a bidirectional call (vision tower): stock SDPA, never sharded.
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    _check_call(step, query, key, value, dropout, kwargs)
    out = blockdiag_attention(step, query, key, value, scale=scaling, sliding_window=kwargs.get("sliding_window"))
    return out, None


def cp_blockdiag_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    **kwargs,
) -> torch.Tensor:
    """Drop-in for `F.scaled_dot_product_attention`: block-diagonal CP attention while a step is
    active and the call is causal, stock SDPA otherwise. Returns `[B, H, L, Dv]` like SDPA."""
    step = kwargs.pop(STEP_KWARG, None) or active_step()
    if step is None or not is_causal:
        if step is not None and attn_mask is not None:
            raise ValueError(
                "cp_blockdiag_sdpa: an explicit attn_mask during a CP step would apply to the local shard only; "
                "call with attn_mask=None, is_causal=True"
            )
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, **kwargs,
        )
    if attn_mask is not None:
        raise ValueError("cp_blockdiag_sdpa: pass either attn_mask or is_causal=True during a CP step, not both")
    _check_call(step, query, key, value, dropout_p, kwargs)
    out = blockdiag_attention(step, query, key, value, scale=scale, sliding_window=kwargs.get("sliding_window"))
    return out.transpose(1, 2)

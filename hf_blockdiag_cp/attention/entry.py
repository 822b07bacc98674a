"""Attention entry points: the Transformers attention function and an SDPA drop-in.

During a CP step every causal softmax-attention call is checked (`features`) and dispatched to the
step's exchange and kernel (`dispatch`). Outside a step both entry points are exactly
Transformers' `sdpa` / `F.scaled_dot_product_attention` (I8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..step.model_support import check_model_support
from ..step.state import STEP_KWARG, CPStep, active_step
from .dispatch import blockdiag_attention
from .features import AttentionFeatures, attention_features, check_call, features_passthrough


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
    features = attention_features(query, kwargs)
    if step is None or not is_causal:
        # Outside a step, or a bidirectional call (vision tower): stock SDPA, never sharded.
        if features.names:  # SDPA has no softcap (it raises) and no sinks (it would ignore them)
            return features_passthrough(module, query, key, value, attention_mask, scaling, dropout, is_causal, features)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return step_attention(step, module, query, key, value, scaling, dropout, kwargs, features), None


@torch.compiler.disable
def step_attention(step: CPStep, module, query, key, value, scale, dropout, kwargs, features=AttentionFeatures()):
    """One attention call of a CP step (checks, K/V exchange, kernel) -> [1,L,H,Dv]; `module` None: no model check.

    Always eager, a graph break under `torch.compile` (docs/performance.md, "torch.compile"): the
    step's plan, routes, caches and process group stay out of the compiled graphs and their guards,
    so new packs never recompile, and the exchange's collectives and autograd functions run as written."""
    if module is not None:
        check_model_support(step, module)
    check_call(step, module, query, key, value, dropout, kwargs)
    return blockdiag_attention(
        step, query, key, value, scale=scale, sliding_window=kwargs.get("sliding_window"), features=features, module=module
    )


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
    return step_attention(step, None, query, key, value, scale, dropout_p, kwargs).transpose(1, 2)

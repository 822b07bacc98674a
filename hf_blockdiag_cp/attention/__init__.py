"""Attention entry points: the function registered as `"blockdiag_cp"` in Transformers'
AttentionInterface and the SDPA drop-in (`entry`), the cp = 1 hooks for modules that call
`F.scaled_dot_product_attention` themselves (`sdpa_hooks`). Each attention call of a step asks
the model patches whether its model can train (`step.model_support`)."""

from .entry import (
    AttentionFeatures,
    blockdiag_attention,
    blockdiag_cp_attention_forward,
    cp_blockdiag_sdpa,
    local_attention,
    split_attention,
)
from .sdpa_hooks import (
    Cp1PackedHooks,
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
)

__all__ = [
    "AttentionFeatures",
    "Cp1PackedHooks",
    "attach_cp1_packed_varlen_hooks",
    "blockdiag_attention",
    "blockdiag_cp_attention_forward",
    "cp1_packed_varlen_backend",
    "cp_blockdiag_sdpa",
    "disable_cp1_packed_varlen",
    "enable_cp1_packed_varlen",
    "local_attention",
    "split_attention",
]

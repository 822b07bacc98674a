"""Attention entry points: the function registered as `"blockdiag_cp"` in Transformers'
AttentionInterface and the SDPA drop-in (`entry`), what a call asks for and the checks of a step's
call (`features`), the step's exchange and kernel around one call (`dispatch`), and the cp = 1 hooks
for modules that call `F.scaled_dot_product_attention` themselves (`sdpa_hooks`). Each attention
call of a step asks the model patches whether its model can train (`step.model_support`)."""

from .dispatch import blockdiag_attention, local_attention, split_attention
from .entry import blockdiag_cp_attention_forward, cp_blockdiag_sdpa
from .features import AttentionFeatures
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

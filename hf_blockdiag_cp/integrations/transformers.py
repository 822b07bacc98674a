"""Registration of `"blockdiag_cp"` with Transformers' attention and mask interfaces.

The mask function makes a CP step cheap and a non-step call identical to `sdpa`: during a
step models get `attention_mask=None` (attention builds its own per-document plan, no
O(S²) tensor); outside a step the mask is exactly what `sdpa` would get, so padded
generation and eval behave as with `attn_implementation="sdpa"` (I8).
"""

from __future__ import annotations

from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from ..attention.entry import blockdiag_cp_attention_forward
from ..step.state import ATTN_IMPLEMENTATION, active_step

__all__ = ["ATTN_IMPLEMENTATION", "blockdiag_cp_mask", "register"]


def blockdiag_cp_mask(*args, **kwargs):
    if active_step() is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register `"blockdiag_cp"` (idempotent); called on `import hf_blockdiag_cp`."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, blockdiag_cp_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, blockdiag_cp_mask)

"""hf_blockdiag_cp: exact block-diagonal (per-document) context parallelism for packed
sequences in unmodified Hugging Face Transformers models.

`import hf_blockdiag_cp` registers the attention implementation `"blockdiag_cp"`.
"""

from .batch import make_cp_blockdiag_batch_and_ctx, shard_batch
from .config import CPConfig, configure_cp_varlen
from .layout import Layout, plan_layout
from .runtime import blockdiag_cp_attention_forward, cp_blockdiag_sdpa
from .state import BlockdiagCpModelState, current_blockdiag_cp_state
from .integrations.transformers import ATTN_IMPLEMENTATION, register as _register

_register()

__version__ = "0.1.0"

__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockdiagCpModelState",
    "CPConfig",
    "Layout",
    "blockdiag_cp_attention_forward",
    "configure_cp_varlen",
    "cp_blockdiag_sdpa",
    "current_blockdiag_cp_state",
    "make_cp_blockdiag_batch_and_ctx",
    "plan_layout",
    "shard_batch",
]

"""hf_blockdiag_cp: exact block-diagonal (per-document) context parallelism for packed
sequences in unmodified Hugging Face Transformers models.

`import hf_blockdiag_cp` registers the attention implementation `"blockdiag_cp"`. The Trainer
integration (`BlockdiagCPTrainer`, ...) is imported on first use: `transformers.Trainer` is heavy.
"""

from .balance import LayoutCost, layout_cost
from .batch import make_cp_blockdiag_batch_and_ctx, shard_batch
from .collator import BlockdiagCPCollator
from .config import CPConfig, configure_cp_varlen
from .corpus import load_corpus
from .data import (
    DocumentPiece,
    PackedBatchSampler,
    PackedDataLoader,
    PackedExamples,
    dataset_lengths,
    dp_cp_coordinates,
    packed_dataloader,
)
from .exchange import ExchangeMeter
from .exchange_plan import ExchangeBytes, ExchangePlan, choose_exchange, kv_row_bytes, plan_exchange
from .integrations.transformers import ATTN_IMPLEMENTATION
from .integrations.transformers import register as _register
from .layout import Layout, plan_layout
from .packed import (
    Cp1PackedHooks,
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
)
from .packing import PackingStats, first_fit_decreasing
from .runtime import blockdiag_cp_attention_forward, cp_blockdiag_sdpa
from .state import BlockdiagCpModelState, current_blockdiag_cp_state

_register()

__version__ = "0.1.0"

_TRAINER_NAMES = ("BlockdiagCPCallback", "BlockdiagCPTrainer", "BlockdiagCPTrainerMixin")
_PATCH_NAMES = ("UNSUPPORTED_MODEL_TYPES", "apply_model_patches")


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from .integrations import trainer

        return getattr(trainer, name)
    if name in _PATCH_NAMES:  # model_patches imports this package, so it is loaded on first use
        import model_patches

        return getattr(model_patches, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockdiagCPCallback",
    "BlockdiagCPCollator",
    "BlockdiagCPTrainer",
    "BlockdiagCPTrainerMixin",
    "BlockdiagCpModelState",
    "CPConfig",
    "Cp1PackedHooks",
    "DocumentPiece",
    "ExchangeBytes",
    "ExchangeMeter",
    "ExchangePlan",
    "Layout",
    "LayoutCost",
    "PackedBatchSampler",
    "PackedDataLoader",
    "PackedExamples",
    "PackingStats",
    "UNSUPPORTED_MODEL_TYPES",
    "apply_model_patches",
    "attach_cp1_packed_varlen_hooks",
    "blockdiag_cp_attention_forward",
    "choose_exchange",
    "configure_cp_varlen",
    "cp1_packed_varlen_backend",
    "cp_blockdiag_sdpa",
    "current_blockdiag_cp_state",
    "dataset_lengths",
    "disable_cp1_packed_varlen",
    "dp_cp_coordinates",
    "enable_cp1_packed_varlen",
    "first_fit_decreasing",
    "kv_row_bytes",
    "layout_cost",
    "load_corpus",
    "make_cp_blockdiag_batch_and_ctx",
    "packed_dataloader",
    "plan_exchange",
    "plan_layout",
    "shard_batch",
]

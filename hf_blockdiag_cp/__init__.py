"""hf_blockdiag_cp: exact block-diagonal (per-document) context parallelism for packed
sequences in unmodified Hugging Face Transformers models.

`import hf_blockdiag_cp` registers the attention implementation `"blockdiag_cp"`. The root
holds the user's names; internals live in their subpackages, bottom up: `planning` (pure),
`comm` (collectives), `kernels` (local attention), `step` (shard step and step object),
`attention` (Transformers entry points), `model_patches` (per-family patches; the repository's
top-level `model_patches/` folder), `logprobs` (per-document log-probs of a sharded pack without
full logits), `data` (packing, sampler, collator) and `integrations` (transformers, accelerate,
Trainer, TRL, torch.compile). The Trainer names are imported on first use:
`transformers.Trainer` is heavy.
"""

from .attention import cp_blockdiag_sdpa
from .comm import DPCPCoordinates  # deprecated alias of ParallelDims (one release)
from .comm import ParallelDims
from .config import CPConfig, configure_cp, configure_cp_varlen
from .data import BlockdiagCPCollator, PackedBatchSampler, packed_dataloader
from .integrations.compile import compile_model
from .integrations.memory import enable_checkpoint_offload, enable_tiled_mlp
from .integrations.transformers import ATTN_IMPLEMENTATION
from .integrations.transformers import register as _register
from .logprobs import DocumentLogProbs, document_log_probs
from .planning import Layout, plan_layout
from .step import (
    BlockdiagCPModelState,
    BlockdiagCpModelState,  # noqa: F401  (the first spelling, kept importable)
    make_cp_blockdiag_batch_and_ctx,
    current_blockdiag_cp_state,
    shard_batch,
)

from .model_patches import UNSUPPORTED_MODEL_TYPES, apply_model_patches
from .model_patches import check_attention_module as _check_attention_module
from .step.model_support import ModelSupport as _ModelSupport
from .step.model_support import register_model_support as _register_model_support

_register()
# The step and attention reach the model patches (a layer above them) through this hook.
_register_model_support(_ModelSupport(prepare=apply_model_patches, check=_check_attention_module))

__version__ = "0.1.0"

_TRAINER_NAMES = ("BlockdiagCPCallback", "BlockdiagCPTrainer", "BlockdiagCPTrainerMixin")


def __getattr__(name: str):
    if name in _TRAINER_NAMES:
        from .integrations import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION",
    "BlockdiagCPCallback",
    "BlockdiagCPCollator",
    "BlockdiagCPModelState",
    "BlockdiagCPTrainer",
    "BlockdiagCPTrainerMixin",
    "CPConfig",
    "DPCPCoordinates",
    "DocumentLogProbs",
    "Layout",
    "PackedBatchSampler",
    "ParallelDims",
    "UNSUPPORTED_MODEL_TYPES",
    "apply_model_patches",
    "compile_model",
    "configure_cp",
    "configure_cp_varlen",
    "enable_checkpoint_offload",
    "enable_tiled_mlp",
    "cp_blockdiag_sdpa",
    "current_blockdiag_cp_state",
    "document_log_probs",
    "make_cp_blockdiag_batch_and_ctx",
    "packed_dataloader",
    "plan_layout",
    "shard_batch",
]

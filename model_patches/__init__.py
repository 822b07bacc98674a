"""Per-family patches for models that need more than the attention interface (see README).

Installed as `hf_blockdiag_cp.model_patches` (the repository's top-level `model_patches/`
folder); the package root registers `check_attention_module` with the attention entry point.
`apply_model_patches(model)` installs what a model needs (registry keyed by `model_type`);
the runtime refuses, at the first attention call of a CP step, a model that needs a patch it
did not get or whose type is known to bypass the interface (`UNSUPPORTED_MODEL_TYPES`).

Families: `phi3` (LongRoPE / dynamic RoPE from the global pack), `qwen2_vl` (Qwen2-VL and
Qwen2.5-VL text stack sharded after full-pack embeddings and mRoPE positions), `gated_delta`
(Qwen3.5, Qwen3.5-MoE, Qwen3-Next, OLMo-Hybrid gated delta-rule layers: per document, head-parallel
or state passing under CP), `kda` (Kimi Linear, Bailing-Hybrid KDA layers, on the same mixer),
`lfm2` (LFM2, LFM2-MoE short gated convolutions; state passing),
`mamba2` (Mamba2, NemotronH, GraniteMoeHybrid, Bamba, FalconH1, Zamba2 SSD layers; state passing),
`mamba1` (Mamba, FalconMamba, Jamba selective-scan layers; state passing),
`minimax` (MiniMax lightning-attention layers; state passing);
`packed_mixer` holds what those token-mixer patches share. `router_aux_loss` (every MoE family whose
modeling module computes the Switch Transformers load-balancing loss): the router auxiliary loss over
the whole pack under CP.
"""

from . import gated_delta, kda, lfm2, mamba1, mamba2, minimax, phi3, qwen2_vl, router_aux_loss  # noqa: F401  (registration)
from .registry import PATCHES, ModelPatch, apply_model_patches, check_attention_module, patches_for, register_patch
from .unsupported import UNSUPPORTED_MODEL_TYPES

__all__ = [
    "PATCHES",
    "UNSUPPORTED_MODEL_TYPES",
    "ModelPatch",
    "apply_model_patches",
    "check_attention_module",
    "patches_for",
    "register_patch",
]

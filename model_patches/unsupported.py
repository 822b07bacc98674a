"""Model types known to bypass the attention interface, and why.

These models mix tokens with state-space (Mamba) scans, linear attention, gated recurrences
or short causal convolutions, whole or in part. Those layers see only the local shard under
CP and know nothing of packed document boundaries, so training would be silently wrong.
`apply_model_patches` and the first attention call of a CP step raise for them (a type with a
patch, such as the gated delta-rule, KDA, short-convolution, Mamba and lightning-attention hybrids
in `gated_delta`, `kda`, `lfm2`, `mamba2`, `mamba1` and `minimax`, is not listed here). See
`tests/multiprocess/test_recurrent.py` for how a model-owned recurrent layer can use
`current_blockdiag_cp_state()` to become exact.
"""

from __future__ import annotations

_SSM_HYBRID = "a hybrid of attention and state-space (Mamba) layers"

UNSUPPORTED_MODEL_TYPES: dict[str, str] = {
    "zamba": _SSM_HYBRID,
    "recurrent_gemma": "gated linear recurrence (RG-LRU) and causal convolution layers",
    "rwkv": "RWKV time-mixing recurrences instead of softmax attention",
    "xlstm": "mLSTM / sLSTM recurrences instead of softmax attention",
    "zaya": "causal convolutions over q/k and a delayed recurrent value state (CCA) before attention",
    # Sparse attention whose indexer picks keys per query from the (local) attention mask.
    "deepseek_v32": "DeepSeek sparse attention: an indexer selects keys from the full-sequence mask",
    "glm_moe_dsa": "DeepSeek-style sparse attention: an indexer selects keys from the full-sequence mask",
}

"""What an attention call asks for beyond block-causal softmax, and the checks of a step's call.

`AttentionFeatures` (softcap, sinks) is read from the call's keyword arguments; every kernel must
implement each feature it is given. Arguments no kernel implements are refused (I7), as are
attention dropout, a batch other than one packed row, and rows other than the shard's. Outside a
step, softcap and sinks run here over the model's own mask (SDPA has neither).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..kernels.attention.dense import attention_with_features
from ..step.state import CPStep
from .dropout import attention_dropout_error, attention_dropout_field

# Keyword arguments a model may send that change the attention function and that no kernel
# implements; accepting them silently would train a wrong model (I7).
_UNSUPPORTED_FEATURES = {
    "position_bias": "an additive position bias (T5-style relative attention bias)",
    "sinks": "per-token attention sinks (a sink logit per query)",
    "indices": "sparse attention indices (DeepSeek-V3.2-style indexer)",
}


@dataclass(frozen=True)
class AttentionFeatures:
    """What one attention call asks for beyond block-causal softmax; kernels must implement each."""

    softcap: float | None = None
    sinks: torch.Tensor | None = None  # [H] one extra logit per query head (GPT-OSS `s_aux`)

    @property
    def names(self) -> frozenset[str]:
        return frozenset(n for n, v in (("softcap", self.softcap), ("sinks", self.sinks)) if v is not None)

    def kernel_kwargs(self) -> dict:
        """Only the features in use, so kernels without them keep the plain signature."""
        return {n: getattr(self, n) for n in sorted(self.names)}

    def for_heads(self, heads: slice) -> "AttentionFeatures":
        """The features of query heads `heads` alone (a head-parallel rank's share of the sinks)."""
        return self if self.sinks is None else replace(self, sinks=self.sinks.reshape(-1)[heads])


def attention_features(query: torch.Tensor, kwargs: dict) -> AttentionFeatures:
    """Read and check `softcap` (Gemma2) and `s_aux` (GPT-OSS sinks) from an attention call's kwargs."""
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
            raise ValueError(f"blockdiag_cp: softcap must be a positive number or None; got {softcap!r}")
        softcap = float(softcap)
    if sinks is not None:
        heads = query.shape[1]
        if not isinstance(sinks, torch.Tensor) or sinks.numel() != heads:
            raise ValueError(
                f"blockdiag_cp: s_aux (attention sinks) must be a tensor with one value per query head ({heads}); "
                f"got {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}"
            )
    return AttentionFeatures(softcap, sinks)


def check_call(step: CPStep, module, query, key, value, dropout: float, kwargs) -> None:
    """Refuse what no kernel of the step runs, naming the field to change; `module` None: an SDPA call."""
    for name, what in _UNSUPPORTED_FEATURES.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"blockdiag_cp: attention argument {name!r} ({what}) is not supported during a CP step; "
                "the model would be trained with wrong attention. Use a model without it or disable CP."
            )
    if dropout:
        raise attention_dropout_error(module, dropout)
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


def features_passthrough(module, query, key, value, attention_mask, scaling, dropout, is_causal, features):
    """Non-step call with softcap / sinks: the same math as the model's eager path, over its own mask."""
    if dropout and module.training:
        field = attention_dropout_field(module, dropout) or "the attention dropout"
        raise NotImplementedError(f"blockdiag_cp: attention dropout ({dropout}) with softcap or sinks is not supported; "
                                  f"set {type(getattr(module, 'config', module)).__name__}.{field} to 0.0")
    q_len, k_len = query.shape[2], key.shape[2]
    allowed = bias = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :k_len]
        if mask.dtype == torch.bool:
            allowed = mask
        else:
            bias = mask
    elif is_causal and q_len > 1:
        allowed = torch.ones(1, 1, q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    outs = []
    for b in range(query.shape[0]):
        outs.append(
            attention_with_features(
                query[b],
                key[b],
                value[b],
                None if allowed is None else allowed[b if allowed.shape[0] > 1 else 0],
                bias=None if bias is None else bias[b if bias.shape[0] > 1 else 0],
                scale=scale,
                softcap=features.softcap,
                sinks=features.sinks,
            )
        )
    return torch.stack(outs).transpose(1, 2).contiguous(), None

"""Sequence-level quantities of a CP-sharded pack without `[tokens, vocab]` logits: the chunked
log-prob head (`head`), run inside the model's own forward (`capture`; under FSDP2 as a forward of
its unit, `fsdp`), and its per-document sums over the CP group (`documents`). What DPO, reward models
and RL steps are built on."""

from .documents import DocumentLogProbs, document_log_probs, per_document_sum, shard_log_probs
from .head import STATS, LogitTransform, token_log_probs

__all__ = ["STATS", "DocumentLogProbs", "LogitTransform", "document_log_probs", "per_document_sum", "shard_log_probs",
           "token_log_probs"]

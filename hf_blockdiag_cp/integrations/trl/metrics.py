"""TRL's token metrics (`mean_token_accuracy`, `entropy`, `num_tokens`) under block-diagonal CP.

TRL's `SFTTrainer.compute_loss` records them per micro-batch from its fused LM head and its
`log` averages them; `BlockdiagCPSFTTrainer` computes the loss the model's own way, so it
records the same metrics from the model's logits with `token_metrics`, combined over the ranks.
"""

from __future__ import annotations

import torch
from trl.trainer.utils import entropy_from_logits

from ...step import IGNORE_INDEX
from ..trainer.setup import sum_over_world

def token_metrics(logits: torch.Tensor | None, shift_labels: torch.Tensor, document_ids: torch.Tensor,
                  world_size: int, fill: bool = False) -> dict[str, float | int]:
    """TRL's token metrics of one CP step (one micro-batch or eval round), over every rank.

    Each rank holds only its shard of each pack: `logits` [1, L, V] (None where the forward built
    none: Liger's fused cross-entropy in training), `shift_labels` [1, L] (the labels the shard
    step shifted on the global pack: row i's target, -100 for none) and `document_ids` [1, L]
    (0 = padding). The rank sums its targets (labels != -100), the targets whose label is the
    first argmax of the logits (TRL's `is_top1`), the entropy of the next-token distribution over
    its targets (TRL's `entropy_from_logits`: chunked, its fused kernel where Triton runs) and its
    real tokens; ONE SUM all-reduce over every rank then adds the shards of
    each pack (the CP group; the shards are disjoint) and the packs of the DP replicas (what TRL
    gathers with `accelerator.gather`). As TRL: accuracy = correct / targets and entropy =
    entropy sum / targets, 0.0 without targets. `num_tokens` is the real tokens of every pack
    once, not once per CP rank. A `fill` pack (one that only fills the DP replicas' last eval
    round) adds nothing but still joins the all-reduce, as every rank must.

    Returns {"num_tokens"} plus, when every rank had logits, {"mean_token_accuracy", "entropy"}.
    """
    sums = torch.zeros(5, dtype=torch.float64)  # targets, correct, entropy sum, real tokens, ranks with logits
    sums[4] = logits is not None
    if not fill:
        labels = shift_labels.reshape(-1)
        where = labels.ne(IGNORE_INDEX).nonzero().squeeze(1)
        sums[0], sums[3] = where.numel(), int(document_ids.gt(0).sum())
        if logits is not None and where.numel():
            rows = logits.detach().reshape(labels.numel(), -1)
            with torch.no_grad():
                correct = rows.argmax(dim=-1)[where].eq(labels[where]).sum()
                entropy = entropy_from_logits(rows)[where].sum(dtype=torch.float64)  # TRL's own, in row chunks
            sums[1:3] = torch.stack([correct.double(), entropy]).cpu()
    targets, correct, entropy, tokens, with_logits = sum_over_world(sums, world_size).tolist()
    metrics: dict[str, float | int] = {"num_tokens": int(tokens)}
    if with_logits == world_size:
        metrics["mean_token_accuracy"] = correct / targets if targets else 0.0
        metrics["entropy"] = entropy / targets if targets else 0.0
    return metrics

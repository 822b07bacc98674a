"""TRL's token metrics (`mean_token_accuracy`, `entropy`) under block-diagonal CP.

TRL's `SFTTrainer.compute_loss` computes them per micro-batch from its fused LM head, gathered over
the processes, and its `log` averages the micro-batches' values. `BlockdiagCPSFTTrainer` computes
the loss the model's own way, so `TokenMetrics` takes the same sums from the model's logits: each
micro-batch (or eval round) of a rank adds one row of sums on its device, no host sync; when the
trainer logs, ONE all-reduce adds the rows of every rank, and the metrics are averaged over the rows
as TRL averages them.
"""

from __future__ import annotations

import torch

from ...compat.trl import entropy_from_logits
from ...step import IGNORE_INDEX
from ..trainer.setup import sum_over_world

MODES = ("train", "eval")


class TokenMetrics:
    """This rank's rows of token sums since the last log, per mode ("train", "eval").

    A row: targets (labels != -100), targets whose label is the first argmax of the logits (TRL's
    `is_top1`), the entropy of the next-token distribution summed over the targets (TRL's
    `entropy_from_logits`), and 1 if the forward built logits (Liger's fused cross-entropy builds
    none in training). Every rank adds the same number of rows between two logs (the CP steps run in
    lockstep), so row i of every rank belongs to the same micro-batch.
    """

    def __init__(self):
        self.rows: dict[str, list[torch.Tensor]] = {mode: [] for mode in MODES}

    def add(self, mode: str, logits: torch.Tensor | None, shift_labels: torch.Tensor, fill: bool = False) -> None:
        """One CP step of this rank: its shard's `logits` [1, L, V] (or None) and `shift_labels` [1, L]
        (row i's target on the global pack, -100 for none). A `fill` pack (one that only fills the DP
        replicas' last eval round) adds a row of zeros, as every rank must add a row."""
        labels = shift_labels.reshape(-1)
        row = torch.zeros(4, dtype=torch.float64, device=labels.device)
        row[3] = logits is not None
        if not fill:
            mask = labels.ne(IGNORE_INDEX)
            row[0] = mask.sum()
            if logits is not None:
                rows = logits.detach().reshape(labels.numel(), -1)
                with torch.no_grad():
                    row[1] = (rows.argmax(dim=-1).eq(labels) & mask).sum()
                    row[2] = torch.where(mask, entropy_from_logits(rows).double(), 0.0).sum()  # TRL's own, chunked
        self.rows[mode].append(row)

    def pop(self, mode: str, world_size: int) -> dict[str, float]:
        """TRL's averages of the rows since the last log, over every rank; empty without rows. A
        collective when there are rows: call it on every rank at the same log."""
        rows, self.rows[mode] = self.rows[mode], []
        if not rows:
            return {}
        sums = sum_over_world(torch.stack(rows), world_size).tolist()  # one all-reduce
        kept = [(targets, correct, entropy) for targets, correct, entropy, with_logits in sums if with_logits == world_size]
        if not kept:
            return {}
        accuracy = [correct / targets if targets else 0.0 for targets, correct, _ in kept]
        entropy = [entropy / targets if targets else 0.0 for targets, _, entropy in kept]
        return {"mean_token_accuracy": sum(accuracy) / len(kept), "entropy": sum(entropy) / len(kept)}

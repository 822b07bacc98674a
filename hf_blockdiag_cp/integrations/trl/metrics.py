"""TRL's token metrics (`mean_token_accuracy`, `entropy`) under block-diagonal CP.

TRL's `SFTTrainer.compute_loss` computes them per micro-batch from its fused LM head, gathered over
the processes, and its `log` averages the micro-batches' values. `TokenMetrics` takes the same sums
from the per-token entropy and top-1 flags of the chunked log-prob head (`BlockdiagCPSFTTrainer`'s
training loss, `trainer.head_loss`), or else from the model's logits (evaluation, the model's own loss): each
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
        entropy = is_top1 = None
        if logits is not None and not fill:
            rows = logits.detach().reshape(labels.numel(), -1)
            with torch.no_grad():
                entropy, is_top1 = entropy_from_logits(rows), rows.argmax(dim=-1).eq(labels)  # TRL's own, chunked
        self._add_row(mode, labels, entropy, is_top1, fill, with_stats=logits is not None)

    def add_token_stats(self, mode: str, entropy: torch.Tensor, is_top1: torch.Tensor, shift_labels: torch.Tensor,
                        fill: bool = False) -> None:
        """As `add`, from the per-token entropy and top-1 flags of this rank's shard ([1, L] each, the
        chunked head's `logprobs.STATS`) instead of its logits."""
        self._add_row(mode, shift_labels.reshape(-1), entropy.reshape(-1), is_top1.reshape(-1), fill, with_stats=True)

    def _add_row(self, mode: str, labels: torch.Tensor, entropy, is_top1, fill: bool, with_stats: bool) -> None:
        """One row of sums over the targets (labels != -100): count, top-1 count, entropy; zeros for a fill pack."""
        row = torch.zeros(4, dtype=torch.float64, device=labels.device)
        row[3] = with_stats
        if not fill:
            mask = labels.ne(IGNORE_INDEX)
            row[0] = mask.sum()
            if entropy is not None:
                row[1] = (is_top1.bool() & mask).sum()
                row[2] = torch.where(mask, entropy.detach().double(), 0.0).sum()
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

"""A shard's targets, known on the host; packs with labels but no target token: warned about with a count, or
refused (`CPConfig.no_target_packs`).

The shard step slices the labels on the host, so it also knows where the shard's targets are
(`HostTargets`); the step moves those rows to the device once (`StepTargets`), and the log-prob head
takes them from there instead of reading the device's labels back (a `nonzero` and a range check,
each a host-device sync per call).

After the global shift every label of such a pack is -100 (masking gone wrong, or only one-token
documents). Under CP it trains nothing: the loss is 0 and the gradients are zero, where the stock
model returns nan for the same input, so broken masking would pass unnoticed. The step checks
the pack's target count, which every rank of the group agreed on (`PackFingerprint.label_count`),
so every rank of the group decides alike without another collective.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..compat.torch import tensor_version

logger = logging.getLogger(__name__)

_SEEN = 0  # packs without targets this process counted (the first rank of each CP group counts its group's)


def no_targets_error(packs: int) -> ValueError:
    """The error of `CPConfig(no_target_packs="raise")` for `packs` packs without targets."""
    return ValueError(
        f"blockdiag_cp: {packs} pack{'s' if packs != 1 else ''} with labels but no target token (every label is -100 "
        "after the shift on the global pack): nothing to train on. Check the labels' masking (a document needs two "
        "tokens for one target); CPConfig(no_target_packs='warn') trains on and warns instead"
    )


def check_pack_targets(policy: str, targets: int, has_labels: bool, cp_rank: int) -> None:
    """Raise (`policy` "raise") or count and warn (on CP rank 0, at the 1st, 2nd, 4th ... such pack of the
    process) when a pack with labels has no target; a pack without labels is left alone."""
    global _SEEN
    if not has_labels or targets > 0:
        return
    if policy == "raise":
        raise no_targets_error(1)
    if cp_rank != 0:
        return
    _SEEN += 1
    if _SEEN & (_SEEN - 1) == 0:  # a power of two: the warning's rate falls as the count grows
        logger.warning(
            "blockdiag_cp: %d pack%s so far had labels but no target token (every label is -100 after the shift on "
            "the global pack): they train nothing (loss 0, zero gradients; the stock model returns nan). Check the "
            "labels' masking, or set CPConfig(no_target_packs='raise') to stop at the first one (warned at the 1st, "
            "2nd, 4th, 8th ... such pack)", _SEEN, "s" if _SEEN != 1 else "",
        )


@dataclass(frozen=True)
class HostTargets:
    """Where a shard has targets (labels other than -100 after the global shift), on the host: `rows` [N]
    (int64, ascending) and the smallest and largest target (None without targets)."""

    rows: torch.Tensor
    low: int | None
    high: int | None

    @staticmethod
    def of(labels: torch.Tensor, ignore_index: int) -> "HostTargets":
        """The targets of a shard's host `labels` [L]."""
        rows = (labels != ignore_index).nonzero().squeeze(1)
        if rows.numel() == 0:
            return HostTargets(rows, None, None)
        low, high = (int(v) for v in torch.aminmax(labels.index_select(0, rows)))
        return HostTargets(rows, low, high)


@dataclass(frozen=True, eq=False)
class StepTargets:
    """`HostTargets` with its rows moved to the device once per step, for the one `labels` tensor (the step's
    `shift_labels`) they describe: `describe(labels)` holds while that tensor is the one given to the step,
    unchanged since (its version counter), so a caller that edits or replaces the labels gets them read anew."""

    rows: torch.Tensor
    low: int | None
    high: int | None
    labels: torch.Tensor
    version: int

    @staticmethod
    def build(host: HostTargets | None, labels, device: torch.device) -> "StepTargets | None":
        if host is None or not isinstance(labels, torch.Tensor) or labels.numel() != labels.shape[-1]:
            return None
        return StepTargets(host.rows.to(device, non_blocking=True), host.low, host.high, labels, tensor_version(labels))

    def describe(self, labels: torch.Tensor) -> bool:
        return labels is self.labels and tensor_version(labels) == self.version

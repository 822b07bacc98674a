"""Per-document log-probs of a CP-sharded pack: `document_log_probs(model, local)`.

Each rank scores the targets of its shard (the labels shifted on the global pack by the shard step,
so no target crosses a document or a shard) with the chunked head, then ONE differentiable SUM
all-reduce over the CP group adds every rank's per-document partial sums: every rank gets the same
`[D]` totals, in document order, with gradients to its own shard (`comm.reduce`). This is what
sequence-level objectives (DPO, reward models, RL) need from a pack, without `[tokens, vocab]` logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.reduce import all_reduce_sum
from ..config import default_config
from ..step import IGNORE_INDEX, STEP_KWARG
from ..step.model_support import configured_model
from .capture import HeadRequest, output_embedding, run_with_head
from .head import STATS, LogitTransform

# Keys of a shard step's local batch that are the loss's, not the model's.
LOSS_KEYS = ("labels", "shift_labels", "loss_mask", "num_items_in_batch")


def per_document_sum(values: torch.Tensor, document_ids: torch.Tensor, num_documents: int, group=None) -> torch.Tensor:
    """Sum the rows of `values` ([L] or [L, K], this rank's shard) by `document_ids` ([L], 1-based, 0 =
    padding, dropped) into `[D]` or `[D, K]`, then over `group` (differentiable, `comm.reduce`). The
    sums are float64: a document's log-prob sums thousands of terms, and its differences (rewards,
    log-ratios) cancel most of them."""
    flat = values.reshape(values.shape[0], -1).double()
    out = flat.new_zeros(num_documents + 1, flat.shape[1]).index_add(0, document_ids.reshape(-1).long(), flat)
    out = all_reduce_sum(out[1:], group)
    return out if values.ndim > 1 else out.reshape(-1)


@dataclass
class DocumentLogProbs:
    """The log-probs of one shard step's targets, per token on this rank's shard and per document of the pack.

    token_log_probs: [1, L] fp32, log p(target) at every shard position with a target, 0 elsewhere.
    stats: the requested per-token statistics ([1, L], no gradient, 0 where no target).
    sums: [D] float64, each document's summed log-prob over its targets on every rank; the same on every
        rank of the CP group, in document order (document id d at index d - 1), differentiable.
    stat_sums: each statistic summed per document, [D] float64.
    counts: [D] int64, each document's targets.
    document_ids: [1, L], the shard's document ids (1-based, 0 = padding).
    """

    token_log_probs: torch.Tensor
    stats: dict[str, torch.Tensor]
    sums: torch.Tensor
    stat_sums: dict[str, torch.Tensor]
    counts: torch.Tensor
    document_ids: torch.Tensor
    group: Any = field(default=None, repr=False)

    @property
    def num_documents(self) -> int:
        return self.sums.shape[0]

    def per_document(self, values: torch.Tensor) -> torch.Tensor:
        """Any other per-token tensor of this shard ([1, L] or [1, L, K]) summed per document over the
        CP group ([D] or [D, K]; one all-reduce; every rank must call it)."""
        if values.shape[:2] != self.document_ids.shape:
            raise ValueError(f"values must start with the shard's shape {tuple(self.document_ids.shape)}; got "
                             f"{tuple(values.shape)}")
        return per_document_sum(values[0], self.document_ids[0], self.num_documents, self.group)


def _pack_documents(local: dict, step) -> int:
    """How many documents the pack holds (the step's layout on the host; the shard's ids without a step)."""
    if step is not None:
        return int(step.layout.document_ids.max())
    return int(local["document_ids"].max())


def _targets(local: dict, vocab: int, step=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target mask [L], scored positions [N], their targets [N]) of the shard; raise for a target outside the
    vocabulary. With the step's `StepTargets` for these labels, the positions and the range come from the host
    (no read of the device's labels)."""
    for key in ("shift_labels", "document_ids"):
        if not isinstance(local.get(key), torch.Tensor):
            raise ValueError(
                f"local[{key!r}] is missing: document_log_probs takes the local batch of a shard step "
                "(make_cp_blockdiag_batch_and_ctx or shard_batch, with labels)"
            )
    labels = local["shift_labels"].reshape(-1)
    if local["document_ids"].numel() != labels.numel():
        raise ValueError(f"local['document_ids'] has {local['document_ids'].numel()} positions; expected "
                         f"{labels.numel()} (those of shift_labels)")
    mask = labels != IGNORE_INDEX
    known = getattr(step, "targets", None)
    if known is not None and known.describe(local["shift_labels"]):
        rows, low, high = known.rows, known.low, known.high
    else:  # one read of the device's labels for the positions, one for the range check
        rows, low, high = mask.nonzero().squeeze(1), None, None
        targets = labels.index_select(0, rows)
        if targets.numel() and bool(((targets < 0) | (targets >= vocab)).any()):
            low, high = int(targets.min()), int(targets.max())
    if low is not None and (low < 0 or high >= vocab):
        raise ValueError(
            f"local['shift_labels'] holds targets outside the vocabulary [0, {vocab}) (or negative ones other than "
            f"{IGNORE_INDEX}): values {low}..{high}"
        )
    return mask, rows, labels.index_select(0, rows)


def shard_log_probs(
    model,
    local: dict,
    *,
    stats: tuple[str, ...] = (),
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """Run `model` on this rank's `local` batch with the chunked head: ([L] fp32 log p(target) at every
    shard position with a target and 0 elsewhere, {stat: [L]} without gradient, the [L] target mask).
    Per token only: `document_log_probs` adds the per-document sums over the CP group. The head runs its
    tiles as the step's `CPConfig.head_tiles` says (the process default's without a step)."""
    head = output_embedding(model)
    mask, rows, targets = _targets(local, head.weight.shape[0], local.get(STEP_KWARG))
    config = getattr(configured_model(model), "config", None)
    transform = LogitTransform.of_config(config, temperature) if config is not None else LogitTransform(temperature=temperature)
    step = local.get(STEP_KWARG)
    tiles = default_config().head_tiles if step is None else step.head_tiles
    request = HeadRequest(rows, targets, transform, chunk_size, tuple(stats), tiles)
    run_with_head(model, {k: v for k, v in local.items() if k not in LOSS_KEYS}, request)
    length = mask.numel()

    def spread(values: torch.Tensor) -> torch.Tensor:  # [N] at the scored positions of [L]
        return values.new_zeros(length).index_put((rows,), values)

    extra = {name: spread(request.values[name].float()) for name in STATS if name in request.values}
    return spread(request.log_probs), extra, mask


def document_log_probs(
    model,
    local: dict,
    *,
    stats: tuple[str, ...] = (),
    chunk_size: int | None = None,
    temperature: float = 1.0,
) -> DocumentLogProbs:
    """Run `model` on this rank's `local` batch (a shard step's, inside its `train_ctx()`; or a pack
    sharded for one rank) and return the log-probs of its targets per token and per document.

    `stats`: per-token statistics to compute as well (`logprobs.head.STATS`: "entropy", "mean_logits",
    "is_top1", "log_sum_sq_probs"); `chunk_size`: rows projected at once (one fp32 chunk_size x vocab
    tile; the backward also holds an fp32 vocab x hidden weight gradient, `head`); `temperature`
    divides the logits (RL sampling). The model runs its own forward (DDP, FSDP2 in any units, PEFT
    and compile wrappers included) without computing a loss; every rank of the CP group must call
    this, in the same order as its other collectives.
    """
    step = local.get(STEP_KWARG)
    tokens, extra, mask = shard_log_probs(model, local, stats=stats, chunk_size=chunk_size, temperature=temperature)
    columns = torch.stack([tokens, mask.to(tokens.dtype), *extra.values()], dim=1)
    group = None if step is None else step.group
    totals = per_document_sum(columns, local["document_ids"], _pack_documents(local, step), group)
    return DocumentLogProbs(
        token_log_probs=tokens.unsqueeze(0),
        stats={name: value.unsqueeze(0) for name, value in extra.items()},
        sums=totals[:, 0],
        stat_sums={name: totals[:, 2 + i].detach() for i, name in enumerate(extra)},
        counts=totals[:, 1].detach().round().long(),
        document_ids=local["document_ids"],
        group=group,
    )

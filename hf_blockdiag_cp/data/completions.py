"""Padded completion rows, as RL trainers hold them, packed padding-free into one pack.

An RL trainer scores the completion tokens of rows `[B, L]`: a prompt left-padded, then a
completion right-padded, the last `completions` columns being the completion (TRL's layout;
`attention_mask` marks the real tokens). `CompletionRows` makes each row's real tokens one document,
labels its completion tokens, and numbers each target's place in the `[B, completions]` result (a
slot). `completion_pack` packs the rows of several ranks (a CP group's, in rank order) into one
pack (each rank's rows in a canonical order: the same rows give the same pack, so an RL step's old and
new policy log-probs of one batch agree to the bit however the trainer shuffled it) and returns this
CP rank's shard with its slot stream: at shard position t, the slot of the
target predicted there (the label at t + 1 of the global pack, as the shard step shifts it), -1 for
none.

The shard carries its targets as `shift_labels` only, without `labels`: a pack whose completions are
all masked (TRL's `mask_truncated_completions`) is an RL micro-batch that trains nothing, as in TRL,
not the broken label masking that `CPConfig.no_target_packs` warns about or refuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import CPConfig
from ..step import IGNORE_INDEX, SHARD_KEY, local_rows
from .collator import BlockdiagCPCollator

NO_SLOT = -1


@dataclass(frozen=True)
class CompletionRows:
    """One rank's rows: `input_ids` and `attention_mask` `[B, L]` (on the CPU), the last
    `completions` columns the completion. Each row's real tokens must be one run (left-padded prompt,
    right-padded completion) holding at least one prompt token."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completions: int

    @staticmethod
    def of(input_ids: torch.Tensor, attention_mask: torch.Tensor, completions: int) -> "CompletionRows":
        """Check the rows (ValueError naming the argument and the row) and keep them on the CPU."""
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids and attention_mask must be [B, L] of one shape; got {tuple(input_ids.shape)} "
                             f"and {tuple(attention_mask.shape)}")
        if isinstance(completions, bool) or not isinstance(completions, int) or not 0 <= completions < input_ids.shape[1]:
            raise ValueError(f"logits_to_keep (the completion columns) must be an int in [0, {input_ids.shape[1]}) for "
                             f"rows of {input_ids.shape[1]} columns; got {completions!r}")
        if input_ids.is_floating_point():
            raise ValueError(f"input_ids must hold integer token ids; got {input_ids.dtype}")
        rows = CompletionRows(input_ids.detach().cpu().long(), attention_mask.detach().cpu().bool(), completions)
        for b in range(rows.rows):
            rows.span(b)
        return rows

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def slots(self) -> int:
        """The size of this rank's result, B * completions."""
        return self.rows * self.completions

    @property
    def prompt_columns(self) -> int:
        return self.input_ids.shape[1] - self.completions

    def span(self, b: int) -> tuple[int, int]:
        """[start, stop) of row b's real tokens; ValueError for holes or a row without a prompt token."""
        real = self.attention_mask[b].nonzero().squeeze(1)
        if real.numel() and int(real[-1] - real[0]) + 1 != real.numel():
            raise ValueError(f"attention_mask row {b} has holes; expected a left-padded prompt followed by a "
                             "right-padded completion (one run of real tokens)")
        if not real.numel() or int(real[0]) >= self.prompt_columns:
            raise ValueError(f"row {b} has no prompt token (attention_mask is 0 over its first {self.prompt_columns} "
                             "columns); a completion's first token needs a prompt token to be predicted from")
        return int(real[0]), int(real[-1]) + 1

    def take(self, start: int, stop: int) -> "CompletionRows":
        """Rows [start, stop) (fewer, or none, past the end)."""
        return CompletionRows(self.input_ids[start:stop], self.attention_mask[start:stop], self.completions)

    def tokens(self) -> list[int]:
        """Real tokens per row."""
        return [stop - start for start, stop in map(self.span, range(self.rows))]

    def targets(self) -> int:
        """Completion tokens to score (real tokens in the completion columns)."""
        return int(self.attention_mask[:, self.prompt_columns:].sum())

    def documents(self, offset: int) -> tuple[list[dict], list[torch.Tensor]]:
        """One document per row (`input_ids`, `labels`: the completion tokens, -100 on the prompt) and
        its slot stream (position t: the slot of the label at t + 1), slots numbered from `offset`."""
        docs, streams = [], []
        columns = torch.arange(self.input_ids.shape[1])
        for b in range(self.rows):
            start, stop = self.span(b)
            ids = self.input_ids[b, start:stop]
            completion = columns[start:stop] >= self.prompt_columns
            docs.append({"input_ids": ids, "labels": torch.where(completion, ids, IGNORE_INDEX)})
            slot = offset + b * self.completions + columns[start:stop] - self.prompt_columns
            slot = torch.where(completion, slot, NO_SLOT)
            streams.append(torch.cat([slot[1:], torch.tensor([NO_SLOT])]))
        return docs, streams


def pack_length(tokens: int, cp_size: int) -> int:
    """The smallest pack holding `tokens` (a positive multiple of 2 * cp_size, as the shard step needs)."""
    unit = 2 * cp_size
    return max(unit, -(-tokens // unit) * unit)


def completion_pack(ranks: Sequence[CompletionRows], pad_token_id: int, cp_size: int, cp_rank: int,
                    cp_config: CPConfig | None = None) -> tuple[dict, torch.Tensor]:
    """The rows of every rank of the CP group, in rank order, as one pack sharded for `cp_rank`, and
    its slot stream `[1, L_local]` (slots numbered over the ranks in order: rank r's from the sum of
    the earlier ranks' `slots`). The shard has `shift_labels` and no `labels` (module docstring)."""
    docs, streams, offset = [], [], 0
    for rows in ranks:
        d, s = rows.documents(offset)
        order = sorted(range(len(d)), key=lambda i: d[i]["input_ids"].tolist())
        docs += [d[i] for i in order]  # one order for one set of rows, however they were shuffled:
        streams += [s[i] for i in order]  # the same rows score the same bits (old and new policy)
        offset += rows.slots
    if not docs:
        raise ValueError("no row to pack: every rank of the CP group gave an empty batch")
    total = sum(d["input_ids"].numel() for d in docs)
    collator = BlockdiagCPCollator(pack_length(total, cp_size), pad_token_id, cp_size, cp_rank, "raise", cp_config)
    local = collator.shard(collator.pack(docs))
    del local["labels"]  # the targets are shift_labels (module docstring)
    return local, local_rows(torch.cat(streams), local[SHARD_KEY], fill=NO_SLOT)

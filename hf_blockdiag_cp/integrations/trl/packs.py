"""TRL's packed rows as block-diagonal CP packs: one prepared row is one pack.

`SFTTrainer` packs the documents itself (`SFTConfig(packing=True)`; `bfd` / `bfd_split` keep the
document boundaries as `seq_lengths`), so nothing is re-packed here: `PrepackedBatchSampler`
deals the rows to the DP replicas as `PackedBatchSampler` deals its packs, and
`SFTPackCollator` runs TRL's own collator on the row (labels as TRL masks them, `position_ids`
restarting per document), cuts it into its documents and hands them to `BlockdiagCPCollator`,
which pads the pack to `max_length` and shards it for this CP rank.
"""

from __future__ import annotations

import dataclasses

import torch

from ...config import CPConfig
from ...data import BlockdiagCPCollator, PackedBatchSampler, PackedDataLoader, PackedExamples, dataset_lengths
from ...step import document_ids_of


class PrepackedBatchSampler(PackedBatchSampler):
    """`PackedBatchSampler` for a dataset whose every example is already one pack (at most `max_tokens` tokens).

    Per epoch the examples are shuffled (seed + epoch; in order with `shuffle=False`) and dealt
    round-robin to the DP replicas, example i of the epoch to replica i % dp_size, with the same
    fill (`drop_last=False`) or drop of the last incomplete round as `PackedBatchSampler`.
    """

    def __init__(self, lengths, max_tokens: int, **kwargs):
        super().__init__(lengths, max_tokens, oversize="reject", **kwargs)

    def epoch_packs(self) -> list[list[int]]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        return [[index] for index in order]


class SFTPackCollator:
    """Collate ONE prepared TRL row into a block-diagonal CP pack: `trl_collator([row])` (TRL's
    `DataCollatorForLanguageModeling`), its documents (from `position_ids`, else one document),
    then `BlockdiagCPCollator` (padding to `max_tokens`, `document_ids`, this rank's shard)."""

    def __init__(self, trl_collator, max_tokens: int, pad_token_id: int, cp_size: int = 1,
                 cp_rank: int | None = None, cp_config: CPConfig | None = None):
        if getattr(trl_collator, "pad_to_multiple_of", None) is not None:  # every pack is padded to max_tokens here
            trl_collator = dataclasses.replace(trl_collator, pad_to_multiple_of=None)
        self.trl_collator = trl_collator
        self.packer = BlockdiagCPCollator(max_tokens, pad_token_id, cp_size, cp_rank, "reject", cp_config)

    def documents(self, rows: list[dict]) -> list[dict[str, torch.Tensor]]:
        """The row's documents, each `{"input_ids", "labels"}` as TRL's collator emits them."""
        if len(rows) != 1:
            raise ValueError(f"SFTPackCollator collates one prepared row per pack; got {len(rows)} rows")
        batch = self.trl_collator(rows)
        input_ids, labels = batch["input_ids"], batch["labels"]
        ids = document_ids_of(batch, input_ids.shape[1])  # position_ids restarts; else attention_mask: one document
        runs, counts = torch.unique_consecutive(ids, return_counts=True)
        pieces = zip(runs.tolist(), input_ids[0].split(counts.tolist()), labels[0].split(counts.tolist()))
        return [{"input_ids": tokens, "labels": targets} for run, tokens, targets in pieces if run != 0]

    def __call__(self, rows: list[dict]) -> dict:
        return self.packer(self.documents(rows))


def prepacked_dataloader(dataset, trl_collator, max_tokens: int, *, dp_size: int = 1, dp_rank: int = 0,
                         cp_size: int = 1, cp_rank: int | None = None, pad_token_id: int = 0, seed: int = 0,
                         shuffle: bool = True, drop_last: bool = False, num_workers: int = 0,
                         cp_config: CPConfig | None = None) -> PackedDataLoader:
    """One pack per batch for this rank from a dataset of prepared TRL rows (`input_ids`, `labels`,
    `seq_lengths`): `PrepackedBatchSampler` + `SFTPackCollator`. A row longer than `max_tokens`
    raises ValueError naming it."""
    lengths = dataset_lengths(dataset, "input_ids")
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"row {index} of the prepared dataset has {length} tokens, more than SFTConfig.max_length="
                f"{max_tokens} (the pack size); let SFTTrainer pack the data (packing=True, no skip_prepare_dataset) "
                "or pack it to max_length yourself"
            )
    sampler = PrepackedBatchSampler(lengths, max_tokens, shuffle=shuffle, seed=seed, dp_size=dp_size,
                                    dp_rank=dp_rank, drop_last=drop_last)
    collator = SFTPackCollator(trl_collator, max_tokens, pad_token_id, cp_size, cp_rank, cp_config)
    return PackedDataLoader(PackedExamples(dataset), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers)

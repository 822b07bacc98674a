"""Preference pairs packed padding-free: the two sequences of a pair always share one pack.

A pack holds whole pairs, as documents `chosen_0, rejected_0, chosen_1, rejected_1, ...`; the
sampler packs pairs by their total length (`PackedBatchSampler` over pair lengths, a pair longer
than the pack refused), and `PairPackCollator` builds the pack, shards it for this CP rank and adds a
`PairBatch`: how many pairs the pack holds, the dataset rows they came from, their completion
lengths and, if the dataset carries them, the reference log-probs and margins. Per-position streams
that a trainer needs on the shard (weights per target, the token where a sequence classifier reads each
sequence's score: `pooled_position`) are computed on the full pack here and sharded with it
(`step.local_rows`), so a stream's token may sit on any rank.

What a pair's two sequences are (prompt + completion, truncated as TRL truncates, or whole
sequences) is a small picklable `PairReader` callable, so the collator runs in DataLoader workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import torch

from ..config import CPConfig
from ..step import IGNORE_INDEX, SHARD_KEY, local_rows
from .collator import BlockdiagCPCollator, _token_row
from .loader import PackedBatchSampler, PackedDataLoader

PAIRS_KEY = "blockdiag_cp_pairs"  # the local batch's `PairBatch`; not a model input


@dataclass(frozen=True)
class ScoredSequence:
    """One sequence of a pair: its tokens and which of them are completion (None: all are scored)."""

    ids: torch.Tensor
    completion: torch.Tensor | None = None


PairReader = Callable[[dict, int], "tuple[ScoredSequence, ScoredSequence]"]


@dataclass(frozen=True)
class PromptCompletionPairs:
    """prompt + chosen and prompt + rejected (`prompt_ids`, `chosen_ids`, `rejected_ids`), each truncated
    to `max_length` as TRL's `DataCollatorForPreference` truncates (`keep_start`: the first tokens;
    `keep_end`: the last). A completion left without tokens raises, naming the example."""

    max_length: int | None = None
    truncation_mode: str = "keep_start"

    def __call__(self, example: dict, index: int) -> tuple[ScoredSequence, ScoredSequence]:
        prompt = _token_row(index, "prompt_ids", example["prompt_ids"])
        pair = []
        for key in ("chosen_ids", "rejected_ids"):
            completion = _token_row(index, key, example[key])
            if completion.numel() == 0:
                raise ValueError(f"example {index} has an empty {key.removesuffix('_ids')!r} completion ({key!r} holds "
                                 "no token): a preference pair needs a token in each completion")
            ids = torch.cat([prompt, completion])
            mask = torch.cat([torch.zeros_like(prompt, dtype=torch.bool), torch.ones_like(completion, dtype=torch.bool)])
            if self.max_length is not None and ids.numel() > self.max_length:
                cut = slice(None, self.max_length) if self.truncation_mode == "keep_start" else slice(-self.max_length, None)
                ids, mask = ids[cut], mask[cut]
            if not bool(mask.any()):
                raise ValueError(
                    f"example {index}: its prompt has {prompt.numel()} tokens, so truncation to max_length="
                    f"{self.max_length} ({self.truncation_mode}) leaves no token of its {key.removesuffix('_ids')!r} "
                    "completion; raise max_length or drop the example"
                )
            pair.append(ScoredSequence(ids, mask))
        return pair[0], pair[1]


@dataclass(frozen=True)
class WholePairs:
    """`chosen_ids` and `rejected_ids` as they are (a reward model scores the whole sequence)."""

    def __call__(self, example: dict, index: int) -> tuple[ScoredSequence, ScoredSequence]:
        pair = []
        for key in ("chosen_ids", "rejected_ids"):
            ids = _token_row(index, key, example[key])
            if ids.numel() == 0:
                raise ValueError(f"example {index} has an empty {key!r}: each sequence of a pair needs a token")
            pair.append(ScoredSequence(ids))
        return pair[0], pair[1]


@dataclass(frozen=True)
class PairBatch:
    """What a packed pair batch carries besides the tokens (the same on every rank of a CP group, but for
    `streams`, which are this rank's shard).

    pairs: P, the pairs of the pack (documents 2i + 1 and 2i + 2 are pair i's chosen and rejected).
    indices: [P] the dataset rows of the pairs.
    completion_tokens: [P, 2] the completion tokens of each sequence after truncation.
    tokens: the real tokens of the pack.
    values: per-pair columns of the dataset named in `pair_columns` (e.g. reference log-probs, margins), [P, ...],
      float64 as the dataset holds them (precomputed reference sums are float64 like the live ones).
    streams: per-position rows of this rank's shard, [1, L] (e.g. `last_token`, `target_weight`).
    filler: a pack that only gives its DP replica as many packs as the others in a round (`data.pair_batches`):
      its pairs weigh 0 in the loss, the pair counts and the metrics, but it still runs through the model.
    micro_batch: (pairs, chosen targets) of the whole micro-batch the pack belongs to, filler packs aside (the
      pack's own when it is the micro-batch): what a loss term that is a micro-batch mean needs before any of
      its packs runs (a chosen target: a labelled token of a chosen sequence after its first token).
    """

    pairs: int
    indices: torch.Tensor
    completion_tokens: torch.Tensor
    tokens: int
    values: dict = field(default_factory=dict)
    streams: dict = field(default_factory=dict)
    filler: bool = False
    micro_batch: tuple[int, int] = (0, 0)

    def to(self, device, non_blocking: bool = False) -> "PairBatch":
        def move(t):
            return t.to(device, non_blocking=non_blocking)

        return replace(self, indices=move(self.indices), completion_tokens=move(self.completion_tokens),
                       values={k: move(v) for k, v in self.values.items()},
                       streams={k: move(v) for k, v in self.streams.items()})


def pooled_position(ids: torch.Tensor, pad_token_id: int | None) -> int:
    """The position where a Transformers sequence classifier reads the score of the sequence `ids` (the rule of
    `GenericForSequenceClassification` and the model-specific classifiers, transformers 5.17 to 5.25): its last
    token that is not `pad_token_id`, so a pad token equal to EOS moves it to the token before an appended EOS;
    0 when every token is `pad_token_id`; the last token when `pad_token_id` is None (the rule for one row)."""
    if pad_token_id is None:
        return ids.numel() - 1
    kept = (ids != pad_token_id).nonzero()
    return int(kept[-1]) if kept.numel() else 0


def shared_length_weights(labels: list[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """LD-DPO's per-target weights of a pair's two sequences (TRL's `ld_alpha`): 1 for the first
    min(chosen, rejected) completion targets of each sequence, `alpha` for the rest, 0 off targets."""
    targets = [torch.cat([lab[1:] != IGNORE_INDEX, torch.zeros(1, dtype=torch.bool)]) for lab in labels]
    shared = min(int(t.sum()) for t in targets)
    out = []
    for t in targets:
        position = t.long().cumsum(0)
        out.append(torch.where(t, torch.where(position <= shared, 1.0, alpha), 0.0))
    return out


class PairPackCollator:
    """Collate the pairs of ONE pack into this CP rank's shard plus its `PairBatch` (under `PAIRS_KEY`).

    sequences: a `PairReader` (`PromptCompletionPairs` for DPO, `WholePairs` for reward models);
    labels: whether the sequences carry labels (the prompt -100); without, the pack has no labels.
    pair_columns: dataset columns copied per pair into `PairBatch.values` (missing ones are skipped).
    ld_alpha: with labels, add the `target_weight` stream (`shared_length_weights`).
    last_token: add the `last_token` stream, 1.0 at the token where a sequence classifier whose config has
    `pad_token_id=classifier_pad_token_id` reads each sequence's score (`pooled_position`; None: the last
    token). It is the classifier's pad token, not the pack's `pad_token_id` (padding is marked by document ids).
    """

    def __init__(self, sequences: PairReader, max_tokens: int, pad_token_id: int, cp_size: int, cp_rank: int,
                 cp_config: CPConfig | None = None, *, labels: bool = True, pair_columns: Sequence[str] = (),
                 ld_alpha: float | None = None, last_token: bool = False, classifier_pad_token_id: int | None = None):
        if classifier_pad_token_id is not None and (isinstance(classifier_pad_token_id, bool)
                                                    or not isinstance(classifier_pad_token_id, int)):
            raise ValueError(f"classifier_pad_token_id must be an int or None; got {classifier_pad_token_id!r}")
        self.packer = BlockdiagCPCollator(max_tokens, pad_token_id, cp_size, cp_rank, "raise", cp_config)
        self.sequences = sequences
        self.labels = labels
        self.pair_columns = tuple(pair_columns)
        self.ld_alpha = ld_alpha
        self.last_token = last_token
        self.classifier_pad_token_id = classifier_pad_token_id

    def __call__(self, items: list[tuple[int, dict]]) -> dict:
        docs, completion, indices, chosen_targets = [], [], [], 0
        for index, example in items:
            pair = self.sequences(example, index)
            for seq in pair:
                labels = seq.ids if seq.completion is None else torch.where(seq.completion, seq.ids, IGNORE_INDEX)
                docs.append({"input_ids": seq.ids, "labels": labels})
            chosen_targets += int(docs[-2]["labels"][1:].ne(IGNORE_INDEX).sum())
            completion.append([int(s.ids.numel() if s.completion is None else s.completion.sum()) for s in pair])
            indices.append(index)
        full = self.packer.pack(docs)
        if not self.labels:
            full.pop("labels")
        local = self.packer.shard(full)
        info = local[SHARD_KEY]
        values = {}
        for name in self.pair_columns:
            if all(name in example for _, example in items):
                values[name] = torch.tensor([example[name] for _, example in items], dtype=torch.float64)
        pairs = PairBatch(len(items), torch.tensor(indices), torch.tensor(completion, dtype=torch.long),
                          sum(d["input_ids"].numel() for d in docs), values, self._streams(docs, info),
                          micro_batch=(len(items), chosen_targets))
        local[PAIRS_KEY] = pairs
        return local

    def _streams(self, docs: list[dict], info) -> dict[str, torch.Tensor]:
        streams = {}
        if self.last_token:
            marks = []
            for doc in docs:
                mark = torch.zeros(doc["input_ids"].numel())
                mark[pooled_position(doc["input_ids"], self.classifier_pad_token_id)] = 1.0
                marks.append(mark)
            streams["last_token"] = local_rows(torch.cat(marks), info)
        if self.ld_alpha is not None and self.labels:
            weights = [w for i in range(0, len(docs), 2)
                       for w in shared_length_weights([docs[i]["labels"], docs[i + 1]["labels"]], self.ld_alpha)]
            streams["target_weight"] = local_rows(torch.cat(weights), info)
        return streams


class _IndexedRows(torch.utils.data.Dataset):
    """Dataset rows with their index: the collator names examples and records which pairs a pack holds."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, dict]:
        return index, self.dataset[index]


def pair_lengths(dataset, sequences: PairReader) -> list[int]:
    """The tokens of each pair (both sequences, after truncation); raises for a malformed pair, naming it."""
    lengths = []
    for index in range(len(dataset)):
        chosen, rejected = sequences(dataset[index], index)
        lengths.append(chosen.ids.numel() + rejected.ids.numel())
    return lengths


def check_pairs_fit(lengths: Sequence[int], max_tokens: int, what: str) -> None:
    """Raise ValueError naming the first pair longer than the pack (`what` says which settings bound it)."""
    for index, length in enumerate(lengths):
        if length > max_tokens:
            raise ValueError(
                f"pair {index} has {length} tokens (chosen + rejected, {what}), more than max_tokens={max_tokens}, "
                "the pack size: the two sequences of a pair share one pack. Raise max_tokens (a multiple of "
                "2*cp_size), lower the per-sequence max_length, or drop the pair"
            )


def pair_dataloader(dataset, collator: PairPackCollator, lengths: Sequence[int], max_tokens: int, *, dp_size: int = 1,
                    dp_rank: int = 0, seed: int = 0, shuffle: bool = True, drop_last: bool = False,
                    num_workers: int = 0, buffer_size: int = 1024) -> PackedDataLoader:
    """One pack of whole pairs per batch for this rank (DP replicas get different packs, CP peers the same)."""
    sampler = PackedBatchSampler(lengths, max_tokens, buffer_size=buffer_size, shuffle=shuffle, seed=seed,
                                 dp_size=dp_size, dp_rank=dp_rank, drop_last=drop_last, oversize="raise")
    return PackedDataLoader(_IndexedRows(dataset), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers)

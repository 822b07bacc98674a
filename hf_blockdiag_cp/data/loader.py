"""CP-aware data distribution: which packs each rank trains on.

All CP ranks of one DP replica must collate the *same* pack every step, and different DP
replicas different packs. `PackedBatchSampler` does both without any communication: every
rank plans the whole epoch's packs from the same lengths, seed and epoch (deterministic
shuffling and first-fit-decreasing packing), then keeps the packs of its DP replica. CP
peers construct it with equal arguments, so they yield identical packs; the shard step's
per-step consensus (`make_cp_blockdiag_batch_and_ctx`) raises if they ever differ.

Rank layout convention (`hf_blockdiag_cp.ParallelDims`): the data-parallel replica is the
slowest dimension (`dp_rank`), then cp, then tp; with tp = 1 ranks `[dp * cp_size, (dp + 1) *
cp_size)` form one CP group, as `ParallelDims.build_mesh` lays them out. The TP ranks of a CP rank
get the same pack and the same shard: pass `dims.dp_rank`, `dims.dp_size`, `dims.cp_rank` and
`dims.cp_size`, never the global rank.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, Union

import torch
from torch.utils.data import DataLoader, Sampler

from .collator import BlockdiagCPCollator, warn_split_documents
from .packing import PackingStats, checked_length, count_oversized, first_fit_decreasing, oversize_policy


@dataclass(frozen=True)
class DocumentPiece:
    """Tokens `[start, stop)` of example `index`: one pack-sized piece of a document longer than the pack.

    Deliberately not an int or a tuple, so a dataset that does not understand pieces fails
    loudly instead of returning the whole example (wrap it in `PackedExamples`).
    """

    index: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


PackItem = Union[int, DocumentPiece]

# A micro-batch of several packs (the preference trainers' `batching="pairs"`): the packs, in the order they run.
PACKS_KEY = "blockdiag_cp_packs"


def micro_batch_packs(batch: dict) -> list[dict]:
    """The packs of one micro-batch, each a CP step of its own: `batch[PACKS_KEY]`, else the batch itself."""
    return batch[PACKS_KEY] if PACKS_KEY in batch else [batch]


def check_not_empty(lengths: Sequence[int]) -> None:
    """Raise ValueError for a dataset that gives nothing to train on: no example, or only examples
    without a token (every packed step would train on padding alone)."""
    if not lengths:
        raise ValueError(
            "the dataset holds no example: nothing to pack or train on. If a filter emptied it (dataset.filter, a "
            "length cut, dropping documents that tokenized to nothing), check that filter"
        )
    if not any(lengths):
        raise ValueError(
            f"every one of the dataset's {len(lengths)} examples has 0 tokens (empty input_ids): nothing to train on. "
            "Check the tokenizer (one without a vocabulary turns every text into []) and the text column"
        )


class PackedExamples(torch.utils.data.Dataset):
    """A map-style dataset view that resolves the sampler's items: an int is the example, a `DocumentPiece` its slice."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: PackItem) -> dict:
        if isinstance(item, DocumentPiece):
            example = self.dataset[item.index]
            piece = {"input_ids": example["input_ids"][item.start : item.stop]}
            if example.get("labels") is not None:
                piece["labels"] = example["labels"][item.start : item.stop]
            return piece
        return self.dataset[item]

    def __getitems__(self, items: list[PackItem]) -> list[dict]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None and not any(isinstance(item, DocumentPiece) for item in items):
            return getitems(list(items))  # one batched read (e.g. datasets.Dataset)
        return [self[item] for item in items]


class PackedBatchSampler(Sampler[list[PackItem]]):
    """Yields the dataset indices of one pack at a time, for DP replica `dp_rank` of `dp_size`.

    Per epoch: shuffle example indices (seed + epoch), cut them into buffers of
    `buffer_size` examples, pack each buffer with first-fit decreasing into packs of at most
    `max_tokens` tokens, shuffle the packs of the buffer, and deal all packs round-robin to the
    replicas (pack i goes to replica i % dp_size).

    - Equal pack counts per replica (every replica must step together): `drop_last=False`
      repeats packs from the start of the epoch to fill the last round, `drop_last=True` drops
      the incomplete last round.
    - An example longer than `max_tokens` with `oversize="split"` becomes pieces of
      `max_tokens` tokens (the last one shorter), yielded as `DocumentPiece` items: full
      pieces fill a pack alone, the remainder piece is packed like any short document. Read
      items through `PackedExamples(dataset)` (`packed_dataloader` does). Pieces only occur
      when some example is oversized; otherwise every item is a plain int index. Construction
      warns (once per process for the same numbers) and `oversized` counts the split examples
      and their tokens. `oversize="raise"` raises at construction, naming the example.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        *,
        buffer_size: int = 1024,
        shuffle: bool = True,
        seed: int = 0,
        dp_size: int = 1,
        dp_rank: int = 0,
        drop_last: bool = False,
        oversize: str = "split",
    ):
        for name, value in (("max_tokens", max_tokens), ("buffer_size", buffer_size), ("dp_size", dp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an integer in [0, dp_size={dp_size}); got {dp_rank!r}")
        oversize = oversize_policy(oversize)
        self.lengths = [checked_length(i, n) for i, n in enumerate(lengths)]
        check_not_empty(self.lengths)
        self.oversized = count_oversized(self.lengths, max_tokens, oversize)  # raises for oversize="raise"
        if self.oversized.documents:
            warn_split_documents(self.oversized, len(self.lengths), max_tokens)
        self.max_tokens = max_tokens
        self.buffer_size = buffer_size
        self.shuffle = shuffle
        self.seed = seed
        self.dp_size = dp_size
        self.dp_rank = dp_rank
        self.drop_last = drop_last
        self.oversize = oversize
        self.epoch = 0
        self._planned: tuple[int, list[list[PackItem]]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose shuffle to use; call it with the same value on every rank."""
        self.epoch = epoch

    def _items(self, index: int) -> list[PackItem]:
        n = self.lengths[index]
        if n <= self.max_tokens:
            return [index]
        return [DocumentPiece(index, s, min(s + self.max_tokens, n)) for s in range(0, n, self.max_tokens)]

    def _item_length(self, item: PackItem) -> int:
        return item.length if isinstance(item, DocumentPiece) else self.lengths[item]

    def epoch_packs(self) -> list[list[PackItem]]:
        """Every pack of the current epoch, over all replicas, in dealing order."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        order = torch.randperm(n, generator=generator).tolist() if self.shuffle else list(range(n))
        packs: list[list[PackItem]] = []
        for begin in range(0, n, self.buffer_size):
            items = [item for index in order[begin : begin + self.buffer_size] for item in self._items(index)]
            bins = first_fit_decreasing([self._item_length(item) for item in items], self.max_tokens)
            if self.shuffle:  # FFD emits packs longest-document first; do not train in that order
                bins = [bins[i] for i in torch.randperm(len(bins), generator=generator).tolist()]
            packs.extend([items[i] for i in sorted(b)] for b in bins)  # buffer order inside a pack
        return packs

    def replica_packs(self) -> list[list[PackItem]]:
        """The packs this replica yields this epoch (cached per epoch)."""
        if self._planned is not None and self._planned[0] == self.epoch:
            return self._planned[1]
        packs = self.epoch_packs()
        if self.drop_last:
            packs = packs[: len(packs) - len(packs) % self.dp_size]
        elif packs and len(packs) % self.dp_size:
            missing = self.dp_size - len(packs) % self.dp_size
            packs = packs + [packs[i % len(packs)] for i in range(missing)]
        mine = packs[self.dp_rank :: self.dp_size]
        self._planned = (self.epoch, mine)
        return mine

    def replica_repeats(self) -> list[bool]:
        """Per pack of `replica_packs()`: whether it only repeats an earlier pack to fill the last
        round (`drop_last=False`). Evaluation weighs those packs 0, so no token counts twice."""
        total = len(self.epoch_packs())
        return [j * self.dp_size + self.dp_rank >= total for j in range(len(self.replica_packs()))]

    @property
    def stats(self) -> PackingStats:
        """Packing of the packs this replica yields in the current epoch."""
        packs = self.replica_packs()
        real = sum(self._item_length(item) for pack in packs for item in pack)
        return PackingStats(len(packs), real, len(packs) * self.max_tokens)

    def __iter__(self) -> Iterator[list[PackItem]]:
        for pack in self.replica_packs():
            yield list(pack)

    def __len__(self) -> int:
        return len(self.replica_packs())


def dataset_lengths(dataset, length_key: str = "input_ids") -> list[int]:
    """Per-example token counts: `len(example[length_key])`, or the value itself for an integer column.

    A `datasets.Dataset` is read as one Arrow column (no Python loop over rows).
    """
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is optional
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        import pyarrow as pa
        import pyarrow.compute as pc

        if length_key not in dataset.column_names:
            text = [name for name, feature in dataset.features.items() if getattr(feature, "dtype", None) == "string"]
            raise ValueError(f"length_key={length_key!r} is not a column of the dataset; columns: "
                             f"{dataset.column_names}{_tokenize_hint(text)}")
        column = dataset.with_format("arrow")[length_key]
        if pa.types.is_integer(column.type):
            return [int(v) for v in column.to_numpy()]
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type) or pa.types.is_fixed_size_list(column.type):
            return [int(v) for v in pc.list_value_length(column).fill_null(0).to_numpy()]
        raise ValueError(f"column {length_key!r} must hold token lists or integer lengths; got Arrow type {column.type}")
    lengths = []
    for i in range(len(dataset)):
        example = dataset[i]
        if not hasattr(example, "keys") or length_key not in example:
            text = [k for k, v in example.items() if isinstance(v, str)] if hasattr(example, "items") else []
            raise ValueError(f"dataset[{i}] must be a dict with {length_key!r}; got {type(example).__name__}"
                             f"{' with keys ' + str(list(example.keys())) if hasattr(example, 'keys') else ''}"
                             f"{_tokenize_hint(text)}")
        value = example[length_key]
        lengths.append(checked_length(i, value) if _is_integer(value) else len(value))
    return lengths


def _tokenize_hint(text_columns: list[str]) -> str:
    """What to do with a dataset of text where token ids are expected (empty without text columns)."""
    if not text_columns:
        return ""
    column = text_columns[0]
    return (f". The dataset holds text ({', '.join(map(repr, text_columns))}), not token ids: tokenize it first (for a "
            f"datasets.Dataset: dataset.map(lambda batch: tokenizer(batch[{column!r}]), batched=True, "
            f"remove_columns=[{column!r}])), or train with hf_blockdiag_cp.integrations.trl.BlockdiagCPSFTTrainer, "
            "which tokenizes text as TRL does")


def _is_integer(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.ndim == 0
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


class PackedDataLoader(DataLoader):
    """A DataLoader whose batches are packs; `packing_stats` and `set_epoch` reach its `PackedBatchSampler`."""

    @property
    def packing_stats(self) -> PackingStats:
        return self.batch_sampler.stats

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def packed_dataloader(
    dataset,
    max_tokens: int,
    *,
    dp_size: int = 1,
    dp_rank: int = 0,
    cp_size: int = 1,
    cp_rank: int | None = None,
    pad_token_id: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    buffer_size: int = 1024,
    num_workers: int = 0,
    oversize: str = "split",
    drop_last: bool = False,
    length_key: str = "input_ids",
    lengths: Sequence[int] | None = None,
    cp_config=None,
) -> PackedDataLoader:
    """One pack per batch for this rank: `PackedBatchSampler` + `BlockdiagCPCollator`.

    `dataset`: a `datasets.Dataset`, a list of dicts, or any map-style dataset of dicts with
    `input_ids` (and optional `labels`). Lengths are read from `length_key` unless `lengths`
    is given. With `cp_rank` set, batches are already sharded for that CP rank (in the
    worker processes when `num_workers > 0`), laid out by `cp_config`'s layout (a `CPConfig`;
    default: contiguous chunks). Get coordinates from `hf_blockdiag_cp.ParallelDims`.
    Do not pass the result through `accelerator.prepare`: that would re-shard its batches.
    """
    collator = BlockdiagCPCollator(max_tokens, pad_token_id, cp_size, cp_rank, oversize, cp_config)
    if lengths is None:
        lengths = dataset_lengths(dataset, length_key)
    elif len(lengths) != len(dataset):
        raise ValueError(f"lengths has {len(lengths)} entries; expected {len(dataset)} (one per example)")
    sampler = PackedBatchSampler(
        lengths,
        max_tokens,
        buffer_size=buffer_size,
        shuffle=shuffle,
        seed=seed,
        dp_size=dp_size,
        dp_rank=dp_rank,
        drop_last=drop_last,
        oversize=oversize,
    )
    return PackedDataLoader(PackedExamples(dataset), batch_sampler=sampler, collate_fn=collator, num_workers=num_workers)

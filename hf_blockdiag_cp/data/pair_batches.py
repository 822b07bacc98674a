"""Preference pairs in TRL's micro-batches: the stock Trainer's sample order, each micro-batch's pairs in as
few packs as `max_tokens` allows.

TRL 1.16's `DPOTrainer` and `RewardTrainer` take their training batches from the stock Trainer's dataloader
(transformers 5.x `Trainer._get_train_sampler`: a `RandomSampler`; `DataLoader(batch_size=
per_device_train_batch_size, drop_last=dataloader_drop_last)`), which accelerate 1.16 prepares
(`prepare_data_loader`, with the Trainer's `AcceleratorConfig` defaults `use_seedable_sampler=True`,
`split_batches=False`, `even_batches=True`):
- `SeedableRandomSampler` replaces the `RandomSampler`: epoch e is `torch.randperm(n)` from a generator seeded
  with `data_seed + e` (`TrainingArguments.data_seed`, else `torch.random.initial_seed()`, which is
  `TrainingArguments.seed` after the Trainer's own `set_seed`; the Trainer calls `set_epoch(e)` every epoch);
- with several processes, `BatchSamplerShard` deals batch i to process i % num_processes, a round of batches at a time; without
  `drop_last` it completes a short last batch, and then the last round, from the first indices of the epoch
  (the first num_processes batches, repeated while they are fewer than a round); with `drop_last` the short
  batch and the incomplete round are dropped.
Under accelerate's CP the ranks of a CP group share one process index: the processes are the DP replicas.

`stock_batches` reproduces that order with a `torch.Generator` alone. `PairMicroBatchSampler` deals its batches
to this DP replica and packs each batch's pairs by first-fit decreasing (`packing.first_fit_decreasing`). Every
replica of a round runs the same number of packs (I5: DDP's, FSDP2's and the CP group's collectives): each
rank plans every replica's packs from the shared lengths, and a replica with fewer packs than the round's
most gets filler packs of one pair each, which a trainer weighs 0 (`PairBatch.filler`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterator, Sequence

import torch
from torch.utils.data import Sampler

from .loader import PACKS_KEY, PackedDataLoader, check_not_empty
from .packing import PackingStats, checked_length, first_fit_decreasing
from .pairs import PAIRS_KEY, PairBatch, check_pairs_fit


def stock_batches(count: int, batch_size: int, replicas: int, *, seed: int, epoch: int = 0, shuffle: bool = True,
                  drop_last: bool = False) -> list[list[int]]:
    """Every batch of dataset indices of one epoch, in dealing order (batch i goes to replica i % replicas), as
    the stock Trainer's dataloader prepared by accelerate deals them (module docstring); `shuffle=False`: in
    dataset order (`train_sampling_strategy="sequential"`). With several replicas every batch holds `batch_size`
    indices and their number is a multiple of `replicas` (none when `drop_last` leaves no whole round); with one,
    accelerate leaves the dataloader as it is, and the last batch may be short."""
    if shuffle:
        order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(count))
    batches = [order[i : i + batch_size] for i in range(0, count, batch_size)]
    if drop_last:
        whole = [b for b in batches if len(b) == batch_size]
        return whole[: len(whole) - len(whole) % replicas]
    if replicas == 1 or not batches or (len(batches) % replicas == 0 and len(batches[-1]) == batch_size):
        return batches  # one process: accelerate deals nothing (a short last batch stays short)
    start = [i for b in batches[:replicas] for i in b]
    while len(start) < replicas * batch_size:
        start += start
    taken = batch_size - len(batches[-1])
    batches[-1] = batches[-1] + start[:taken]
    while len(batches) % replicas:
        batches.append(start[taken : taken + batch_size])
        taken += batch_size
    return batches


@dataclass(frozen=True)
class PairSlot:
    """Pair `index` of the dataset in pack `pack` of a micro-batch; `filler`: a pack that only evens a round."""

    pack: int
    index: int
    filler: bool = False


class PairMicroBatchSampler(Sampler[list[PairSlot]]):
    """Yields one micro-batch of `batch_size` pairs at a time for DP replica `dp_rank` of `dp_size`, in the stock
    Trainer's order (`stock_batches`), as the `PairSlot`s of its packs: its pairs packed into packs of at most
    `max_tokens` tokens (a pair is `lengths[i]` tokens, both sequences), then filler packs up to the round's most.

    Every rank plans the whole epoch from the same lengths, seed and epoch, so CP peers yield the same packs and
    no collective is needed. `len()` is the micro-batches of this replica per epoch (the Trainer's steps).
    """

    def __init__(self, lengths: Sequence[int], batch_size: int, max_tokens: int, *, dp_size: int = 1, dp_rank: int = 0,
                 seed: int = 0, shuffle: bool = True, drop_last: bool = False, limits: str = "no truncation"):
        for name, value in (("batch_size", batch_size), ("max_tokens", max_tokens), ("dp_size", dp_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer; got {value!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be an integer in [0, dp_size={dp_size}); got {dp_rank!r}")
        self.lengths = [checked_length(i, n) for i, n in enumerate(lengths)]
        check_not_empty(self.lengths)
        check_pairs_fit(self.lengths, max_tokens, limits)
        self.batch_size, self.max_tokens = batch_size, max_tokens
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.seed, self.shuffle, self.drop_last = seed, shuffle, drop_last
        self.epoch = 0
        self._planned: tuple[int, list[list[list[int]]], list[int]] | None = None

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order to use (the Trainer calls it every epoch, with the same value on every rank)."""
        self.epoch = epoch

    def epoch_batches(self) -> list[list[int]]:
        """Every micro-batch of the epoch over all replicas, in dealing order (`stock_batches`)."""
        return stock_batches(len(self.lengths), self.batch_size, self.dp_size, seed=self.seed, epoch=self.epoch,
                             shuffle=self.shuffle, drop_last=self.drop_last)

    def _packs(self, batch: list[int]) -> list[list[int]]:
        """The batch's pairs in as few packs as first-fit decreasing finds, each pack's pairs in batch order."""
        bins = first_fit_decreasing([self.lengths[i] for i in batch], self.max_tokens)
        return [[batch[j] for j in sorted(b)] for b in bins]

    def _plan(self) -> tuple[list[list[list[int]]], list[int]]:
        """(this replica's micro-batches as packs of indices, the round's pack count of each), cached per epoch."""
        if self._planned is not None and self._planned[0] == self.epoch:
            return self._planned[1], self._planned[2]
        batches = self.epoch_batches()
        packs = [self._packs(batch) for batch in batches]
        rounds = [max(len(p) for p in packs[r : r + self.dp_size]) for r in range(0, len(packs), self.dp_size)]
        mine = packs[self.dp_rank :: self.dp_size]
        self._planned = (self.epoch, mine, rounds)
        return mine, rounds

    def micro_batches(self) -> list[list[PairSlot]]:
        """This replica's micro-batches of the epoch as `PairSlot`s: its packs, then filler packs (one pair each:
        the micro-batch's shortest) up to the round's pack count."""
        mine, rounds = self._plan()
        out = []
        for packs, count in zip(mine, rounds):
            slots = [PairSlot(p, i) for p, pack in enumerate(packs) for i in pack]
            shortest = min((i for pack in packs for i in pack), key=lambda i: (self.lengths[i], i))
            slots += [PairSlot(p, shortest, filler=True) for p in range(len(packs), count)]
            out.append(slots)
        return out

    @property
    def stats(self) -> PackingStats:
        """Packing of this replica's packs in the current epoch (filler packs count as packs without real tokens)."""
        batches = self.micro_batches()
        packs = sum(len({s.pack for s in slots}) for slots in batches)
        real = sum(self.lengths[s.index] for slots in batches for s in slots if not s.filler)
        return PackingStats(packs, real, packs * self.max_tokens)

    def __iter__(self) -> Iterator[list[PairSlot]]:
        yield from self.micro_batches()

    def __len__(self) -> int:
        return len(self._plan()[0])


class _SlotRows(torch.utils.data.Dataset):
    """Dataset rows looked up by `PairSlot`, returned with it (the collator groups them into packs)."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, slot: PairSlot) -> tuple[PairSlot, dict]:
        return slot, self.dataset[slot.index]


class MicroBatchCollator:
    """One micro-batch's packs: each through `pack_collator` (a `PairPackCollator`: `[(index, example)]` in, this
    CP rank's shard with its `PairBatch` out), filler packs marked `PairBatch.filler`, every pack's
    `PairBatch.micro_batch` the totals of the micro-batch's real packs. One pack comes back as
    that pack; several as `{PACKS_KEY: [packs], "input_ids": [1, Σ L]}` (the packs' local token ids side by side,
    which the Trainer only counts)."""

    def __init__(self, pack_collator: Callable[[list[tuple[int, dict]]], dict]):
        self.pack_collator = pack_collator

    def __call__(self, items: list[tuple[PairSlot, dict]]) -> dict:
        groups: dict[int, list[tuple[PairSlot, dict]]] = {}
        for slot, example in items:
            groups.setdefault(slot.pack, []).append((slot, example))
        packs = []
        for pack in sorted(groups):
            local = self.pack_collator([(slot.index, example) for slot, example in groups[pack]])
            if groups[pack][0][0].filler:
                pairs: PairBatch = local[PAIRS_KEY]
                local[PAIRS_KEY] = replace(pairs, filler=True)
            packs.append(local)
        real = [p[PAIRS_KEY].micro_batch for p in packs if not p[PAIRS_KEY].filler]
        totals = (sum(n for n, _ in real), sum(t for _, t in real))
        for local in packs:
            local[PAIRS_KEY] = replace(local[PAIRS_KEY], micro_batch=totals)
        if len(packs) == 1:
            return packs[0]
        return {PACKS_KEY: packs, "input_ids": torch.cat([p["input_ids"] for p in packs], dim=1)}


def pair_micro_batch_dataloader(dataset, pack_collator, lengths: Sequence[int], batch_size: int, max_tokens: int, *,
                                dp_size: int = 1, dp_rank: int = 0, seed: int = 0, shuffle: bool = True,
                                drop_last: bool = False, num_workers: int = 0,
                                limits: str = "no truncation") -> PackedDataLoader:
    """One micro-batch of `batch_size` pairs per item for this rank, in the stock Trainer's order, in as few packs
    as `max_tokens` needs (`PairMicroBatchSampler`, `MicroBatchCollator`)."""
    sampler = PairMicroBatchSampler(lengths, batch_size, max_tokens, dp_size=dp_size, dp_rank=dp_rank, seed=seed,
                                    shuffle=shuffle, drop_last=drop_last, limits=limits)
    return PackedDataLoader(_SlotRows(dataset), batch_sampler=sampler, collate_fn=MicroBatchCollator(pack_collator),
                            num_workers=num_workers)

"""The preference trainers' micro-batches (`data.pair_batches`): the stock Trainer's order as accelerate's own
dataloader deals it (the reference: `accelerate.data_loader.prepare_data_loader` over a stock `DataLoader`, one
per process), and each micro-batch's pairs in packs that fit, the same number of packs per round on every
replica, fillers marked."""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

from hf_blockdiag_cp.data.pair_batches import MicroBatchCollator, PairMicroBatchSampler, stock_batches
from hf_blockdiag_cp.data.loader import PACKS_KEY
from hf_blockdiag_cp.data.pairs import PAIRS_KEY, PairPackCollator, WholePairs


def accelerate_batches(count: int, batch_size: int, processes: int, seed: int, epoch: int, shuffle: bool,
                       drop_last: bool) -> list[list[list[int]]]:
    """Each process's batches of dataset indices, as the stock Trainer's train dataloader prepared by accelerate
    yields them (`use_seedable_sampler=True` with `data_seed`, the Trainer's defaults otherwise)."""
    from accelerate.data_loader import prepare_data_loader

    data = list(range(count))
    out = []
    for process in range(processes):
        sampler = RandomSampler(data) if shuffle else SequentialSampler(data)
        loader = prepare_data_loader(DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=drop_last),
                                     num_processes=processes, process_index=process, put_on_device=False,
                                     use_seedable_sampler=True, data_seed=seed)
        loader.set_epoch(epoch)
        out.append([batch.tolist() for batch in loader])
    return out


CASES = [(count, size, processes, drop_last, shuffle, epoch)
         for count in (1, 7, 12, 13) for size in (1, 2, 5) for processes in (1, 2, 3, 4)
         for drop_last in (False, True) for shuffle, epoch in ((True, 0), (True, 1), (False, 0))]


def test_stock_batches_are_accelerates():
    """Every process's batches equal accelerate's, short datasets (a round filled from the start, repeated),
    short last batches, drop_last, epochs and sequential order included."""
    for count, size, processes, drop_last, shuffle, epoch in CASES:
        mine = stock_batches(count, size, processes, seed=7, epoch=epoch, shuffle=shuffle, drop_last=drop_last)
        want = accelerate_batches(count, size, processes, 7, epoch, shuffle, drop_last)
        assert [mine[p::processes] for p in range(processes)] == want, (count, size, processes, drop_last, shuffle, epoch)


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_micro_batches_pack_each_stock_batch(dp_size):
    """Each replica's micro-batch j is stock batch j * dp + replica, its pairs once each in packs of at most
    max_tokens (as few as first-fit decreasing gives), then fillers of one pair up to the round's most packs."""
    rng = random.Random(dp_size)
    lengths = [rng.choice([12, 20, 30, 90, 150]) for _ in range(29)]
    max_tokens, size = 160, 4
    samplers = [PairMicroBatchSampler(lengths, size, max_tokens, dp_size=dp_size, dp_rank=r, seed=3) for r in range(dp_size)]
    batches = stock_batches(len(lengths), size, dp_size, seed=3)
    plans = [s.micro_batches() for s in samplers]
    assert all(len(s) == len(batches) // dp_size for s in samplers)
    fillers = 0
    for j in range(len(plans[0])):
        counts = [len({slot.pack for slot in plan[j]}) for plan in plans]
        assert len(set(counts)) == 1, f"round {j}: packs per replica {counts}"
        for r, plan in enumerate(plans):
            real = [slot for slot in plan[j] if not slot.filler]
            assert sorted(slot.index for slot in real) == sorted(batches[j * dp_size + r])
            packs = {}
            for slot in plan[j]:
                packs.setdefault(slot.pack, []).append(slot)
            assert all(sum(lengths[s.index] for s in pack) <= max_tokens for pack in packs.values())
            real_packs = len({slot.pack for slot in real})
            total = sum(lengths[s.index] for s in real)
            assert real_packs >= -(-total // max_tokens)
            extra = [pack for pack in packs.values() if pack[0].filler]
            assert all(len(pack) == 1 and all(s.filler for s in pack) for pack in extra)
            fillers += len(extra)
    if dp_size > 1:
        assert fillers, "no round needed a filler pack: the case tests nothing of them"


def test_micro_batch_collator_marks_fillers():
    """Several packs come back side by side under PACKS_KEY, the filler's `PairBatch.filler` set; one pack as is."""
    rows = [{"chosen_ids": [1] * n, "rejected_ids": [2] * n} for n in (30, 30, 1)]
    collate = MicroBatchCollator(PairPackCollator(WholePairs(), 64, 0, 1, 0, labels=False))
    sampler = PairMicroBatchSampler([60, 60, 2], 2, 64, dp_size=2, dp_rank=0, seed=0, shuffle=False)
    other = PairMicroBatchSampler([60, 60, 2], 2, 64, dp_size=2, dp_rank=1, seed=0, shuffle=False)
    (mine,), (theirs,) = sampler.micro_batches(), other.micro_batches()  # [0, 1] in two packs; [2, 0] in one + filler
    batch = collate([(slot, rows[slot.index]) for slot in theirs])
    packs = batch[PACKS_KEY]
    assert [p[PAIRS_KEY].filler for p in packs] == [False, True]
    assert batch["input_ids"].shape == (1, 2 * 64)
    assert torch.equal(batch["input_ids"], torch.cat([p["input_ids"] for p in packs], dim=1))
    assert [p[PAIRS_KEY].indices.tolist() for p in packs] == [[2, 0], [2]]
    assert len({slot.pack for slot in mine}) == 2
    small = [{"chosen_ids": [1] * 5, "rejected_ids": [2] * 5}] * 2
    one = PairMicroBatchSampler([10, 10], 2, 64, seed=0).micro_batches()[0]
    single = collate([(slot, small[slot.index]) for slot in one])
    assert PACKS_KEY not in single and not single[PAIRS_KEY].filler and single[PAIRS_KEY].pairs == 2


def test_sampler_errors_name_the_field():
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        PairMicroBatchSampler([10], 0, 64)
    with pytest.raises(ValueError, match="pair 1 has 80 tokens .*more than max_tokens=64"):
        PairMicroBatchSampler([10, 80], 2, 64)


def test_every_pack_carries_its_micro_batch_totals():
    """Each pack of a micro-batch (filler included) carries the pairs and chosen targets of the micro-batch's real
    packs (what TRL's `sft` mean divides by); a lone pack its own."""
    from hf_blockdiag_cp.data.pairs import PromptCompletionPairs

    rows = [{"prompt_ids": [5, 6], "chosen_ids": [1] * c, "rejected_ids": [2] * 3} for c in (25, 20, 1)]
    collate = MicroBatchCollator(PairPackCollator(PromptCompletionPairs(), 48, 0, 1, 0))
    lengths = [2 * 2 + c + 3 for c in (25, 20, 1)]
    theirs = PairMicroBatchSampler(lengths, 2, 48, dp_size=2, dp_rank=1, seed=0, shuffle=False).micro_batches()[0]
    mine = PairMicroBatchSampler(lengths, 2, 48, dp_size=2, dp_rank=0, seed=0, shuffle=False).micro_batches()[0]
    for slots in (mine, theirs):  # [0, 1]: two packs; [2, 0]: one pack and a filler
        batch = collate([(slot, rows[slot.index]) for slot in slots])
        real = sorted({s.index for s in slots if not s.filler})
        want = (len(real), sum(len(rows[i]["chosen_ids"]) for i in real))  # every completion token has a target
        assert [p[PAIRS_KEY].micro_batch for p in batch[PACKS_KEY]] == [want, want]
    lone = MicroBatchCollator(PairPackCollator(PromptCompletionPairs(), 64, 0, 1, 0))
    single = lone([(slot, rows[slot.index]) for slot in PairMicroBatchSampler(lengths[:2], 2, 64, seed=0).micro_batches()[0]])
    assert PACKS_KEY not in single and single[PAIRS_KEY].micro_batch == (2, 45)

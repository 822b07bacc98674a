"""The TRL integration's parts in one process: the SFTConfig checks (raised at construction,
before any model or data work), the collator that turns one of TRL's packed rows into a padded,
sharded block-diagonal CP pack (compared with a pack built by hand), the sampler that deals
TRL's rows to the DP replicas, and TRL's token metrics of one rank (the CP group's sum: the
multiprocess tests)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

import torch  # noqa: E402
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling  # noqa: E402

from hf_blockdiag_cp.integrations.trl import (  # noqa: E402
    BlockdiagCPSFTTrainer,
    PrepackedBatchSampler,
    SFTPackCollator,
    check_sft_config,
    prepacked_dataloader,
)
from hf_blockdiag_cp.integrations.trl.metrics import TokenMetrics  # noqa: E402
from hf_blockdiag_cp.step import SHARD_KEY, shard_batch  # noqa: E402
from helpers.sft import char_tokenizer, sft_config, sft_dataset  # noqa: E402
from helpers.trainer import tiny_model  # noqa: E402

PAD = 0
ROW = {"input_ids": [5, 6, 7, 8, 9, 10, 11], "labels": [-100, -100, 7, 8, 9, -100, 11], "seq_lengths": [4, 3]}


def padding_free_collator(pad_to_multiple_of=None):
    return DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, pad_to_multiple_of=pad_to_multiple_of)


# --------------------------------------------------------------------------- configuration checks


@pytest.mark.parametrize(
    "overrides,cp_size,message",
    [
        ({"packing": False}, 2, "SFTConfig.packing is False; expected True"),
        ({"max_length": 250}, 2, "SFTConfig.max_length is 250; expected a positive multiple of 2*cp_size = 4"),
        ({"max_length": 256}, 3, "SFTConfig.max_length is 256; expected a positive multiple of 2*cp_size = 6"),
        ({"max_length": None}, 1, "SFTConfig.max_length is None; expected a positive multiple of 2*cp_size = 2"),
        ({"loss_type": "dft"}, 2, "SFTConfig.loss_type is 'dft'; expected 'nll'"),
        ({"use_liger_kernel": True}, 2, "SFTConfig.use_liger_kernel is True; expected False"),
        ({}, 0, "cp_size must be a positive integer; got 0"),
    ],
)
def test_bad_sft_config_raises_naming_the_field(tmp_path, overrides, cp_size, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*").replace("(", r"\(").replace(")", r"\)")):
        check_sft_config(sft_config(str(tmp_path), **overrides), cp_size)


def test_trainer_refuses_a_bad_config_before_touching_model_or_data(tmp_path):
    """The config checks run first in the constructor (no dataset preparation, no process group), the
    processes against cp_size before the pack size: one process cannot hold a CP group of 2."""
    with pytest.raises(ValueError, match="SFTConfig.max_length is 251"):
        BlockdiagCPSFTTrainer(model=tiny_model(), args=sft_config(str(tmp_path), max_length=251),
                              train_dataset=sft_dataset("text"), processing_class=char_tokenizer(), cp_size=1)
    with pytest.raises(ValueError, match=r"the launcher started fewer processes \(1\) than the CP size"):
        BlockdiagCPSFTTrainer(model=tiny_model(), args=sft_config(str(tmp_path), max_length=250),
                              train_dataset=sft_dataset("text"), processing_class=char_tokenizer(), cp_size=2)
    with pytest.raises(ValueError, match="args must be a trl.SFTConfig"):
        check_sft_config(None, 1)
    with pytest.raises(ValueError, match="data_collator must not be given to BlockdiagCPSFTTrainer"):
        BlockdiagCPSFTTrainer(model=tiny_model(), args=sft_config(str(tmp_path)), data_collator=padding_free_collator(),
                              train_dataset=sft_dataset("text"), processing_class=char_tokenizer())


# --------------------------------------------------------------------------- the collator


def hand_built_pack(max_tokens: int) -> dict[str, torch.Tensor]:
    """ROW as a block-diagonal CP pack: documents [5..8] and [9..11], padded to max_tokens."""
    pad = max_tokens - 7
    labels = [-100, -100, 7, 8, -100, -100, 11] + [-100] * pad  # TRL masks each document's first label
    return {
        "input_ids": torch.tensor([[5, 6, 7, 8, 9, 10, 11] + [PAD] * pad]),
        "labels": torch.tensor([labels]),
        "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2] + list(range(pad))]),
        "document_ids": torch.tensor([[1, 1, 1, 1, 2, 2, 2] + [0] * pad]),
    }


@pytest.mark.parametrize("pad_to_multiple_of", [None, 8])
def test_collator_keeps_trls_labels_and_documents(pad_to_multiple_of):
    """TRL's own padding to a multiple (one-token "documents" of position 0) gives way to the pack's."""
    full = SFTPackCollator(padding_free_collator(pad_to_multiple_of), 12, PAD)([ROW])
    for key, want in hand_built_pack(12).items():
        assert torch.equal(full[key], want), (key, full[key], want)


@pytest.mark.parametrize("cp_rank", [0, 1])
def test_collator_shards_like_the_shard_step(cp_rank):
    local = SFTPackCollator(padding_free_collator(), 12, PAD, cp_size=2, cp_rank=cp_rank)([ROW])
    want = shard_batch(hand_built_pack(12), 2, cp_rank, padding_token_id=PAD)
    assert local[SHARD_KEY].fingerprint == want[SHARD_KEY].fingerprint
    for key in ("input_ids", "labels", "shift_labels", "position_ids", "document_ids"):
        assert torch.equal(local[key], want[key]), key


def test_a_row_without_seq_lengths_is_one_document():
    """TRL's `wrapped` strategy (no padding-free, an attention mask): the row is one causal sequence."""
    row = {"input_ids": ROW["input_ids"], "labels": ROW["input_ids"]}
    full = SFTPackCollator(DataCollatorForLanguageModeling(pad_token_id=PAD), 8, PAD)([row])
    assert full["document_ids"].tolist() == [[1] * 7 + [0]]


def test_a_row_longer_than_the_pack_is_refused_by_row():
    with pytest.raises(ValueError, match=r"row 1 of the prepared dataset has 7 tokens, more than SFTConfig.max_length=6"):
        prepacked_dataloader([{"input_ids": [1, 2]}, ROW], padding_free_collator(), 6)


# --------------------------------------------------------------------------- the sampler


def test_sampler_deals_every_row_once_per_epoch_to_the_replicas():
    """Row i of the epoch's shuffled order goes to replica i % 2; the last round is filled with the epoch's first row."""
    lengths = [5, 3, 8, 2, 7]
    orders = []
    for epoch in (0, 1):
        whole = PrepackedBatchSampler(lengths, 8, seed=3)
        whole.set_epoch(epoch)
        order = [pack[0] for pack in whole]
        assert sorted(order) == list(range(5))
        orders.append(order)
        for dp_rank, want in ((0, order[0::2]), (1, order[1::2] + order[:1])):
            replica = PrepackedBatchSampler(lengths, 8, seed=3, dp_size=2, dp_rank=dp_rank)
            replica.set_epoch(epoch)
            assert [pack for pack in replica] == [[i] for i in want]
            assert replica.replica_repeats() == [False, False, dp_rank == 1]
    assert orders[0] != orders[1], "the epochs should be shuffled differently"
    assert list(PrepackedBatchSampler(lengths, 8, shuffle=False)) == [[0], [1], [2], [3], [4]]


# --------------------------------------------------------------------------- token metrics, one rank


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(logits.double(), -1)
    return -(p * p.log()).sum(-1)


def test_token_metrics_average_each_micro_batch_as_trl_does():
    """One row of sums per micro-batch; at `pop`, per micro-batch: accuracy = targets whose label is
    the argmax / targets, entropy = mean next-token entropy over the targets (TRL's definitions,
    computed here by hand), then the mean over the micro-batches, as TRL's `log` averages them. A fill
    pack or a micro-batch without targets counts 0.0 (as TRL logs it); one without logits (fused
    cross-entropy) is left out; `pop` empties the mode."""
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 3.0], [1.0, 1.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 1, -100, 2, -100]])  # targets at rows 0, 1, 3; only row 0's label is the argmax
    second = torch.tensor([[[0.0, 4.0, 1.0], [3.0, 0.0, 0.0]]])
    second_labels = torch.tensor([[1, -100]])  # one target, its label the argmax
    metrics = TokenMetrics()
    metrics.add("train", logits, labels)
    metrics.add("train", second, second_labels)
    metrics.add("train", None, second_labels)  # no logits: no accuracy or entropy for it
    got = metrics.pop("train", world_size=1)
    want_entropy = (float(_entropy(logits[0, [0, 1, 3]]).mean()) + float(_entropy(second[0, :1]).mean())) / 2
    assert abs(got["mean_token_accuracy"] - (1 / 3 + 1) / 2) <= 1e-12, got
    assert abs(got["entropy"] - want_entropy) <= 1e-6, (got, want_entropy)
    assert metrics.pop("train", 1) == {} and metrics.rows["train"] == []
    metrics.add("eval", logits, labels, fill=True)
    metrics.add("eval", logits, torch.full_like(labels, -100))
    assert metrics.pop("eval", 1) == {"mean_token_accuracy": 0.0, "entropy": 0.0}
    metrics.add("train", None, labels)
    assert metrics.pop("train", 1) == {}

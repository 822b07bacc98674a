"""Bad input a new user meets, in one process: each case ends in one error
line that names the real field and what to do, before any work is spent; nothing trains silently on
nothing. The every-rank versions of the pack cases (ids, document_ids against position_ids) are in
multiprocess/test_bad_packs.py; the example scripts' cases in e2e/test_example_bad_input.py."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import BlockdiagCPCollator, PackedBatchSampler, packed_dataloader
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.trainer import tiny_model, trainer_settings

IDS = torch.arange(1, 13)[None]
POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])


def tiny_gpt2(attn_pdrop: float):
    """GPT-2 (whose attention dropout is `attn_pdrop`) with an unused `attention_dropout=0.0` on its config."""
    torch.manual_seed(0)
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=64, bos_token_id=0, eos_token_id=0,
                        attn_pdrop=attn_pdrop, attention_dropout=0.0)
    model = GPT2LMHeadModel(config)
    model.set_attn_implementation(bdcp.ATTN_IMPLEMENTATION)
    return model.train()


def gpt2_step_loss(model) -> torch.Tensor:
    batch = {"input_ids": IDS, "labels": IDS.clone(), "position_ids": POSITIONS}
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with train_ctx():
        loss = model(**local).loss
        loss.backward()
    return loss


def test_gpt2_attention_dropout_error_names_attn_pdrop():
    """The field GPT-2 has is `attn_pdrop`: the error names it (and its value), not `attention_dropout`,
    which is 0 here and changes nothing; with `attn_pdrop=0` the same step trains."""
    with pytest.raises(NotImplementedError) as raised:
        gpt2_step_loss(tiny_gpt2(0.1))
    message = str(raised.value)
    assert "GPT2Config.attn_pdrop is 0.1" in message and "attention_dropout" not in message, message
    assert "\n" not in message
    assert torch.isfinite(gpt2_step_loss(tiny_gpt2(0.0)))


def test_a_token_id_past_the_embeddings_is_named_before_the_forward():
    model = tiny_model()  # vocabulary of helpers.reference.tiny_config
    rows = model.get_input_embeddings().num_embeddings
    batch = {"input_ids": IDS + rows - 5, "labels": IDS.clone(), "position_ids": POSITIONS}
    with pytest.raises(ValueError, match=rf"batch\['input_ids'\] holds token id {rows + 7}, but the model's input "
                                         rf"embeddings have {rows} rows"):
        bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    pad = {"input_ids": torch.arange(1, 12)[None], "position_ids": torch.arange(11)[None]}  # padded to 12 by the step
    with pytest.raises(ValueError, match=rf"holds token id {rows}, but"):
        bdcp.make_cp_blockdiag_batch_and_ctx(None, None, pad, padding_token_id=rows, model=model)
    bdcp.make_cp_blockdiag_batch_and_ctx(None, None, {**batch, "input_ids": IDS + rows - 13}, model=model)  # the last row


def test_a_collated_document_longer_than_the_pack_raises_once_without_a_split_warning(caplog):
    """One call collates one pack, and the pieces of a split document never fit one: the collator says
    that in its error, and no longer first warns that the document "is split into pieces"."""
    collator = BlockdiagCPCollator(max_tokens=16)
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"), pytest.raises(ValueError) as raised:
        collator([{"input_ids": list(range(1, 21))}])
    message = str(raised.value)
    assert message.startswith("examples[0] has 20 tokens, more than max_tokens=16: a call collates ONE pack"), message
    assert "packed_dataloader" in message
    assert not [r for r in caplog.records if "split" in r.getMessage()], caplog.text


@pytest.mark.parametrize("lengths, expected", [
    ([], "the dataset holds no example: nothing to pack or train on. If a filter emptied it"),
    ([0, 0, 0], r"every one of the dataset's 3 examples has 0 tokens \(empty input_ids\)"),
])
def test_a_dataset_without_tokens_is_refused_by_the_sampler(lengths, expected):
    with pytest.raises(ValueError, match=expected):
        PackedBatchSampler(lengths, 16)
    with pytest.raises(ValueError, match=expected):
        packed_dataloader([{"input_ids": [0] * n} for n in lengths], 16)


def test_an_empty_train_dataset_is_refused_at_construction(tmp_path):
    """Before: the Trainer ran, said only "There seems not to be a single sample in your epoch_iterator",
    and exited 0 having trained nothing."""
    with pytest.raises(ValueError, match=r"train_dataset holds no example \(len 0\)"):
        BlockdiagCPTrainer(model=tiny_model(), args=TrainingArguments(**trainer_settings(str(tmp_path), 1, 1)),
                           train_dataset=[], cp_size=1, max_tokens=16)


def test_the_trainer_does_not_ask_ddp_to_find_unused_parameters(tmp_path):
    """Transformers' default (True without activation checkpointing) makes DDP warn at every run, dp = 1
    under CP included, that it found no unused parameter; a text-only model uses them all. A value the
    user sets is kept."""
    data = [{"input_ids": list(range(1, 9))}]
    trainer = BlockdiagCPTrainer(model=tiny_model(), args=TrainingArguments(**trainer_settings(str(tmp_path), 1, 1)),
                                 train_dataset=data, cp_size=1, max_tokens=16)
    assert trainer.args.ddp_find_unused_parameters is False
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    kept = TrainingArguments(**trainer_settings(str(tmp_path), 1, 1), ddp_find_unused_parameters=True)
    trainer = BlockdiagCPTrainer(model=tiny_model(), args=kept, train_dataset=data, cp_size=1, max_tokens=16)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is True


def test_a_mixture_of_experts_keeps_ddps_unused_parameter_search(tmp_path):
    """An expert no token of a step chose has no gradient: a MoE model keeps Transformers' default."""
    from helpers.model_zoo import build_pair

    _, moe = build_pair("gpt_oss")  # num_local_experts routed per token
    args = TrainingArguments(**trainer_settings(str(tmp_path), 1, 1))
    BlockdiagCPTrainer(model=moe, args=args, train_dataset=[{"input_ids": list(range(1, 9))}], cp_size=1, max_tokens=16)
    assert args.ddp_find_unused_parameters is None

"""The Trainers' setup errors come in the order a user fixes them, on every rank: the processes and
the CP size before the pack size (cp_size=3 on 2 processes with a pack of 256 tokens, not a multiple
of 6, names the launch, not the pack), and a dataset of text given to `BlockdiagCPTrainer` says to
tokenize it first or to use the TRL trainer, which tokenizes text as TRL does."""

from __future__ import annotations

import datasets
import pytest
from transformers import TrainingArguments

from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.sft import char_tokenizer, sft_config, texts
from helpers.trainer import accelerate_env, quiet, tiny_model, trainer_settings

WORLD_SIZE = 2
FEWER = "world size 2 is not divisible by cp_size=3: the launcher started fewer processes (2) than the CP size"


def setup_error_case(rank, world_size, group, what):
    """The error one mistaken setup raises on this rank, or None."""
    with accelerate_env(rank, world_size) as out:
        try:
            if what == "trainer cp_size":
                BlockdiagCPTrainer(model=tiny_model(), args=TrainingArguments(**trainer_settings(out, 1, 1)),
                                   train_dataset=[{"input_ids": [5, 6, 7]}], cp_size=3, max_tokens=256)
            elif what == "trl cp_size":
                from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer

                BlockdiagCPSFTTrainer(model=tiny_model(), args=sft_config(out, max_length=256),
                                      train_dataset=datasets.Dataset.from_dict({"text": texts()}),
                                      processing_class=char_tokenizer(), cp_size=3)
            elif what == "text dataset":
                trainer = BlockdiagCPTrainer(model=tiny_model(), args=TrainingArguments(**trainer_settings(out, 1, 1)),
                                             train_dataset=datasets.Dataset.from_dict({"text": texts()}),
                                             cp_size=2, max_tokens=256)
                quiet(trainer).train()
        except ValueError as exc:
            return str(exc)
    return None


@pytest.mark.parametrize("what", ["trainer cp_size", "trl cp_size"])
def test_world_and_cp_size_come_before_the_pack_size(gloo, what):
    if what.startswith("trl"):
        pytest.importorskip("trl")
    for rank, message in enumerate(gloo(WORLD_SIZE).run(setup_error_case, what=what)):
        assert message is not None and message.startswith(FEWER), f"rank {rank}: {message!r}"
        assert "torchrun --standalone --nproc-per-node 3" in message, message


def test_text_dataset_in_the_trainer_says_to_tokenize_first(gloo):
    for rank, message in enumerate(gloo(WORLD_SIZE).run(setup_error_case, what="text dataset")):
        assert message is not None and "is not a column of the dataset; columns: ['text']" in message, message
        assert "holds text ('text'), not token ids: tokenize it first" in message, message
        assert "BlockdiagCPSFTTrainer, which tokenizes text as TRL does" in message, message

"""Bad input to the preference trainers raises one ValueError naming the field and what was expected,
at construction, before any step: a pair longer than the pack, an empty completion, a prompt-only
dataset, an unknown loss type, a reference model of another architecture or vocabulary, a `batching`
or batch setting that cannot give TRL's micro-batches."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    char_tokenizer, dpo_config, policy_model, preference_dataset, preference_rows, reference_model, reward_classifier,
    reward_config,
)
from helpers.trainer import accelerate_env  # noqa: E402


def _dpo(rows, ref=None, policy=None, **options):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    with accelerate_env(0, 1) as out:
        policy = policy_model("llama", "blockdiag_cp") if policy is None else policy
        max_tokens, batching = options.pop("max_tokens", 1024), options.pop("batching", "pairs")
        return BlockdiagCPDPOTrainer(model=policy, ref_model=reference_model(policy) if ref is None else ref,
                                     args=dpo_config(out, 1, **options), train_dataset=preference_dataset(rows),
                                     processing_class=char_tokenizer(), max_tokens=max_tokens, batching=batching)


def _reward(rows, **options):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPRewardTrainer

    with accelerate_env(0, 1) as out:
        max_tokens, batching = options.pop("max_tokens", 1024), options.pop("batching", "pairs")
        return BlockdiagCPRewardTrainer(model=reward_classifier("llama", "blockdiag_cp"), args=reward_config(out, 1, **options),
                                        train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                        max_tokens=max_tokens, batching=batching)


def test_pair_longer_than_the_pack():
    rows = preference_rows(count=3, long_chars=100)
    with pytest.raises(ValueError, match=r"train dataset: pair 0 has \d+ tokens \(.*DPOConfig.max_length=1024\), more than max_tokens=64"):
        _dpo(rows, max_tokens=64)
    with pytest.raises(ValueError, match=r"train dataset: pair 0 has \d+ tokens .*max_tokens=64"):
        _reward(rows, max_tokens=64)


@pytest.mark.parametrize("trainer", [_dpo, _reward], ids=["dpo", "reward"])
def test_batching_settings_are_named(trainer):
    """`batching` itself, per_device_train_batch_size under "tokens", and under "pairs" the stock Trainer's
    settings that would give TRL's step other pairs; too few pairs for one round with dataloader_drop_last."""
    config = "DPOConfig" if trainer is _dpo else "RewardConfig"
    rows = preference_rows(count=2)
    with pytest.raises(ValueError, match=r"batching is 'pair'; expected 'pairs' \(.*\) or 'tokens'"):
        trainer(rows, batching="pair")
    with pytest.raises(ValueError, match=rf"{config}.per_device_train_batch_size is 2; expected 1: .*batching='pairs'"):
        trainer(rows, batching="tokens", per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=rf"{config}.train_sampling_strategy is 'group_by_length'; expected 'random' or "):
        trainer(rows, train_sampling_strategy="group_by_length")
    with pytest.raises(ValueError, match=rf"{config}.accelerator_config has split_batches=True, even_batches=True; "):
        trainer(rows, accelerator_config={"split_batches": True})
    few = trainer(rows, per_device_train_batch_size=3, dataloader_drop_last=True)
    with pytest.raises(ValueError, match=rf"train_dataset's 2 pairs fill no round of {config}.per_device_train_batch_"
                                         r"size=3 pairs on each of 1 DP replicas, and dataloader_drop_last=True"):
        few.get_train_dataloader()


@pytest.mark.parametrize("trainer", [_dpo, _reward], ids=["dpo", "reward"])
def test_default_pack_holds_a_micro_batch(trainer):
    """Without max_tokens: 2 * max_length per pair of a micro-batch with batching="pairs", one pair's with "tokens"."""
    rows = preference_rows(count=2)
    assert trainer(rows, max_tokens=None, max_length=100, per_device_train_batch_size=3).packing.max_tokens == 600
    assert trainer(rows, max_tokens=None, max_length=100, batching="tokens").packing.max_tokens == 200


def test_empty_completion_is_named():
    rows = [{"prompt_ids": [3, 4, 5], "chosen_ids": [6, 7], "rejected_ids": [8]},
            {"prompt_ids": [3, 4], "chosen_ids": [], "rejected_ids": [9, 10]}]
    with pytest.raises(ValueError, match=r"example 1 has an empty 'chosen' completion \('chosen_ids' holds no token\)"):
        _dpo(rows)


def test_truncation_that_leaves_no_completion_is_named():
    rows = [{"prompt_ids": [3] * 20, "chosen_ids": [6, 7], "rejected_ids": [8]}]
    with pytest.raises(ValueError, match=r"example 0: its prompt has 20 tokens, so truncation to max_length=16"):
        _dpo(rows, max_length=16)


@pytest.mark.parametrize("trainer", [_dpo, _reward], ids=["dpo", "reward"])
def test_prompt_only_dataset(trainer):
    with pytest.raises(ValueError, match=r"columns \['prompt'\]; expected preference pairs.*prompt-only dataset is for GRPO"):
        trainer([{"prompt": "the cat "}, {"prompt": "a mat "}])


def test_unknown_loss_type():
    with pytest.raises(ValueError, match=r"DPOConfig.loss_type holds \['needs_logits'\]; expected loss types built on"):
        _dpo(preference_rows(count=2), loss_type="needs_logits")


@pytest.mark.parametrize("reference,expected", [
    ("qwen3", r"ref_model is a Qwen3ForCausalLM \(qwen3\); expected the policy's architecture, LlamaForCausalLM"),
    ("vocabulary", r"ref_model has a vocabulary of 120 tokens; expected the policy's 101"),
])
def test_reference_of_another_model(reference, expected):
    from transformers import AutoModelForCausalLM

    from helpers.preference import tiny_config

    if reference == "qwen3":
        ref = policy_model("qwen3", "blockdiag_cp")
    else:
        config = tiny_config("llama")
        config.vocab_size = 120
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="blockdiag_cp")
    with pytest.raises(ValueError, match=expected):
        _dpo(preference_rows(count=2), ref=ref)


def test_padding_free_is_not_changed_in_the_users_config(caplog):
    """TRL's `padding_free` has no use on packs: the trainer trains on a copy without it and says so in
    one INFO line; the user's DPOConfig keeps what they set."""
    import logging

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    with accelerate_env(0, 1) as out, caplog.at_level(logging.INFO, logger="hf_blockdiag_cp"):
        policy = policy_model("llama", "blockdiag_cp")
        args = dpo_config(out, 1, padding_free=True)
        trainer = BlockdiagCPDPOTrainer(model=policy, ref_model=reference_model(policy), args=args,
                                        train_dataset=preference_dataset(preference_rows(count=2)),
                                        processing_class=char_tokenizer(), max_tokens=1024)
        trainer.train()  # one step on the copy
    assert args.padding_free is True and trainer.args.padding_free is False
    lines = [r.getMessage() for r in caplog.records if "padding_free" in r.getMessage()]
    assert len(lines) == 1 and "yours is unchanged" in lines[0], lines


def test_every_pair_dropped_by_trl_names_max_length():
    """Text pairs that TRL's preparation drops at a short `max_length` (DPO: the prompt alone fills it;
    reward: a sequence longer than it): the error names the TRL setting and how many pairs went."""
    rows = [{"prompt": "abcdefghij" * 2, "chosen": " yes", "rejected": " no"},
            {"prompt": "klmnopqrst" * 2, "chosen": " ok", "rejected": " nay"}]
    with pytest.raises(ValueError, match=r"dropped all 2 pairs: it drops a pair whose prompt alone fills "
                                         r"DPOConfig.max_length=8 .*; raise max_length"):
        _dpo(rows, max_length=8)
    with pytest.raises(ValueError, match=r"dropped all 2 pairs: .* longer than RewardConfig.max_length=8; raise max_length"):
        _reward(rows, max_length=8)


def test_router_aux_loss_over_several_packs_is_refused():
    """An MoE policy with TRL's router auxiliary loss on: a micro-batch of two packs cannot give TRL's one term of
    the micro-batch (it is not a sum over packs); one pack per micro-batch trains."""
    rows = preference_rows(count=4, long_chars=60)
    policy = policy_model("qwen3_moe", "blockdiag_cp")
    whole = _dpo(rows, policy=policy, per_device_train_batch_size=2, max_tokens=4096)
    assert whole.aux_loss_enabled and len(whole.get_train_dataloader()) == 2  # two micro-batches of one pack
    longest = max(whole._pair_lengths(whole.train_dataset))  # its micro-batch: two packs
    small = _dpo(rows, policy=policy, per_device_train_batch_size=2, max_tokens=longest + longest % 2)
    with pytest.raises(ValueError, match=r"a micro-batch of 2 packs with the MoE router auxiliary loss on "
                                         r"\(router_aux_loss_coef=.*\): TRL's auxiliary loss is the whole micro-batch's"
                                         r".*DPOConfig.per_device_train_batch_size=2 .*router_aux_loss_coef=0.0"):
        small.get_train_dataloader()


@pytest.mark.parametrize("loss_type,weighting", [(["aot"], False), (["aot_unpaired"], False), (["sigmoid", "sft"], True)])
def test_micro_batch_wide_loss_needs_one_pack(loss_type, weighting):
    """The `aot` sorts and WPO's `sft` run over TRL's whole micro-batch: a max_tokens below the two longest pairs
    (per_device_train_batch_size=2) is refused, naming the loss type; one that holds them builds."""
    rows = preference_rows(count=4, long_chars=60)
    trainer = _dpo(rows)
    lengths = sorted(trainer._pair_lengths(trainer.train_dataset), reverse=True)
    need = lengths[0] + lengths[1]
    options = dict(loss_type=loss_type, use_weighting=weighting, per_device_train_batch_size=2)
    with pytest.raises(ValueError, match=rf"DPOConfig.loss_type holds \[{loss_type[-1]!r}\], computed over TRL's whole "
                                         rf"micro-batch.* hold {need} tokens, more than max_tokens={lengths[0] + 2}"):
        _dpo(rows, max_tokens=lengths[0] + 2, **options)
    _dpo(rows, max_tokens=need + need % 2, **options)

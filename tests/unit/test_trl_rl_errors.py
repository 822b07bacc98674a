"""Bad input to the RL trainers (GRPO, RLOO) raises one clear error naming the field, before or at the
first forward, on every rank alike (the checks read what every rank of the world agrees on)."""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.rl import model_kwargs, prompt_rows, rl_config, rl_trainer, saved_policy  # noqa: E402
from helpers.trainer import accelerate_env, quiet  # noqa: E402


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return saved_policy("llama", str(tmp_path_factory.mktemp("policy")))


def _trainer(path, kind="grpo", lengths=(5, 9), rows=None, trainer_kwargs=None, train=False, **settings):
    """Build the trainer (and train it with `train`) inside one accelerate state."""
    with accelerate_env(0, 1) as out:
        args = rl_config(kind, out, **model_kwargs("blockdiag_cp"), **{"max_completion_length": 16, **settings})
        trainer = quiet(rl_trainer(kind, path, args, True, lengths=lengths, rows=rows or prompt_rows(),
                                   **(trainer_kwargs or {})))
        if train:
            trainer.train()
        return trainer


@pytest.mark.parametrize("settings, expected", [
    ({"use_liger_kernel": True}, "GRPOConfig.use_liger_kernel is True; expected False"),
    ({"entropy_coef": 0.01}, "GRPOConfig.entropy_coef=0.01"),
    ({"cast_lm_head_to_fp32": True}, "GRPOConfig.cast_lm_head_to_fp32 is True; expected False"),
])
def test_unsupported_settings_are_refused_by_name(llama_path, settings, expected):
    with pytest.raises(ValueError, match=expected.replace("(", r"\(").replace(".", r"\.")):
        _trainer(llama_path, **settings)


def test_a_completion_longer_than_the_pack_is_refused_at_construction(llama_path):
    with pytest.raises(ValueError, match=r"GRPOConfig\.max_completion_length=16 is not below max_tokens=16"):
        _trainer(llama_path, trainer_kwargs={"max_tokens": 16})


def test_a_prompt_longer_than_the_pack_names_max_tokens_and_the_prompt(llama_path):
    rows = [{"prompt": "a " * 40}] * 2  # 80 prompt tokens, packs of 64
    with pytest.raises(ValueError, match=r"more than max_tokens=64 \(the longest: a prompt of 80 tokens and a completion"):
        _trainer(llama_path, rows=rows, trainer_kwargs={"max_tokens": 64}, train=True)


def test_a_micro_batch_without_completion_tokens_is_no_error(llama_path):
    """Every completion reaches max_completion_length without EOS and mask_truncated_completions masks them
    all: TRL trains on silently (multiprocess/test_trl_rl.py compares the step with TRL's), and so does
    the CP step, without the library's warning about packs without targets, under either policy."""
    import logging

    import hf_blockdiag_cp as bdcp
    from helpers.logs import library_logs

    for policy in ("warn", "raise"):
        with library_logs(logging.WARNING) as messages:
            trainer = _trainer(llama_path, lengths=(16,), mask_truncated_completions=True, train=True,
                               trainer_kwargs={"cp_config": bdcp.CPConfig(no_target_packs=policy)})
        logs = [h for h in trainer.state.log_history if "loss" in h]
        assert len(logs) == 1 and logs[0]["grad_norm"] == 0.0, logs
        assert not [m for m in messages if "target" in m], messages


@pytest.mark.parametrize("kind, how", [("grpo", "config"), ("grpo", "launch"), ("rloo", "launch")])
def test_deepspeed_is_refused_before_trl_builds_anything(kind, how, monkeypatch):
    """DeepSpeed is refused as the Trainer path refuses it, from the settings alone (every rank alike, before
    any collective): `GRPOConfig(deepspeed={...})` as a user writes it (it constructs only where deepspeed is
    installed), or `accelerate launch --use_deepspeed`'s environment. The model path does not exist: the
    refusal comes before TRL loads anything."""
    import importlib.util

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPGRPOTrainer, BlockdiagCPRLOOTrainer

    if how == "config" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("GRPOConfig(deepspeed=...) constructs only where deepspeed is installed")
    trainer = {"grpo": BlockdiagCPGRPOTrainer, "rloo": BlockdiagCPRLOOTrainer}[kind]
    with accelerate_env(0, 1) as out:
        extra = {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}}
        args = rl_config(kind, out, **(extra if how == "config" else {}))
        if how == "launch":
            monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        expected = r"\.deepspeed is set" if how == "config" else r"ACCELERATE_USE_DEEPSPEED=true"
        with pytest.raises(ValueError, match=expected + r".*expected no DeepSpeed.*Use DDP or FSDP2"):
            trainer(model="/nonexistent/policy", reward_funcs=len, args=args)


def test_rloo_takes_rloo_config(llama_path):
    from trl import GRPOConfig

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPRLOOTrainer

    with accelerate_env(0, 1) as out:
        with pytest.raises(ValueError, match="args must be a trl.RLOOConfig; got GRPOConfig"):
            BlockdiagCPRLOOTrainer(model=llama_path, reward_funcs=len, args=GRPOConfig(output_dir=out, use_cpu=True, bf16=False))


def test_text_only_rows(llama_path):
    import torch

    ids = torch.ones(2, 6, dtype=torch.long)
    with accelerate_env(0, 1) as out:
        args = rl_config("grpo", out, **model_kwargs("blockdiag_cp"))
        trainer = quiet(rl_trainer("grpo", llama_path, args, True))
        with pytest.raises(ValueError, match=r"takes text-only rows; got the multimodal inputs \['pixel_values'\]"):
            trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                       pixel_values=torch.zeros(1))


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_a_policy_path_loads_on_the_cp_attention(llama_path, kind):
    """A policy given by path without an attention in `model_init_kwargs`: TRL loads it, and the reference it
    builds from the same path, on `blockdiag_cp` (from a copy of the config: the user's is unchanged); another
    attention there is refused by the field's name before TRL loads anything."""
    from helpers.logs import library_logs

    name = {"grpo": "GRPOConfig", "rloo": "RLOOConfig"}[kind]
    import logging

    with accelerate_env(0, 1) as out:
        args = rl_config(kind, out, beta=0.04, model_init_kwargs={"dtype": "float32"})
        with library_logs(logging.INFO) as messages:
            trainer = quiet(rl_trainer(kind, llama_path, args, True))
        assert args.model_init_kwargs == {"dtype": "float32"}
        for model in (trainer.model, trainer.ref_model):
            assert model.config._attn_implementation == "blockdiag_cp"
        assert [m for m in messages if f'{name} loads {llama_path!r} with model_init_kwargs["attn_implementation"]' in m]
        args = rl_config(kind, out, **model_kwargs("sdpa"))
        expected = rf"{name}\.model_init_kwargs\[\"attn_implementation\"\] is 'sdpa'; expected 'blockdiag_cp' \(or unset\)"
        with pytest.raises(ValueError, match=expected):
            rl_trainer(kind, "/nonexistent/policy", args, True)


def test_a_policy_built_in_memory_with_a_kl_term_names_the_path(llama_path):
    """beta > 0 without PEFT: TRL loads the reference from the policy's path, which a policy built from a config
    does not have (TRL's own error names an empty repo id). A policy object loaded from a path trains."""
    from transformers import AutoModelForCausalLM

    from helpers.preference import policy_model

    with accelerate_env(0, 1) as out:
        args = rl_config("grpo", out, beta=0.04)
        built = policy_model("llama", "blockdiag_cp")
        with pytest.raises(ValueError, match=r"GRPOConfig\.beta=0\.04 needs a reference model, which TRL loads from the "
                                             r"policy's path .* pass the policy by path .* or set GRPOConfig\.beta=0\.0"):
            rl_trainer("grpo", built, args, True)
        loaded = AutoModelForCausalLM.from_pretrained(llama_path, attn_implementation="blockdiag_cp")
        trainer = quiet(rl_trainer("grpo", loaded, args, True))
        assert trainer.ref_model is not None

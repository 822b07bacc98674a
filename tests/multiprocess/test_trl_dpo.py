"""`BlockdiagCPDPOTrainer` (TRL's DPOTrainer on packed pairs under block-diagonal CP) on real gloo groups,
against TRL's own `DPOTrainer` run the stock way (`helpers.preference`): one optimizer step, the
same pairs, model and reference; loss and every gradient ≤ 1e-4 relative, every logged metric ≤ 1e-5.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    FAMILIES, PACK, ROWS, GradCapture, char_tokenizer, compare_runs, dpo_config, first_sequence_tokens, policy_model,
    preference_dataset, preference_rows, reference_model, stock_dpo, training_logs,
)
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, run_beside  # noqa: E402
from hf_blockdiag_cp.integrations.trl.dpo_loss import LOSS_TYPES  # noqa: E402

DPO_METRICS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
               "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")


def _settings(loss_type: tuple, checkpointing: bool) -> dict:
    return {"loss_type": list(loss_type), **(checkpointing_settings(False) if checkpointing else {})}


def dpo_case(rank, world_size, group, families, cp_size, loss_type, checkpointing, pack=PACK, accumulation=1):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference_rows(**ROWS)
    results = {}
    for family in families:
        with accelerate_env(rank, world_size) as out:
            policy = policy_model(family, "blockdiag_cp")
            args = dpo_config(out, len(rows), gradient_accumulation_steps=accumulation,
                              **_settings(loss_type, checkpointing))
            capture = GradCapture()
            trainer = quiet(BlockdiagCPDPOTrainer(
                model=policy, ref_model=reference_model(policy), args=args, train_dataset=preference_dataset(rows),
                processing_class=char_tokenizer(), cp_size=cp_size, max_tokens=pack, callbacks=[capture]))
            trainer.train()
            results[family] = {"logs": training_logs(trainer), "grads": capture.grads}
    return results


FAMILY_LOSS = ("sigmoid", "ipo")  # both summed per pair (TRL's loss_type list): one run covers both


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_dpo_matches_trl_per_family(gloo, cp_size):
    """Every family at G = 1..4, the sigmoid and ipo losses summed, activation checkpointing at even G;
    the long chosen sequence straddles three ranks at G = 4."""
    assert first_sequence_tokens(preference_rows(**ROWS)) > 2 * PACK // 4, "the long sequence spans fewer than 3 shards"
    runs, stock = run_beside(gloo(cp_size), dpo_case, lambda: {f: stock_dpo(f, FAMILY_LOSS) for f in FAMILIES},
                             timeout=600, families=FAMILIES, cp_size=cp_size, loss_type=FAMILY_LOSS,
                             checkpointing=cp_size % 2 == 0)
    for family, want in stock.items():
        for rank, got in enumerate(runs):
            compare_runs(got[family], want, f"{family} G={cp_size} rank {rank}", DPO_METRICS)


# --------------------------------------------------------------------------- several packs, dp x cp, evaluation

TWO_PACKS = 436  # the long pair (434 tokens) fills one pack, the other pairs the second (a multiple of 2*cp, cp = 2)
EVAL_METRICS = tuple(f"eval_{name}" for name in ("loss",) + DPO_METRICS if name != "num_tokens")


@functools.cache
def stock_dpo_evaluate(family: str) -> dict:
    """TRL's DPOTrainer.evaluate, stock: every eval pair in one padded batch, before any training."""
    import tempfile

    from trl import DPOTrainer

    rows = preference_rows(**ROWS)
    with tempfile.TemporaryDirectory() as out:
        policy = policy_model(family, "eager")
        trainer = quiet(DPOTrainer(model=policy, ref_model=reference_model(policy), args=dpo_config(out, len(rows)),
                                   train_dataset=preference_dataset(rows), eval_dataset=preference_dataset(rows),
                                   processing_class=char_tokenizer()))
        return trainer.evaluate()


def packs_case(rank, world_size, group, family, cp_size, accumulation):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference_rows(**ROWS)
    with accelerate_env(rank, world_size) as out:
        policy = policy_model(family, "blockdiag_cp")
        args = dpo_config(out, len(rows), gradient_accumulation_steps=accumulation, per_device_train_batch_size=1)
        capture = GradCapture()
        trainer = quiet(BlockdiagCPDPOTrainer(
            model=policy, ref_model=reference_model(policy), args=args, train_dataset=preference_dataset(rows),
            eval_dataset=preference_dataset(rows), processing_class=char_tokenizer(), cp_size=cp_size,
            batching="tokens", max_tokens=TWO_PACKS, callbacks=[capture]))
        packs = len(trainer.get_train_dataloader())
        evaluated = trainer.evaluate()
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads, "eval": evaluated, "packs": packs}


@pytest.mark.parametrize("world_size,cp_size,accumulation", [(2, 2, 2), (4, 2, 1)], ids=["dp1xcp2-accumulate", "dp2xcp2"])
def test_dpo_over_several_packs_matches_trl(gloo, world_size, cp_size, accumulation):
    """`batching="tokens"`, the pairs in two packs: one DP replica accumulating both, or one pack per replica
    (a micro-batch is a pack). The step's loss
    and gradient are the mean over every pair of the step (TRL's, for one batch of all pairs), each pair
    weighed once; evaluate() before training equals TRL's evaluate on one batch of all pairs."""
    family = "qwen3_5"
    stock = lambda: (stock_dpo(family), stock_dpo_evaluate(family))  # noqa: E731
    runs, (want, stock_eval) = run_beside(gloo(world_size), packs_case, stock, timeout=300, family=family,
                                          cp_size=cp_size, accumulation=accumulation)
    for rank, got in enumerate(runs):
        what = f"{family} world {world_size} cp {cp_size} rank {rank}"
        assert got["packs"] * (world_size // cp_size) == 2, f"{what}: {got['packs']} packs per replica"
        compare_runs(got, want, what, DPO_METRICS)
        for name in EVAL_METRICS:
            bound = 1e-5 * max(1.0, abs(stock_eval[name]))
            assert abs(got["eval"][name] - stock_eval[name]) <= bound, f"{what}: {name} {got['eval'][name]} vs {stock_eval[name]}"


# --------------------------------------------------------------------------- LoRA, precomputed reference, loss types

def _lora():
    from peft import LoraConfig

    # random B (init_lora_weights=False): the policy starts away from its reference, the base model
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False)


PRECOMPUTED = ("precompute", "precompute_policy")


def _trainer_kwargs(variant: str, policy) -> dict:
    """The reference of each variant: LoRA (adapters disabled), the initial policy (precomputed), or a model."""
    if variant == "lora":
        return {"peft_config": _lora()}
    if variant == "precompute_policy":
        return {}
    return {"ref_model": reference_model(policy)}


@functools.cache
def stock_variant(variant: str, options: tuple = (), rows: tuple = tuple(ROWS.items())) -> dict:
    """TRL's stock DPOTrainer (llama, one padded batch, one process) with a LoRA policy, a precomputed
    reference, or a reference model, and DPOConfig `options`."""
    import tempfile

    from trl import DPOTrainer

    rows = preference_rows(**dict(rows))
    with tempfile.TemporaryDirectory() as out:
        policy = policy_model("llama", "eager")
        args = dpo_config(out, len(rows), per_device_train_batch_size=len(rows),
                          precompute_ref_log_probs=variant in PRECOMPUTED, **_config_options(options))
        capture = GradCapture()
        trainer = quiet(DPOTrainer(model=policy, args=args, train_dataset=preference_dataset(rows),
                                   processing_class=char_tokenizer(), callbacks=[capture],
                                   **_trainer_kwargs(variant, policy)))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


def variant_case(rank, world_size, group, variant, option_sets=((),), rows=tuple(ROWS.items()), pack=PACK):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference_rows(**dict(rows))
    results = {}
    for options in option_sets:
        with accelerate_env(rank, world_size) as out:
            policy = policy_model("llama", "blockdiag_cp")
            args = dpo_config(out, len(rows), precompute_ref_log_probs=variant in PRECOMPUTED, **_config_options(options))
            capture = GradCapture()
            trainer = quiet(BlockdiagCPDPOTrainer(
                model=policy, args=args, train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                cp_size=world_size, max_tokens=pack, callbacks=[capture], **_trainer_kwargs(variant, policy)))
            trainer.train()
            results[options] = {"logs": training_logs(trainer), "grads": capture.grads}
    return results


@pytest.mark.parametrize("variant", ["lora", *PRECOMPUTED])
def test_dpo_reference_variants_match_trl(gloo, variant):
    """G = 2: a PEFT LoRA policy (the reference is the model with its adapters disabled), and reference
    log-probs precomputed before training (`precompute_ref_log_probs=True`, packed under CP) by a
    reference model or by the initial policy. With the initial policy as its own reference every
    reward of step 1 is a tie, and `rewards/accuracies` is TRL's 0 only if the stored sums are the
    live ones exactly (float64, the same pack)."""
    runs, want = run_beside(gloo(2), variant_case, lambda: stock_variant(variant), timeout=300, variant=variant)
    for rank, got in enumerate(runs):
        compare_runs(got[()], want, f"{variant} rank {rank}", DPO_METRICS)


def _options(**options) -> tuple:
    """DPOConfig options as a hashable key (lists as tuples; `_config_options` turns them back)."""
    return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in options.items()))


def _config_options(options: tuple) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in options}


OPTION_SETS = (
    *(_options(loss_type=t, **({"label_smoothing": 1e-3} if t == "exo_pair" else {})) for t in LOSS_TYPES),
    _options(loss_type=["sigmoid", "sft", "bco_pair"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    _options(use_weighting=True),  # WPO
    _options(ld_alpha=0.5),  # LD-DPO: the tail of the longer completion weighs 0.5
    _options(f_divergence_type="js_divergence", loss_type="ipo"),
    _options(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.3),
)
SMALL_ROWS = tuple(dict(count=6, long_chars=0, seed=4).items())
SMALL_PACK = 400  # SMALL_ROWS' 396 tokens in one pack (PACK would be half padding)


def test_every_dpo_loss_matches_trl(gloo):
    """G = 1 (the same code path as any G): every loss_type of TRL 1.16, the MPO combination, WPO
    weighting, LD-DPO's ld_alpha and two f-divergences, against TRL's stock trainer."""
    runs, stock = run_beside(gloo(1), variant_case, lambda: [stock_variant("model", o, SMALL_ROWS) for o in OPTION_SETS],
                             timeout=600, variant="model", option_sets=OPTION_SETS, rows=SMALL_ROWS, pack=SMALL_PACK)
    for options, want in zip(OPTION_SETS, stock):
        compare_runs(runs[0][options], want, f"DPOConfig{dict(options)}", DPO_METRICS)


# --------------------------------------------------------------------------- dataset formats

def format_rows(kind: str) -> list[dict]:
    """ROWS as conversations (the character tokenizer's chat template renders them as the text rows) or
    pre-tokenized (TRL's tokenization of the text rows: the prompt, then the completion and EOS)."""
    from helpers.sft import EOS_ID, encode

    rows = preference_rows(**ROWS)
    if kind == "conversational":
        return [{"prompt": [{"role": "user", "content": r["prompt"].rstrip(" ")}],
                 "chosen": [{"role": "assistant", "content": r["chosen"]}],
                 "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in rows]
    return [{"prompt_ids": encode(r["prompt"]), "chosen_ids": encode(r["chosen"]) + [EOS_ID],
             "rejected_ids": encode(r["rejected"]) + [EOS_ID]} for r in rows]


def format_case(rank, world_size, group, kind):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = format_rows(kind)
    with accelerate_env(rank, world_size) as out:
        policy = policy_model("llama", "blockdiag_cp")
        capture = GradCapture()
        trainer = quiet(BlockdiagCPDPOTrainer(
            model=policy, ref_model=reference_model(policy), args=dpo_config(out, len(rows)),
            train_dataset=preference_dataset(rows), processing_class=char_tokenizer(), cp_size=world_size,
            max_tokens=PACK, callbacks=[capture]))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


@pytest.mark.parametrize("kind", ["conversational", "pretokenized"])
def test_dpo_dataset_formats_match_trl_on_text(gloo, kind):
    """G = 2: conversational pairs (tokenized by TRL with the chat template) and pre-tokenized pairs
    (used as given; TRL 1.16's DPOTrainer itself does not take them) of the same tokens train like
    TRL's stock trainer on the text pairs."""
    runs, want = run_beside(gloo(2), format_case, lambda: stock_dpo("llama"), timeout=300, kind=kind)
    for rank, got in enumerate(runs):
        compare_runs(got, want, f"{kind} rank {rank}", DPO_METRICS)


# --------------------------------------------------------------------------- a tokenizer whose pad token is EOS

def _eos_pad_run(trainer_cls, out: str, rows: list[dict], pairs_per_batch: dict, **kwargs) -> dict:
    from helpers.preference import pad_tokenizer

    policy = policy_model("llama", kwargs.pop("attn"))
    capture = GradCapture()
    trainer = quiet(trainer_cls(model=policy, ref_model=reference_model(policy), args=dpo_config(out, len(rows), **pairs_per_batch),
                                train_dataset=preference_dataset(rows), eval_dataset=preference_dataset(rows),
                                processing_class=pad_tokenizer("eos"), callbacks=[capture], **kwargs))
    evaluated = trainer.evaluate()
    trainer.train()
    return {"logs": training_logs(trainer), "grads": capture.grads, "eval": evaluated}


@functools.cache
def stock_dpo_eos_pad() -> dict:
    """TRL's DPOTrainer, stock (llama, one padded batch, one process) with a tokenizer without a pad token."""
    import tempfile

    from trl import DPOTrainer

    rows = preference_rows(**ROWS)
    with tempfile.TemporaryDirectory() as out:
        return _eos_pad_run(DPOTrainer, out, rows, {"per_device_train_batch_size": len(rows)}, attn="eager")


def eos_pad_case(rank, world_size, group):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    with accelerate_env(rank, world_size) as out:
        return _eos_pad_run(BlockdiagCPDPOTrainer, out, preference_rows(**ROWS), {}, attn="blockdiag_cp",
                            cp_size=world_size, max_tokens=PACK)


def test_eos_as_pad_token_matches_trl(gloo):
    """G = 2, a tokenizer without a pad token (TRL pads with EOS, as for Llama-3-style tokenizers; each
    completion ends in EOS): evaluate() and one training step equal TRL's stock DPOTrainer."""
    runs, want = run_beside(gloo(2), eos_pad_case, stock_dpo_eos_pad, timeout=300)
    for rank, got in enumerate(runs):
        what = f"pad = EOS rank {rank}"
        compare_runs(got, want, what, DPO_METRICS)
        for name in EVAL_METRICS:
            bound = 1e-5 * max(1.0, abs(want["eval"][name]))
            assert abs(got["eval"][name] - want["eval"][name]) <= bound, f"{what}: {name} {got['eval'][name]} vs {want['eval'][name]}"

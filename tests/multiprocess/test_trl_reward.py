"""`BlockdiagCPRewardTrainer` (TRL's RewardTrainer on packed pairs under block-diagonal CP) on real gloo
groups, against TRL's own `RewardTrainer` run the stock way (`helpers.preference`): one optimizer
step, the same pairs and classifier; loss and every gradient ≤ 1e-4 relative, every metric ≤ 1e-5.
The reward is the score at each sequence's last token, which sits on any rank.
"""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.preference import (  # noqa: E402
    FAMILIES, PACK, PAD_TOKENS, ROWS, GradCapture, char_tokenizer, compare_runs, equal_length_rows, pad_tokenizer,
    preference_dataset, preference_rows, reward_classifier, reward_config, training_logs,
)
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, run_beside  # noqa: E402

REWARD_METRICS = ("num_tokens", "min_reward", "mean_reward", "max_reward", "accuracy", "margin")


def _rows(margin: bool) -> list[dict]:
    rows = preference_rows(**ROWS)
    if margin:
        for i, row in enumerate(rows):
            row["margin"] = 0.25 * (i % 3)
    return rows


@functools.cache
def stock_reward(family: str, margin: bool, center: float | None) -> dict:
    """TRL's RewardTrainer, stock: eager classifier, every pair in one padded batch, one process."""
    import tempfile

    from trl import RewardTrainer

    rows = _rows(margin)
    with tempfile.TemporaryDirectory() as out:
        args = reward_config(out, len(rows), per_device_train_batch_size=len(rows), center_rewards_coefficient=center)
        capture = GradCapture()
        trainer = quiet(RewardTrainer(model=reward_classifier(family, "eager"), args=args,
                                      train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                      callbacks=[capture]))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


def reward_case(rank, world_size, group, families, cp_size, checkpointing, margin, center):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPRewardTrainer

    rows = _rows(margin)
    results = {}
    for family in families:
        with accelerate_env(rank, world_size) as out:
            args = reward_config(out, len(rows), center_rewards_coefficient=center,
                                 **(checkpointing_settings(False) if checkpointing else {}))
            capture = GradCapture()
            trainer = quiet(BlockdiagCPRewardTrainer(
                model=reward_classifier(family, "blockdiag_cp"), args=args, train_dataset=preference_dataset(rows),
                processing_class=char_tokenizer(), cp_size=cp_size, max_tokens=PACK, callbacks=[capture]))
            trainer.train()
            results[family] = {"logs": training_logs(trainer), "grads": capture.grads}
    return results


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_reward_matches_trl_per_family(gloo, cp_size):
    """Every family at G = 1..4 with a margin column and center_rewards_coefficient, activation
    checkpointing at even G."""
    runs, stock = run_beside(gloo(cp_size), reward_case, lambda: {f: stock_reward(f, True, 0.01) for f in FAMILIES},
                             timeout=600, families=FAMILIES, cp_size=cp_size, checkpointing=cp_size % 2 == 0,
                             margin=True, center=0.01)
    for family, want in stock.items():
        for rank, got in enumerate(runs):
            compare_runs(got[family], want, f"{family} G={cp_size} rank {rank}", REWARD_METRICS)


# --------------------------------------------------------------------------- where the reward is read

EVAL_METRICS = ("eval_loss", "eval_min_reward", "eval_mean_reward", "eval_max_reward", "eval_accuracy", "eval_margin")


def _evaluate_then_train(trainer, capture) -> dict:
    """evaluate() on the mixed-length eval pairs and on equal-length ones, then one training step."""
    evaluated = {"mixed": trainer.evaluate(), "equal": trainer.evaluate(preference_dataset(equal_length_rows()))}
    trainer.train()
    return {"eval": evaluated, "logs": training_logs(trainer), "grads": capture.grads}


@functools.cache
def stock_pooling(pad: str) -> dict:
    """TRL's RewardTrainer, stock (eager llama classifier, one padded batch, one process) with the `pad`
    tokenizer: the model's own forward scores each sequence at its last non-pad token."""
    import tempfile

    from trl import RewardTrainer

    rows = _rows(False)
    with tempfile.TemporaryDirectory() as out:
        capture = GradCapture()
        trainer = quiet(RewardTrainer(
            model=reward_classifier("llama", "eager"), args=reward_config(out, len(rows), per_device_train_batch_size=len(rows)),
            train_dataset=preference_dataset(rows), eval_dataset=preference_dataset(rows), processing_class=pad_tokenizer(pad),
            callbacks=[capture]))
        return _evaluate_then_train(trainer, capture)


def pooling_case(rank, world_size, group, cp_size, pads):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPRewardTrainer

    rows = _rows(False)
    results = {}
    for pad in pads:
        with accelerate_env(rank, world_size) as out:
            capture = GradCapture()
            trainer = quiet(BlockdiagCPRewardTrainer(
                model=reward_classifier("llama", "blockdiag_cp"), args=reward_config(out, len(rows)),
                train_dataset=preference_dataset(rows), eval_dataset=preference_dataset(rows),
                processing_class=pad_tokenizer(pad), cp_size=cp_size, max_tokens=PACK, callbacks=[capture]))
            results[pad] = _evaluate_then_train(trainer, capture)
    return results


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_reward_is_read_where_the_model_pools(gloo, cp_size):
    """A tokenizer without a pad token (TRL pads with EOS, as for Llama-3-style tokenizers: the classifier's
    last non-pad token is the one before the appended EOS) and one with its own pad token, at G = 1..4:
    evaluate() on mixed-length pairs (the long one across three shards at G = 4) and on equal-length
    pairs (no padding in the stock batch), then one training step, against TRL's own RewardTrainer."""
    runs, stock = run_beside(gloo(cp_size), pooling_case, lambda: {pad: stock_pooling(pad) for pad in PAD_TOKENS},
                             timeout=300, cp_size=cp_size, pads=tuple(PAD_TOKENS))
    moved = abs(stock["eos"]["eval"]["mixed"]["eval_loss"] - stock["distinct"]["eval"]["mixed"]["eval_loss"])
    assert moved > 100 * 1e-5, f"the pad token does not move the stock scores ({moved:.1e}): the test could not fail"
    for rank, got in enumerate(runs):
        for pad, want in stock.items():
            what = f"pad {pad} G={cp_size} rank {rank}"
            for rows, metrics in want["eval"].items():
                for name in EVAL_METRICS:
                    value, ref = got[pad]["eval"][rows][name], metrics[name]
                    assert abs(value - ref) <= 1e-5 * max(1.0, abs(ref)), f"{what} {rows} pairs: {name} {value} vs {ref}"
            compare_runs(got[pad], want, what, REWARD_METRICS)

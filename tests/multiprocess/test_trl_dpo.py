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
    FAMILIES, GradCapture, PACK, char_tokenizer, compare_runs, dpo_config, policy_model, preference_dataset,
    preference_rows, reference_model, training_logs,
)
from helpers.trainer import accelerate_env, checkpointing_settings, quiet  # noqa: E402

DPO_METRICS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected", "mean_token_accuracy", "rewards/chosen",
               "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
ROWS = dict(count=8, long_chars=800)  # the long chosen sequence (811 tokens) spans three shards at G = 4 (PACK / 4 = 336)


def _settings(loss_type: str, checkpointing: bool) -> dict:
    return {"loss_type": loss_type, **(checkpointing_settings(False) if checkpointing else {})}


@functools.cache
def stock_dpo(family: str, loss_type: str) -> dict:
    """TRL's DPOTrainer, stock: eager model, every pair in one padded batch, one process."""
    import tempfile

    from trl import DPOTrainer

    rows = preference_rows(**ROWS)
    with tempfile.TemporaryDirectory() as out:
        policy = policy_model(family, "eager")
        args = dpo_config(out, len(rows), loss_type=loss_type, per_device_train_batch_size=len(rows))
        capture = GradCapture()
        trainer = quiet(DPOTrainer(model=policy, ref_model=reference_model(policy), args=args,
                                   train_dataset=preference_dataset(rows), processing_class=char_tokenizer(),
                                   callbacks=[capture]))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


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


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_dpo_matches_trl_per_family(gloo, cp_size):
    """Every family at G = 1..4 (sigmoid at even G with activation checkpointing, ipo at odd G without):
    the long pair straddles three ranks at G = 4."""
    loss_type, checkpointing = ("sigmoid", True) if cp_size % 2 == 0 else ("ipo", False)
    runs = gloo(cp_size).run(dpo_case, timeout=600, families=FAMILIES, cp_size=cp_size, loss_type=loss_type,
                             checkpointing=checkpointing)
    for family in FAMILIES:
        want = stock_dpo(family, loss_type)
        for rank, got in enumerate(runs):
            compare_runs(got[family], want, f"{family} G={cp_size} rank {rank} {loss_type}", DPO_METRICS)

"""Packs with labels but no target token (every label -100 after the shift) are loud
(`CPConfig.no_target_packs`, step/targets.py): a custom loop's steps warn on the CP group's first
rank with the count so far, at the 1st, 2nd, 4th ... such pack, and `"raise"` stops every rank; the
Trainer and the TRL trainer count them in their logs (`cp_packs_without_targets`, each pack once
over all ranks) and raise on every rank with `"raise"`. Runs in a fresh pool: the warning's count
is per process."""

from __future__ import annotations

import datasets
import pytest
import torch
from transformers import TrainingArguments

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.dist_pool import GlooPool
from helpers.logs import library_logs
from helpers.reference import build_models, make_pack
from helpers.sft import char_tokenizer, sft_config, token_documents
from helpers.trainer import accelerate_env, quiet, tiny_model, trainer_settings

WORLD_SIZE = 2
STEPS, ACCUMULATION = 2, 2  # 4 packs, all without targets


def _config(policy: str):
    """The step's config for `policy` ("warn": the default, none given)."""
    return None if policy == "warn" else bdcp.CPConfig(no_target_packs=policy)


def _targetless(batch: dict) -> dict:
    return {**batch, "labels": torch.full_like(batch["labels"], -100)}


def loop_case(rank, world_size, group, policy):
    """Three targetless packs, then one with targets, through the shard step and a model: the warnings
    this rank logged and the losses (or the error with `policy` "raise")."""
    _, model = build_models("llama")
    _, batch = make_pack("straddle", world_size)
    losses = []
    with library_logs() as messages:
        try:
            for pack in (_targetless(batch),) * 3 + (batch,):
                train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, pack, config=_config(policy),
                                                                           model=model)
                with train_ctx():
                    loss = model(**local).loss
                    loss.backward()
                losses.append(float(loss))
        except ValueError as exc:
            return str(exc)
    return [m for m in messages if "had labels but no target token" in m], losses


def trainer_case(rank, world_size, group, trainer, policy):
    """A Trainer (or the TRL trainer) on documents without targets: the `cp_packs_without_targets` of its
    training logs, or the error with `policy` "raise"."""
    config = _config(policy)
    docs = token_documents()
    with accelerate_env(rank, world_size) as out:
        try:
            if trainer == "trl":
                from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer

                data = datasets.Dataset.from_dict({"input_ids": docs, "completion_mask": [[0] * len(d) for d in docs]})
                args = sft_config(out, max_steps=STEPS, gradient_accumulation_steps=ACCUMULATION, completion_only_loss=True)
                run = BlockdiagCPSFTTrainer(model=tiny_model(), args=args, train_dataset=data,
                                            processing_class=char_tokenizer(), cp_size=world_size, cp_config=config)
            else:
                data = [{"input_ids": d, "labels": [-100] * len(d)} for d in docs]
                args = TrainingArguments(**trainer_settings(out, ACCUMULATION, STEPS))
                run = BlockdiagCPTrainer(model=tiny_model(), args=args, train_dataset=data, cp_size=world_size,
                                         max_tokens=256, cp_config=config)
            quiet(run).train()
        except ValueError as exc:
            return str(exc)
    return [h["cp_packs_without_targets"] for h in run.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def pool():
    fresh = GlooPool(WORLD_SIZE)
    yield fresh
    fresh.close()


def test_own_loop_warns_with_a_count_at_powers_of_two(pool):
    for rank, (warnings, losses) in enumerate(pool.run(loop_case, policy="warn")):
        if rank == 0:
            assert [m.split(" so far")[0] for m in warnings] == ["blockdiag_cp: 1 pack", "blockdiag_cp: 2 packs"], warnings
        else:
            assert warnings == [], (rank, warnings)
        assert losses[:3] == [0.0] * 3 and losses[3] > 0, losses  # what the warning is about: nothing trained


def test_own_loop_raises_on_every_rank(pool):
    for rank, message in enumerate(pool.run(loop_case, policy="raise")):
        assert isinstance(message, str) and message.startswith("blockdiag_cp: 1 pack with labels but no target token"), \
            (rank, message)


@pytest.mark.parametrize("trainer", ["trainer", "trl"])
def test_trainers_log_the_count_and_raise_on_every_rank(pool, trainer):
    if trainer == "trl":
        pytest.importorskip("trl")
    for rank, counts in enumerate(pool.run(trainer_case, trainer=trainer, policy="warn")):
        assert counts == [ACCUMULATION] * STEPS, (rank, counts)  # every pack once, over the CP group's ranks
    for rank, message in enumerate(pool.run(trainer_case, trainer=trainer, policy="raise")):
        assert isinstance(message, str) and message.startswith(f"blockdiag_cp: {ACCUMULATION} packs with labels but no "
                                                               "target token"), (rank, message)

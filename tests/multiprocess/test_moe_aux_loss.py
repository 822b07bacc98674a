"""The MoE router auxiliary loss under CP (model_patches/router_aux_loss.py) on real gloo groups, fp32.

Tiny Qwen3-MoE, OLMoE and Mixtral configs with `output_router_logits=True` and `router_aux_loss_coef`
0.5 (`helpers.model_zoo.moe_config`). The reference is the stock eager model on the same documents
padded, with their attention mask (Transformers' `load_balancing_loss_func` over the real tokens), or
TRL's own trainer run the stock way. Loss and every parameter gradient within 1e-4 relative:
- the core step (`make_cp_blockdiag_batch_and_ctx` + `model(**local).loss`) at G = 1..4, the pack's
  padding on the last rank; the loss with each rank's own aux loss (the stock function on its shard,
  what runs without the patch) is checked to be off by more than 1e-4, so the comparison can fail;
- `BlockdiagCPTrainer` and `BlockdiagCPSFTTrainer` at G = 2 (one pack, one optimizer step);
- `BlockdiagCPDPOTrainer` against TRL's `DPOTrainer`, `BlockdiagCPGRPOTrainer` against TRL's
  `GRPOTrainer` at world 2 (per rank over its own rows, as TRL computes it), at G = 2; TRL's default
  settings (its `router_aux_loss_coef` unset: the config's), `aux_loss` logged as TRL logs it;
  `BlockdiagCPRewardTrainer` against TRL's `RewardTrainer`, which adds no auxiliary loss.
"""

from __future__ import annotations

import functools

import pytest
import torch

from helpers.model_zoo import MOE_FAMILIES, ROUTER_AUX_COEF, build_pair
from helpers.trainer import run_beside

TOL = 1e-4
LENGTHS = (13, 5, 22, 1, 8)  # 49 tokens: the pack pads at every G, a document spans two shards at G >= 2
PACK = 56  # the Trainers' pack: a multiple of 2*G for G = 1..4


def documents() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 90, (n,), generator=g) for n in LENGTHS]


def padded_reference(ref, docs: list[torch.Tensor]) -> dict:
    """The stock eager model on `docs` padded on the right: its loss (token-mean cross-entropy +
    coef * load-balancing loss over the real tokens), aux loss and every gradient."""
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask, labels = torch.zeros_like(ids), torch.full_like(ids, -100)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)], labels[i, : len(d)] = d, 1, d
    ref.zero_grad()
    out = ref(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False)
    out.loss.backward()
    return {"loss": float(out.loss.detach()), "aux": float(out.aux_loss.detach()),
            "grads": {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}}


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm().clamp_min(1e-12))


def assert_close(loss: float, grads: dict, want: dict, what: str) -> None:
    assert abs(loss - want["loss"]) <= TOL * abs(want["loss"]), f"{what}: loss {loss} vs {want['loss']}"
    assert set(grads) == set(want["grads"]), f"{what}: gradients of {sorted(set(grads) ^ set(want['grads']))}"
    for name, ref in want["grads"].items():
        assert rel(grads[name], ref) <= TOL, f"{what}: gradient of {name} off by {rel(grads[name], ref):.2e}"


# --------------------------------------------------------------------------- the core step


def step_case(rank, world_size, group, families):
    import hf_blockdiag_cp as bdcp
    from hf_blockdiag_cp.model_patches.router_aux_loss import FUNCTION

    docs = documents()
    pack = torch.cat(docs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    batch = {"input_ids": pack, "labels": pack.clone(), "position_ids": positions}
    results = {}
    for family in families:
        _, model = build_pair(family)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, model=model)
        with train_ctx():
            out = model(**local)
            out.loss.backward()
        stock = getattr(__import__(type(model).__module__, fromlist=[FUNCTION]), FUNCTION).__wrapped__
        shard_alone = stock(out.router_logits, len(out.router_logits[0][0]), 2, None)  # the per-rank loss
        results[family] = {"loss": float(out.loss.detach()), "aux": float(out.aux_loss.detach()),
                           "shard_aux": float(shard_alone.detach()),
                           "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}}
    return results


@functools.cache
def stock_padded(family: str) -> dict:
    ref, _ = build_pair(family)
    return padded_reference(ref, documents())


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_core_step_matches_the_stock_model_padded(gloo, world_size):
    """The mean over ranks of the loss and of every gradient equals the stock padded run's (I2); the aux
    loss is the whole pack's on every rank; each shard's own aux loss differs from it."""
    runs, stock = run_beside(gloo(world_size), step_case, lambda: {f: stock_padded(f) for f in MOE_FAMILIES},
                             timeout=300, families=MOE_FAMILIES)
    for family, want in stock.items():
        got = [run[family] for run in runs]
        loss = sum(r["loss"] for r in got) / world_size
        grads = {n: sum(r["grads"][n] for r in got) / world_size for n in got[0]["grads"]}
        assert_close(loss, grads, want, f"{family} G={world_size}")
        for rank, r in enumerate(got):
            assert abs(r["aux"] - want["aux"]) <= TOL * want["aux"], \
                f"{family} rank {rank}: aux {r['aux']} vs {want['aux']}"
        per_rank = sum(r["shard_aux"] for r in got) / world_size
        assert ROUTER_AUX_COEF * abs(per_rank - want["aux"]) > TOL * want["loss"], \
            f"{family} G={world_size}: the loss with each shard's own aux loss would pass too"


# --------------------------------------------------------------------------- the Trainer and TRL's SFT

CP = 2  # the Trainers' CP size


def trainers_case(rank, world_size, group, families):
    """`BlockdiagCPTrainer` and `BlockdiagCPSFTTrainer` (TRL's defaults: its coefficient is the config's), one
    pack of every document, one optimizer step: the logged loss, every gradient and TRL's `aux_loss`."""
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer
    from helpers.preference import GradCapture, char_tokenizer, training_logs
    from helpers.sft import sft_config
    from helpers.trainer import accelerate_env, quiet, trainer_settings

    docs = [d.tolist() for d in documents()]
    results = {}
    for family in families:
        for kind in ("trainer", "sft"):
            with accelerate_env(rank, world_size) as out:
                _, model = build_pair(family)
                capture = GradCapture()
                if kind == "trainer":
                    trainer = BlockdiagCPTrainer(model=model, args=TrainingArguments(**trainer_settings(out, 1, 1)),
                                                 train_dataset=[{"input_ids": d} for d in docs], cp_size=world_size,
                                                 max_tokens=PACK, callbacks=[capture])
                else:
                    args = sft_config(out, max_length=PACK, gradient_accumulation_steps=1, max_steps=1)
                    trainer = BlockdiagCPSFTTrainer(
                        model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": docs}),
                        processing_class=char_tokenizer(), cp_size=world_size, callbacks=[capture])
                quiet(trainer).train()
                logs = training_logs(trainer)
                results[family, kind] = {"loss": logs["loss"], "aux_loss": logs.get("aux_loss"), "grads": capture.grads}
    return results


def test_trainer_and_sft_match_the_stock_model_padded(gloo):
    """One step of the Trainer and of TRL's SFT at G = 2: the logged loss (cross-entropy + 0.5 * the pack's
    aux loss) and every gradient equal the stock padded run's; SFT logs TRL's `aux_loss`."""
    runs = gloo(CP).run(trainers_case, timeout=300, families=MOE_FAMILIES)
    for family in MOE_FAMILIES:
        want = stock_padded(family)
        for rank, run in enumerate(runs):
            for kind in ("trainer", "sft"):
                got = run[family, kind]
                assert_close(got["loss"], got["grads"], want, f"{family} {kind} G={CP} rank {rank}")
            aux = run[family, "sft"]["aux_loss"]
            assert aux is not None and abs(aux - want["aux"]) <= 1e-5 * want["aux"], f"{family} SFT aux_loss {aux}"


# --------------------------------------------------------------------------- TRL's DPO and GRPO

DPO_PAIRS = 4
DPO_PACK = 272  # the four pairs' 271 tokens in one pack: TRL's one micro-batch of them
RL = {"lengths": (1, 7, 30, 12), "max_completion_length": 30}
REWARD_FAMILIES = ("qwen3_moe", "mixtral")  # OLMoE has no sequence classifier in Transformers
REWARD_METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")


@functools.cache
def stock_dpo(family: str) -> dict:
    """TRL's DPOTrainer, stock: eager, every pair in one padded batch, one process, TRL's default MoE settings."""
    import tempfile

    from trl import DPOTrainer

    from helpers.preference import (GradCapture, char_tokenizer, dpo_config, policy_model, preference_dataset,
                                    preference_rows, reference_model, training_logs)
    from helpers.trainer import quiet

    rows = preference_rows(count=DPO_PAIRS)
    with tempfile.TemporaryDirectory() as out:
        policy = policy_model(family, "eager")
        capture = GradCapture()
        trainer = quiet(DPOTrainer(model=policy, ref_model=reference_model(policy),
                                   train_dataset=preference_dataset(rows),
                                   args=dpo_config(out, DPO_PAIRS, per_device_train_batch_size=DPO_PAIRS),
                                   processing_class=char_tokenizer(), callbacks=[capture]))
        assert trainer.aux_loss_enabled
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


@functools.cache
def stock_reward(family: str) -> dict:
    """TRL's RewardTrainer, stock: eager classifier (router logits on; it adds no auxiliary loss), one batch."""
    import tempfile

    from trl import RewardTrainer

    from helpers.preference import (GradCapture, char_tokenizer, preference_dataset, preference_rows, reward_classifier,
                                    reward_config, training_logs)
    from helpers.trainer import quiet

    with tempfile.TemporaryDirectory() as out:
        capture = GradCapture()
        args = reward_config(out, DPO_PAIRS, per_device_train_batch_size=DPO_PAIRS)
        trainer = quiet(RewardTrainer(model=reward_classifier(family, "eager"), args=args,
                                      train_dataset=preference_dataset(preference_rows(count=DPO_PAIRS)),
                                      processing_class=char_tokenizer(), callbacks=[capture]))
        trainer.train()
        return {"logs": training_logs(trainer), "grads": capture.grads}


def trl_case(rank, world_size, group, families):
    """Ours: DPO and reward models on one pack of the pairs; GRPO, after TRL's own GRPOTrainer at this world
    size (each rank its own prompts and injected completions), on the same saved policy."""
    import tempfile

    import torch.distributed as dist

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer, BlockdiagCPRewardTrainer
    from helpers.preference import (GradCapture, char_tokenizer, dpo_config, policy_model, preference_dataset,
                                    preference_rows, reference_model, reward_classifier, reward_config, training_logs)
    from helpers.rl import LastGrads, model_kwargs, rl_config, rl_trainer, saved_policy
    from helpers.trainer import accelerate_env, quiet

    results = {}
    for family in families:
        with accelerate_env(rank, world_size) as out:
            policy = policy_model(family, "blockdiag_cp")
            capture = GradCapture()
            trainer = quiet(BlockdiagCPDPOTrainer(
                model=policy, ref_model=reference_model(policy), args=dpo_config(out, DPO_PAIRS),
                train_dataset=preference_dataset(preference_rows(count=DPO_PAIRS)), processing_class=char_tokenizer(),
                cp_size=world_size, max_tokens=DPO_PACK, callbacks=[capture]))
            assert len(trainer.get_train_dataloader()) == 1, "the pairs fill more than one pack"
            trainer.train()
            results[family, "dpo"] = {"logs": training_logs(trainer), "grads": capture.grads}
        if family in REWARD_FAMILIES:
            with accelerate_env(rank, world_size) as out:
                capture = GradCapture()
                trainer = quiet(BlockdiagCPRewardTrainer(
                    model=reward_classifier(family, "blockdiag_cp"), args=reward_config(out, DPO_PAIRS),
                    train_dataset=preference_dataset(preference_rows(count=DPO_PAIRS)),
                    processing_class=char_tokenizer(), cp_size=world_size, max_tokens=DPO_PACK, callbacks=[capture]))
                trainer.train()
                results[family, "reward"] = {"logs": training_logs(trainer), "grads": capture.grads}
        with tempfile.TemporaryDirectory() as directory:
            holder = [saved_policy(family, directory) if rank == 0 else None]
            dist.broadcast_object_list(holder, src=0)
            for ours in (False, True):
                with accelerate_env(rank, world_size) as out:
                    settings = dict(RL)
                    args = rl_config("grpo", out, **model_kwargs("blockdiag_cp" if ours else "eager"),
                                     max_completion_length=settings.pop("max_completion_length"))
                    capture = LastGrads()
                    cp = {"cp_size": world_size} if ours else {}
                    trainer = quiet(rl_trainer("grpo", holder[0], args, ours, callbacks=[capture],
                                               lengths=settings["lengths"], **cp))
                    trainer.train()
                    results[family, "grpo", ours] = {"logs": [h for h in trainer.state.log_history if "loss" in h],
                                                     "grads": capture.grads, "steps": args.max_steps}
            dist.barrier()
    return results


def test_dpo_grpo_and_reward_models_match_trl(gloo):
    """TRL's default settings turn the aux loss on (the config's coefficient): DPO at G = 2 against TRL's
    DPOTrainer on one batch of the pairs, GRPO at G = 2 against TRL's GRPOTrainer at world 2 (each rank's
    aux loss over its own rows): loss and every gradient <= 1e-4, `aux_loss` and every metric <= 1e-5.
    Reward models (router logits on) against TRL's RewardTrainer, which adds no auxiliary loss."""
    from helpers.preference import compare_runs
    from helpers.rl import compare_rl_runs

    runs, references = run_beside(
        gloo(CP), trl_case, lambda: {f: (stock_dpo(f), stock_reward(f) if f in REWARD_FAMILIES else None)
                                     for f in MOE_FAMILIES}, timeout=600, families=MOE_FAMILIES)
    for family, (want, want_reward) in references.items():
        assert "aux_loss" in want["logs"], f"{family}: TRL's DPO logged no aux_loss"
        for rank, run in enumerate(runs):
            compare_runs(run[family, "dpo"], want, f"{family} DPO G={CP} rank {rank}", ("aux_loss", "rewards/margins"))
            stock = run[family, "grpo", False]
            assert "aux_loss" in stock["logs"][0], f"{family}: TRL's GRPO logged no aux_loss"
            compare_rl_runs(run[family, "grpo", True], stock, f"{family} GRPO G={CP} rank {rank}")
            if family in REWARD_FAMILIES:
                compare_runs(run[family, "reward"], want_reward, f"{family} reward G={CP} rank {rank}",
                             REWARD_METRICS)

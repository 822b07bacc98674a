"""FSDP2 under every log-prob user, on real gloo groups: world 4 = dp_shard 2 x cp 2, FSDP2 over
dp_shard x cp (`mesh.fsdp`), in the unit layouts of `helpers.fsdp`.

- `document_log_probs`, the model sharded by hand (the output embedding its own unit, whose weight
  FSDP2 frees after its forward, as torchtitan shards; each decoder layer and the root; the whole
  model one unit): each dp replica its own pack, `loss = sum(w * sums)` over its documents, two steps
  (the first checks the model's logit transform on probe rows, the second runs the head alone).
  Each rank's per-document sums and every gradient (`full_tensor()`, FSDP2's mean over the four
  ranks) within 1e-4 of the stock eager model run on each document alone.
- The DPO (with activation checkpointing), reward and GRPO trainers, FSDP2 as a user turns it on
  (`TrainingArguments(fsdp=True, fsdp_config={"version": 2})`) with the model as it is (accelerate
  shards it: each decoder layer, the input embedding, the final norm with the head, the root) or
  sharded beforehand (the head its own unit; the whole model one unit; accelerate keeps a sharded
  model as it is). Against TRL's own trainers run the stock way (`helpers.preference`,
  `helpers.rl`): the loss and every gradient (`full_tensor()`) within 1e-4, the metrics within 1e-5.
  accelerate keeps FSDP only on accelerator devices; `helpers.fsdp.fsdp_on_cpu` keeps it on gloo.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import tempfile

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.logprobs import document_log_probs
from hf_blockdiag_cp.planning import PAIR_COUNT
from helpers import preference, rl
from helpers.fsdp import LAYOUTS, FullGradsBeforeStep, fsdp_on_cpu, full_grads, shard
from helpers.reference import build_models, make_pack, rel_err
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, run_beside

TOL = 1e-4
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather", kernel_cost=PAIR_COUNT)
DP_SHARD, CP = 2, 2
PACKS = ("straddle", "span_all")  # dp replica 0's pack, replica 1's


def _weights(count: int, replica: int) -> torch.Tensor:
    return torch.randn(count, generator=torch.Generator().manual_seed(11 + replica), dtype=torch.float64)


@functools.cache
def _log_prob_reference() -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Per replica the stock model's per-document sums of log p(next token), and the mean over the
    replicas of the gradients of `sum(w * sums)`: each document alone, eager, float64 sums."""
    ref, _ = build_models("llama")
    sums, grads = [], {}
    for replica in range(DP_SHARD):
        docs, _ = make_pack(PACKS[replica], CP, seed=1 + replica)
        ref.zero_grad(set_to_none=True)
        per_doc = torch.stack([
            torch.log_softmax(ref(input_ids=d[None]).logits[0, :-1].double(), -1).gather(1, d[1:, None]).sum()
            for d in docs])
        (_weights(len(docs), replica) * per_doc).sum().backward()
        sums.append(per_doc.detach())
        for name, p in ref.named_parameters():
            grads[name] = grads.get(name, 0) + p.grad / DP_SHARD
    return sums, grads


def log_probs_case(rank, world_size, group, layouts):
    """Per layout and step: this rank's sums and the full gradients of `sum(w * sums)`."""
    dims = bdcp.ParallelDims(dp_shard=DP_SHARD, cp=CP)
    mesh = dims.build_mesh("cpu")
    out = {}
    for layout in layouts:
        _, model = build_models("llama")
        model = shard(model, layout, mesh.fsdp)
        _, batch = make_pack(PACKS[dims.dp_rank], CP, seed=1 + dims.dp_rank)
        for step in range(2):
            model.zero_grad(set_to_none=True)
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(mesh.cp, None, batch, config=CONFIG)
            with train_ctx():
                result = document_log_probs(model, local)
                (_weights(result.num_documents, dims.dp_rank) * result.sums).sum().backward()
            out[layout, step] = {"sums": result.sums.detach(), "grads": full_grads(model), "replica": dims.dp_rank}
    return out


def test_document_log_probs_under_fsdp2(gloo):
    results, (sums, grads) = run_beside(gloo(DP_SHARD * CP), log_probs_case, _log_prob_reference, timeout=300,
                                        layouts=LAYOUTS)
    for rank, result in enumerate(results):
        for (layout, step), got in result.items():
            what = f"{layout} step {step} rank {rank}"
            assert rel_err(got["sums"], sums[got["replica"]]) <= TOL, f"{what}: sums {got['sums']}"
            assert set(got["grads"]) == set(grads), what
            errors = {n: rel_err(got["grads"][n], g) for n, g in grads.items()}
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, f"{what}: gradient of {worst} off by {errors[worst]:.2e}"


# --------------------------------------------------------------------------- the trainers

needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None or importlib.util.find_spec("datasets") is None,
                               reason="needs the [trl] extra (trl, datasets)")
# The long pair (434 tokens) fills one pack, the other pairs the other. The reward model trains a pack per dp
# replica (batching="tokens"); DPO half the pairs per replica (batching="pairs"): the replica holding the long pair
# runs two packs, the other one and a filler pack.
TWO_PACKS = 436
FSDP2 = {"fsdp": True, "fsdp_config": {"version": 2}}  # what a user gives TrainingArguments for FSDP2
TRAINER_LAYOUTS = ("accelerate", "head", "root")  # accelerate's own wrapping, or the model sharded beforehand
DPO_METRICS = ("entropy", "logits/chosen", "mean_token_accuracy", "rewards/chosen", "rewards/rejected",
               "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected")
REWARD_METRICS = ("min_reward", "mean_reward", "max_reward", "accuracy", "margin")
RL_SETTINGS = {"lengths": (1, 7, 30, 3, 15, 40), "max_completion_length": 40}  # some completions truncated at 40


def _sharded(model, layout: str):
    """`model` as the user hands it to a trainer: as it is ("accelerate" shards it), or sharded in `layout`."""
    if layout == "accelerate":
        return model
    return shard(model, layout, bdcp.ParallelDims(dp_shard=DP_SHARD, cp=CP).build_mesh("cpu").fsdp)


def _trained(trainer, capture) -> dict:
    """One optimizer step: the step's log, the gradients `capture` took, the type the model was wrapped in."""
    trainer.train()
    return {"logs": preference.training_logs(trainer), "grads": capture.grads,
            "wrapped": type(trainer.model_wrapped).__name__}


def _check_trainer_runs(runs: list[dict], want: dict, what: str, metrics: tuple[str, ...]) -> None:
    for rank, result in enumerate(runs):
        for layout, got in result.items():
            assert got["wrapped"].startswith("FSDP"), f"{what} {layout}: the model ran in {got['wrapped']}"
            preference.compare_runs(got, want, f"{what} {layout} rank {rank}", metrics)


def dpo_case(rank, world_size, group, layouts):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference.preference_rows(**preference.ROWS)
    results = {}
    for layout in layouts:
        with accelerate_env(rank, world_size) as out, fsdp_on_cpu():
            policy = preference.policy_model("llama", "blockdiag_cp")
            ref, capture = preference.reference_model(policy), FullGradsBeforeStep()  # the reference before sharding
            trainer = quiet(BlockdiagCPDPOTrainer(
                model=_sharded(policy, layout), ref_model=ref,
                args=preference.dpo_config(out, len(rows), per_device_train_batch_size=len(rows) // DP_SHARD, **FSDP2,
                                           **checkpointing_settings(False)),
                train_dataset=preference.preference_dataset(rows), processing_class=preference.char_tokenizer(),
                cp_size=CP, max_tokens=TWO_PACKS, callbacks=[capture]))
            results[layout] = _trained(trainer, capture)
    return results


@needs_trl
def test_dpo_under_fsdp2_matches_trl(gloo):
    runs, want = run_beside(gloo(DP_SHARD * CP), dpo_case, lambda: preference.stock_dpo("llama"), timeout=300,
                            layouts=TRAINER_LAYOUTS)
    _check_trainer_runs(runs, want, "DPO", DPO_METRICS)


@functools.cache
def stock_reward() -> dict:
    """TRL's RewardTrainer, stock: eager classifier, every pair in one padded batch, one process."""
    from trl import RewardTrainer

    rows = preference.preference_rows(**preference.ROWS)
    with tempfile.TemporaryDirectory() as out:
        capture = preference.GradCapture()
        trainer = quiet(RewardTrainer(
            model=preference.reward_classifier("llama", "eager"),
            args=preference.reward_config(out, len(rows), per_device_train_batch_size=len(rows)),
            train_dataset=preference.preference_dataset(rows), processing_class=preference.char_tokenizer(),
            callbacks=[capture]))
        return _trained(trainer, capture)


def reward_case(rank, world_size, group, layouts):
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPRewardTrainer

    rows = preference.preference_rows(**preference.ROWS)
    results = {}
    for layout in layouts:
        with accelerate_env(rank, world_size) as out, fsdp_on_cpu():
            capture = FullGradsBeforeStep()
            trainer = quiet(BlockdiagCPRewardTrainer(
                model=_sharded(preference.reward_classifier("llama", "blockdiag_cp"), layout),
                args=preference.reward_config(out, len(rows), per_device_train_batch_size=1, **FSDP2),
                train_dataset=preference.preference_dataset(rows), processing_class=preference.char_tokenizer(),
                cp_size=CP, batching="tokens", max_tokens=TWO_PACKS, callbacks=[capture]))
            results[layout] = _trained(trainer, capture)
    return results


@needs_trl
def test_reward_under_fsdp2_matches_trl(gloo):
    runs, want = run_beside(gloo(DP_SHARD * CP), reward_case, stock_reward, timeout=300, layouts=TRAINER_LAYOUTS)
    _check_trainer_runs(runs, want, "reward", REWARD_METRICS)


def _grpo_run(path: str, rank: int, world_size: int, layout: str | None) -> dict:
    """TRL's GRPOTrainer the stock way (`layout` None: eager, DDP) or ours under FSDP2 in `layout`."""
    from transformers import AutoModelForCausalLM

    settings = dict(RL_SETTINGS)
    lengths = settings.pop("lengths")
    with accelerate_env(rank, world_size) as out, (fsdp_on_cpu() if layout else contextlib.nullcontext()):
        if layout is None:
            model, extra, capture, ours = path, rl.model_kwargs("eager"), rl.LastGrads(), {}
        elif layout == "accelerate":
            model, extra, capture, ours = path, {**FSDP2, **rl.model_kwargs("blockdiag_cp")}, FullGradsBeforeStep(), {}
        else:
            loaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="blockdiag_cp", dtype=torch.float32)
            model, extra, capture, ours = _sharded(loaded, layout), FSDP2, FullGradsBeforeStep(), {}
        if layout is not None:
            ours["cp_size"] = CP
        args = rl.rl_config("grpo", out, **extra, **settings)
        trainer = quiet(rl.rl_trainer("grpo", model, args, layout is not None, lengths=lengths, callbacks=[capture],
                                      **ours))
        trainer.train()
        return {"logs": [h for h in trainer.state.log_history if "loss" in h], "grads": capture.grads,
                "steps": args.max_steps, "wrapped": type(trainer.model_wrapped).__name__}


def grpo_case(rank, world_size, group, layouts):
    """TRL's GRPOTrainer at world 4 (each rank its own prompts and completions), then ours in each layout."""
    with tempfile.TemporaryDirectory() as directory:
        holder = [rl.saved_policy("llama", directory) if rank == 0 else None]
        dist.broadcast_object_list(holder, src=0)  # rank 0's folder: every rank loads the same weights
        results = {layout: _grpo_run(holder[0], rank, world_size, layout) for layout in (None, *layouts)}
        dist.barrier()
    return results


@needs_trl
def test_grpo_under_fsdp2_matches_trl(gloo):
    for rank, result in enumerate(gloo(DP_SHARD * CP).run(grpo_case, timeout=300, layouts=TRAINER_LAYOUTS)):
        want = result.pop(None)
        for layout, got in result.items():
            assert got["wrapped"].startswith("FSDP"), f"GRPO {layout}: the model ran in {got['wrapped']}"
            rl.compare_rl_runs(got, want, f"GRPO {layout} rank {rank}")


def unsharded_engine_case(rank, world_size, group):
    """A model sharded beforehand, given to the DPO and GRPO trainers without FSDP in TrainingArguments:
    the errors raised at construction, on each rank."""
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    rows = preference.preference_rows(**preference.ROWS)
    messages = []
    with accelerate_env(rank, world_size) as out:
        policy = preference.policy_model("llama", "blockdiag_cp")
        ref = preference.reference_model(policy)
        for build in (
            lambda: BlockdiagCPDPOTrainer(model=_sharded(policy, "root"), ref_model=ref,
                                          args=preference.dpo_config(out, len(rows)),
                                          train_dataset=preference.preference_dataset(rows),
                                          processing_class=preference.char_tokenizer(), cp_size=CP,
                                          max_tokens=TWO_PACKS),
            lambda: rl.rl_trainer("grpo", _sharded(preference.policy_model("llama", "blockdiag_cp"), "head"),
                                  rl.rl_config("grpo", out, max_completion_length=RL_SETTINGS["max_completion_length"]),
                                  True, cp_size=CP),
        ):
            try:
                build()
                messages.append(None)
            except ValueError as exc:
                messages.append(str(exc))
    return messages


@needs_trl
def test_a_sharded_model_without_fsdp_is_refused(gloo):
    for rank, messages in enumerate(gloo(DP_SHARD * CP).run(unsharded_engine_case, timeout=120)):
        for message in messages:
            assert message is not None and "is sharded with FSDP2" in message, f"rank {rank}: {message}"
            assert "fsdp=True, fsdp_config={'version': 2}" in message, message

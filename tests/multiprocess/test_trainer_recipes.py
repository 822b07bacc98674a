"""What README.md's Trainer sections promise, at dp=1 x cp=2 on gloo, each against a reference that
uses none of the CP code or against an uninterrupted run:

- resume: a fresh trainer resumed from a mid-epoch checkpoint logs the same losses and grad norms
  and ends with the same weights as the run that was not interrupted, across an epoch boundary;
- LoRA: a PEFT model trains like the stock Trainer with the stock `sdpa` model and the same
  adapters on the same packs (losses, grad norms, adapter weights), the base weights untouched;
- eval cadence: `eval_strategy="steps"` evaluates sharded after every `eval_steps`, each
  `eval_loss` the stock eager model's per-document loss with the weights of that step, and the
  training between the evaluations is the stock Trainer's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_blockdiag_cp.data import PackedBatchSampler, dataset_lengths
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.trainer import accelerate_env, quiet, tiny_model
from helpers.trainer_reference import LOSS_TOL, MAX_TOKENS, PACKS_PER_STEP, STEPS, assert_same_training, eval_docs
from helpers.trainer_reference import outcome, reference_case, stock_eval_loss, train_docs, training_args, with_lora

SAVE_STEPS = 3  # the checkpoint resumed from: mid-epoch
RESUME_STEPS = 8  # past the end of the first epoch


def _trainer(out: str, model=None, **overrides) -> BlockdiagCPTrainer:
    trainer = BlockdiagCPTrainer(model=tiny_model() if model is None else model,
                                 args=training_args(out, PACKS_PER_STEP, **overrides.pop("args", {})),
                                 train_dataset=train_docs(), cp_size=2, max_tokens=MAX_TOKENS, **overrides)
    return quiet(trainer)


# --------------------------------------------------------------------------- resume


class _StepsRun(TrainerCallback):
    def __init__(self):
        self.count = 0

    def on_step_end(self, args, state, control, **kwargs):
        self.count += 1


def resume_case(rank, world_size, group, out: str, resume: bool):
    """Train RESUME_STEPS steps in `out` (shared by the ranks), saving every SAVE_STEPS; with `resume`,
    a fresh trainer, its model's weights scrambled, from checkpoint-SAVE_STEPS of an earlier run."""
    model, steps = tiny_model(), _StepsRun()
    if resume:  # only the checkpoint's weights can give the uninterrupted run's losses
        torch.manual_seed(7)
        for w in model.parameters():
            torch.nn.init.normal_(w.data, std=0.1)
    with accelerate_env(rank, world_size):
        trainer = _trainer(out, model, args=dict(max_steps=RESUME_STEPS, save_strategy="steps", save_steps=SAVE_STEPS),
                           callbacks=[steps])
        trainer.train(resume_from_checkpoint=f"{out}/checkpoint-{SAVE_STEPS}" if resume else None)
        result = outcome(trainer, {})
    result["logs"] = [h for h in result["logs"] if h["step"] > SAVE_STEPS]
    result["steps_run"] = steps.count
    return result


def test_resume_from_a_checkpoint_continues_the_same_run(gloo, tmp_path):
    steps_per_epoch = len(PackedBatchSampler(dataset_lengths(train_docs()), MAX_TOKENS).epoch_packs()) // PACKS_PER_STEP
    assert SAVE_STEPS % steps_per_epoch and SAVE_STEPS < steps_per_epoch < RESUME_STEPS, steps_per_epoch
    full = gloo(2).run(resume_case, timeout=240, out=str(tmp_path), resume=False)
    resumed = gloo(2).run(resume_case, timeout=240, out=str(tmp_path), resume=True)
    for rank, (got, want) in enumerate(zip(resumed, full)):
        assert (got["steps_run"], want["steps_run"]) == (RESUME_STEPS - SAVE_STEPS, RESUME_STEPS), rank
        assert [h["step"] for h in got["logs"]] == list(range(SAVE_STEPS + 1, RESUME_STEPS + 1)), got["logs"]
        for a, b in zip(got["logs"], want["logs"]):
            assert abs(a["loss"] - b["loss"]) <= LOSS_TOL * abs(b["loss"]), f"rank {rank} step {a['step']}: {a} vs {b}"
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * abs(b["grad_norm"]), f"rank {rank}: {a} vs {b}"
        for name, w in want["weights"].items():
            assert (got["weights"][name] - w).abs().max() <= 1e-5 * w.abs().max(), f"rank {rank}: {name}"


# --------------------------------------------------------------------------- LoRA through PEFT


def lora_case(rank, world_size, group):
    with accelerate_env(rank, world_size) as out:
        model = with_lora(tiny_model())
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer(out, model)
        return outcome(trainer, initial, trainer.train())


def test_lora_adapters_train_like_the_stock_trainer(gloo):
    pytest.importorskip("peft")
    reference = gloo(1).run(reference_case, timeout=120, lora=True)[0]
    trained = {n for n, w in reference["weights"].items() if not w.equal(reference["initial"][n])}
    assert trained and all("lora_" in n for n in trained), sorted(trained)
    for rank, got in enumerate(gloo(2).run(lora_case, timeout=180)):
        assert_same_training(got, reference, f"LoRA rank {rank}", frozen=True)


# --------------------------------------------------------------------------- eval cadence


class _WeightsAtEvaluation(TrainerCallback):
    """(step, weights) at every evaluation."""

    def __init__(self):
        self.seen = []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.seen.append((state.global_step, {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}))


def eval_cadence_case(rank, world_size, group, eval_steps: int):
    weights = _WeightsAtEvaluation()
    with accelerate_env(rank, world_size) as out:
        model = tiny_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer(out, model, args=dict(eval_strategy="steps", eval_steps=eval_steps),
                           eval_dataset=eval_docs(), callbacks=[weights])
        result = outcome(trainer, initial, trainer.train())
    result["evaluations"] = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    result["weights_at_evaluation"] = weights.seen
    return result


def test_eval_strategy_steps_evaluates_sharded_between_steps(gloo):
    reference = gloo(1).run(reference_case, timeout=120)[0]
    for rank, got in enumerate(gloo(2).run(eval_cadence_case, timeout=240, eval_steps=1)):
        assert_same_training(got, reference, f"rank {rank}, evaluating every step")
        assert [step for step, _ in got["evaluations"]] == list(range(1, STEPS + 1)), got["evaluations"]
        assert [step for step, _ in got["weights_at_evaluation"]] == list(range(1, STEPS + 1))
        for (step, loss), (_, weights) in zip(got["evaluations"], got["weights_at_evaluation"]):
            want = stock_eval_loss(eval_docs(), weights=weights)
            assert abs(loss - want) <= 1e-5 * want, f"rank {rank} step {step}: eval_loss {loss} vs {want}"

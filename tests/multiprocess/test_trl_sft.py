"""`BlockdiagCPSFTTrainer` (TRL's SFTTrainer under block-diagonal CP) on real gloo groups.

Evaluation: for a pre-tokenized dataset, a text dataset (tokenized by TRL with a character
tokenizer built in-process), a prompt/completion dataset (completion-only loss) and a
conversational one (assistant_only_loss, the tokenizer's chat template), packed by
TRL (`SFTConfig(packing=True, max_length=256)`, strategy bfd), `evaluate()` runs every pack
through the shard step (each rank's attention sees 256 / cp_size query rows) and `eval_loss`
equals the stock eager model's token-weighted loss on every document alone, computed from the
texts without TRL or the tokenizer. Training: the losses, gradient norms and final weights of
cp = 2 (DDP) equal those of TRL's stock `SFTTrainer` with the stock `sdpa` model on the
same packs (one optimizer step = one epoch, so the data order does not matter; SGD, no
clipping, so a gradient scale error shows).
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import SFTTrainer  # noqa: E402

from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer  # noqa: E402
from helpers.sft import (  # noqa: E402
    ACCUMULATION, MAX_LENGTH, STEPS, char_tokenizer, sft_config, sft_dataset, stock_loss,
)
from helpers.trainer import accelerate_env, counting_attention, quiet, tiny_model  # noqa: E402

EVAL_TOL = 1e-5
LOSS_TOL = 1e-5
GRAD_NORM_TOL = 1e-4
UPDATE_TOL = 1e-3  # max |w_cp - w_ref| / max |w_ref - w_init|, per tensor


# --------------------------------------------------------------------------- evaluation


def eval_case(rank, world_size, group, kind, cp_size, predict=False):
    with counting_attention() as query_rows, accelerate_env(rank, world_size) as out:
        data = sft_dataset(kind)
        trainer = quiet(BlockdiagCPSFTTrainer(
            model=tiny_model(), args=sft_config(out, assistant_only_loss=kind == "conversation"),
            train_dataset=data, eval_dataset=data, processing_class=char_tokenizer(), cp_size=cp_size,
        ))
        metrics = trainer.evaluate()
        predicted = trainer.predict(data) if predict else None
    targets = None if predicted is None else (int((predicted.label_ids != -100).sum()), predicted.metrics["test_loss"])
    return metrics, sorted(set(query_rows)), targets


@pytest.mark.parametrize(
    "kind,world_size,cp_size",
    [("tokens", 2, 2), ("text", 2, 2), ("tokens", 4, 2)],
    ids=["pretokenized-dp1xcp2", "text-dp1xcp2", "pretokenized-dp2xcp2"],
)
def test_sharded_evaluate_equals_stock_loss_per_document(gloo, kind, world_size, cp_size):
    want, _ = stock_loss(kind)
    for rank, (metrics, query_rows, _) in enumerate(gloo(world_size).run(eval_case, timeout=240, kind=kind,
                                                                        cp_size=cp_size)):
        assert abs(metrics["eval_loss"] - want) <= EVAL_TOL * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        assert query_rows == [MAX_LENGTH // cp_size], f"rank {rank}: attention query rows {query_rows}"


@pytest.mark.parametrize("kind", ["prompt_completion", "conversation"])
def test_masked_tokens_carry_no_loss(gloo, kind):
    """TRL masks the prompt (completion-only loss) or every non-assistant token (assistant_only_loss)
    with -100; under CP they stay masked: the eval loss is the stock loss over the completion /
    assistant tokens only, and `predict`'s labels hold exactly those targets."""
    want, targets = stock_loss(kind)
    everything, _ = stock_loss(kind, masked=False)  # the loss with the masked tokens in
    assert abs(want - everything) > 10 * EVAL_TOL * want, "the reference cannot tell the two losses apart"
    for rank, (metrics, query_rows, (labelled, test_loss)) in enumerate(
        gloo(2).run(eval_case, timeout=240, kind=kind, cp_size=2, predict=True)
    ):
        assert abs(metrics["eval_loss"] - want) <= EVAL_TOL * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        assert abs(test_loss - want) <= EVAL_TOL * want, f"rank {rank}: test_loss {test_loss} vs {want}"
        assert labelled == targets, f"rank {rank}: {labelled} labelled positions, {targets} targets"
        assert query_rows == [MAX_LENGTH // 2]


# --------------------------------------------------------------------------- training


def train_case(rank, world_size, group, cp_size, stock=False, **overrides):
    with accelerate_env(rank, world_size) as out:
        model = tiny_model("sdpa" if stock else "blockdiag_cp")
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        kwargs = dict(model=model, args=sft_config(out, **overrides), train_dataset=sft_dataset("text"),
                      processing_class=char_tokenizer())
        trainer = quiet(SFTTrainer(**kwargs) if stock else BlockdiagCPSFTTrainer(**kwargs, cp_size=cp_size))
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.detach().cpu().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
        return {"losses": [h["loss"] for h in logs], "grad_norms": [float(h["grad_norm"]) for h in logs],
                "weights": weights, "initial": initial, "packs": len(trainer.train_dataset)}


@pytest.fixture(scope="module")
def stock_training(gloo):
    return gloo(1).run(train_case, timeout=240, cp_size=1, stock=True)[0]


def test_training_matches_stock_sft_trainer(gloo, stock_training):
    ref = stock_training
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0], ref["losses"]
    assert ref["packs"] <= ACCUMULATION, f"{ref['packs']} packs: an optimizer step must cover the epoch"
    for rank, got in enumerate(gloo(2).run(train_case, timeout=240, cp_size=2)):
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True), start=1):
            assert abs(a - b) <= LOSS_TOL * abs(b), f"rank {rank} step {step}: loss {a} vs stock {b}"
        for step, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"], strict=True), start=1):
            assert abs(a - b) <= GRAD_NORM_TOL * abs(b), f"rank {rank} step {step}: grad norm {a} vs stock {b}"
        for name, w_ref in ref["weights"].items():
            update = (w_ref - ref["initial"][name]).abs().max()
            err = (got["weights"][name] - w_ref).abs().max()
            assert update > 0 and err <= UPDATE_TOL * update, f"rank {rank} {name}: {err:.3e} off, update {update:.3e}"

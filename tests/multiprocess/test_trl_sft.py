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

TRL's token metrics: `mean_token_accuracy` and `entropy` (training logs and `eval_*`) equal
those of the stock eager model on every document alone, averaged as TRL averages them (per
micro-batch over every rank's packs, then over the micro-batches), and `num_tokens` counts every
token of the texts once per epoch, not once per CP rank; the training logs also equal TRL's own
(its fused LM head) in the stock `SFTTrainer`.
"""

from __future__ import annotations

from unittest import mock

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from trl import SFTTrainer  # noqa: E402

from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer  # noqa: E402
from hf_blockdiag_cp.integrations.trl import metrics as trl_metrics  # noqa: E402
from hf_blockdiag_cp.logprobs.capture import PROBE_ROWS  # noqa: E402
from helpers.sft import (  # noqa: E402
    ACCUMULATION, MAX_LENGTH, STEPS, char_tokenizer, reference_documents, sft_config, sft_dataset, stock_loss,
    stock_token_metrics,
)
from helpers.trainer import accelerate_env, counting_attention, counting_lm_head_rows, quiet, tiny_model  # noqa: E402
from helpers.trainer_reference import assert_same_training, stock_eval_loss  # noqa: E402

EVAL_TOL = 1e-5
LOSS_TOL = 1e-5
METRIC_TOL = 1e-5  # mean_token_accuracy and entropy, absolute
MIN_GAP = 1e-5  # the reference's closest top-2 logits: above the kernels' rounding, so no argmax is a tie
GRAD_NORM_TOL = 1e-4


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
        rows = [{"input_ids": r["input_ids"], "seq_lengths": r["seq_lengths"]} for r in trainer.eval_dataset]
    targets = None if predicted is None else (int((predicted.label_ids != -100).sum()), predicted.metrics["test_loss"])
    return metrics, sorted(set(query_rows)), targets, rows


def assert_token_metrics(metrics: dict, want: dict, what: str, prefix: str = "") -> None:
    """TRL's accuracy and entropy in `metrics` (keys `prefix` + name) against the stock reference `want`."""
    assert want["min_gap"] > MIN_GAP, f"{what}: the reference's top-2 logits are {want['min_gap']:.1e} apart"
    for name in ("mean_token_accuracy", "entropy"):
        got = metrics.get(prefix + name)
        assert got is not None and abs(got - want[name]) <= METRIC_TOL, (
            f"{what}: {prefix}{name} is {got}; expected {want[name]} (stock model on every document alone)")


@pytest.mark.parametrize(
    "kind,world_size,cp_size",
    [("tokens", 2, 2), ("text", 2, 2), ("tokens", 4, 2)],
    ids=["pretokenized-dp1xcp2", "text-dp1xcp2", "pretokenized-dp2xcp2"],
)
def test_sharded_evaluate_equals_stock_loss_per_document(gloo, kind, world_size, cp_size):
    """`eval_loss` and TRL's `eval_mean_token_accuracy` / `eval_entropy` (per round of one pack per DP
    replica; at dp = 2 the odd last round has a fill pack, which must weigh 0); no training yet, so
    `eval_num_tokens` (TRL's running count of training tokens) is 0."""
    want, _ = stock_loss(kind)
    for rank, (metrics, query_rows, _, rows) in enumerate(gloo(world_size).run(eval_case, timeout=240, kind=kind,
                                                                              cp_size=cp_size)):
        assert abs(metrics["eval_loss"] - want) <= EVAL_TOL * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        assert query_rows == [MAX_LENGTH // cp_size], f"rank {rank}: attention query rows {query_rows}"
        if world_size // cp_size == 2:
            assert len(rows) % 2 == 1, f"{len(rows)} eval packs: the last dp = 2 round must have a fill pack"
        reference = stock_token_metrics(rows, kind, dp_size=world_size // cp_size)
        assert_token_metrics(metrics, reference, f"rank {rank}", prefix="eval_")
        assert metrics["eval_num_tokens"] == 0, f"rank {rank}: eval_num_tokens {metrics['eval_num_tokens']}; expected 0"


@pytest.mark.parametrize("kind", ["prompt_completion", "conversation"])
def test_masked_tokens_carry_no_loss(gloo, kind):
    """TRL masks the prompt (completion-only loss) or every non-assistant token (assistant_only_loss)
    with -100; under CP they stay masked: the eval loss is the stock loss over the completion /
    assistant tokens only, and `predict`'s labels hold exactly those targets."""
    want, targets = stock_loss(kind)
    everything, _ = stock_loss(kind, masked=False)  # the loss with the masked tokens in
    assert abs(want - everything) > 10 * EVAL_TOL * want, "the reference cannot tell the two losses apart"
    for rank, (metrics, query_rows, (labelled, test_loss), _) in enumerate(
        gloo(2).run(eval_case, timeout=240, kind=kind, cp_size=2, predict=True)
    ):
        assert abs(metrics["eval_loss"] - want) <= EVAL_TOL * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        assert abs(test_loss - want) <= EVAL_TOL * want, f"rank {rank}: test_loss {test_loss} vs {want}"
        assert labelled == targets, f"rank {rank}: {labelled} labelled positions, {targets} targets"
        assert query_rows == [MAX_LENGTH // 2]


# --------------------------------------------------------------------------- training


TOKEN_METRICS = ("num_tokens", "mean_token_accuracy", "entropy")
reduce_rows = trl_metrics.sum_over_world


def train_case(rank, world_size, group, cp_size, stock=False, transformers_version=None, lora=False, pad_token="<pad>",
               **overrides):
    """Train on the text dataset; the logs, weights and TRL's packs, and (under CP) `evaluate()` after training.
    `transformers_version`: the version TRL reads during the run (its branches for older releases);
    `lora`: LoRA adapters through TRL's `peft_config` (the same initial adapters in every run);
    `pad_token`: the tokenizer's (None: none, so TRL pads with EOS)."""
    import contextlib

    import torch
    import transformers
    import trl.trainer.base_trainer as trl_base

    version = transformers.__version__ if transformers_version is None else transformers_version
    with accelerate_env(rank, world_size) as out, contextlib.ExitStack() as patches:
        # Importing some submodules of transformers replaces its module in sys.modules: the version goes
        # to the module TRL holds and to the one imported now (what the library reads).
        for module in {id(m): m for m in (transformers, trl_base.transformers)}.values():
            patches.enter_context(mock.patch.object(module, "__version__", version))
        trl_reads = trl_base.transformers.__version__
        model = tiny_model("sdpa" if stock else "blockdiag_cp")
        kwargs = dict(model=model, args=sft_config(out, **overrides), train_dataset=sft_dataset("text"),
                      processing_class=char_tokenizer(pad_token))
        if lora:
            from peft import LoraConfig

            torch.manual_seed(1)  # TRL adds the adapters before the Trainer sets its seed
            kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        trainer = quiet(SFTTrainer(**kwargs) if stock else
                        BlockdiagCPSFTTrainer(**kwargs, eval_dataset=sft_dataset("text"), cp_size=cp_size))
        initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}  # with TRL's adapters
        reductions = []  # rows of TRL's token metrics per all-reduce

        def counting(values, world_size):
            reductions.append(values.shape[0])
            return reduce_rows(values, world_size)

        with mock.patch.object(trl_metrics, "sum_over_world", counting), counting_lm_head_rows(trainer.model) as head_rows:
            trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.detach().cpu().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
        rows = {name: [{"input_ids": r["input_ids"], "seq_lengths": r["seq_lengths"]} for r in data]
                for name, data in (("train", trainer.train_dataset), ("eval", trainer.eval_dataset))
                if data is not None}
        evaluated = None if stock else trainer.evaluate()
        return {"losses": [h["loss"] for h in logs], "grad_norms": [float(h["grad_norm"]) for h in logs],
                "weights": weights, "initial": initial, "packs": len(trainer.train_dataset), "rows": rows,
                "metrics": [{k: h.get(k) for k in TOKEN_METRICS} for h in logs], "eval": evaluated,
                "reductions": reductions, "trl_reads": trl_reads, "head_rows": head_rows}


@pytest.fixture(scope="module")
def stock_training(gloo):
    return gloo(1).run(train_case, timeout=240, cp_size=1, stock=True)[0]


@pytest.fixture(scope="module")
def cp_training(gloo):
    return gloo(2).run(train_case, timeout=240, cp_size=2)


def test_training_matches_stock_sft_trainer(cp_training, stock_training):
    ref = stock_training
    assert len(ref["losses"]) == STEPS and ref["losses"][-1] < ref["losses"][0], ref["losses"]
    assert ref["packs"] <= ACCUMULATION, f"{ref['packs']} packs: an optimizer step must cover the epoch"
    for rank, got in enumerate(cp_training):
        assert_same_training(got, ref, f"rank {rank}", steps=STEPS)


def test_training_builds_no_logits_of_the_shard(cp_training):
    """cp = 2: the training loss and TRL's token metrics come from the chunked log-prob head, as TRL's own
    come from its fused LM head: the model's output embedding projects at most the head's probe rows,
    never a shard's [tokens, vocab] logits (test_training_matches_stock_sft_trainer: the same training)."""
    for rank, got in enumerate(cp_training):
        assert got["head_rows"] and max(got["head_rows"]) <= PROBE_ROWS < MAX_LENGTH // 2, (rank, got["head_rows"])


def test_lora_through_peft_config_trains_like_the_stock_sft_trainer(gloo):
    """TRL's `peft_config`: cp = 2 trains the adapters as the stock SFTTrainer does (losses, grad
    norms, adapter weights), the base weights untouched."""
    pytest.importorskip("peft")
    ref = gloo(1).run(train_case, timeout=240, cp_size=1, stock=True, lora=True)[0]
    trained = {n for n, w in ref["weights"].items() if not w.equal(ref["initial"][n])}
    assert trained and all("lora_" in n for n in trained), sorted(trained)
    for rank, got in enumerate(gloo(2).run(train_case, timeout=240, cp_size=2, lora=True)):
        assert_same_training(got, ref, f"LoRA rank {rank}", steps=STEPS, frozen=True)


def test_training_under_trls_branch_for_transformers_before_5_19(gloo, stock_training):
    """TRL on transformers < 5.19 turns `loss_is_scaled_for_ga` into compute_loss_func = a string and
    model_accepts_loss_kwargs = False (the H200's transformers 5.17 raised at construction): built while
    TRL reads 5.17.0, the trainer trains at cp = 1 with the stock SFTTrainer's losses over the
    accumulated packs (a gradient-accumulation scale error would show)."""
    (got,) = gloo(1).run(train_case, timeout=240, cp_size=1, transformers_version="5.17.0")
    assert got["trl_reads"] == "5.17.0", got["trl_reads"]
    for step, (a, b) in enumerate(zip(got["losses"], stock_training["losses"], strict=True), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"step {step}: loss {a} vs stock {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], stock_training["grad_norms"], strict=True), start=1):
        assert abs(a - b) <= GRAD_NORM_TOL * abs(b), f"step {step}: grad norm {a} vs stock {b}"


def test_training_and_eval_log_trl_token_metrics(cp_training, stock_training):
    """cp = 2: every training log has `num_tokens` = steps x the tokens of the texts (each document once
    per epoch, not once per CP rank), the first step's accuracy and entropy are the stock model's on
    every document alone (every step's equal TRL's own in the stock SFTTrainer), and `evaluate()` after
    training gives the trained stock model's, with `eval_num_tokens` the tokens trained on."""
    epoch_tokens = sum(len(ids) for ids, _ in reference_documents("text"))
    at_start = stock_token_metrics(cp_training[0]["rows"]["train"], "text")
    for rank, got in enumerate(cp_training):
        # one all-reduce per log, of one row per micro-batch (every pack of the epoch: one step is one epoch)
        assert got["reductions"] == [len(got["rows"]["train"])] * STEPS, (rank, got["reductions"])
        assert [m["num_tokens"] for m in got["metrics"]] == [epoch_tokens * step for step in range(1, STEPS + 1)], (
            f"rank {rank}: num_tokens {[m['num_tokens'] for m in got['metrics']]}; expected {epoch_tokens} per step")
        assert_token_metrics(got["metrics"][0], at_start, f"rank {rank} step 1")
        for step, (mine, stock) in enumerate(zip(got["metrics"], stock_training["metrics"], strict=True), start=1):
            for name in TOKEN_METRICS:
                assert abs(mine[name] - stock[name]) <= METRIC_TOL, (
                    f"rank {rank} step {step}: {name} is {mine[name]}; stock SFTTrainer logs {stock[name]}")
        trained = stock_token_metrics(got["rows"]["eval"], "text", weights=got["weights"])
        assert trained["mean_token_accuracy"] > 0.1, f"the trained reference is too weak a check: {trained}"
        assert_token_metrics(got["eval"], trained, f"rank {rank} evaluate", prefix="eval_")
        assert got["eval"]["eval_num_tokens"] == epoch_tokens * STEPS, f"rank {rank}: {got['eval']}"


def test_eos_as_pad_token_trains_like_the_stock_sft_trainer(gloo):
    """A tokenizer without a pad token (TRL pads with EOS; every text ends in EOS): cp = 2 takes the stock
    SFTTrainer's optimizer step over the epoch (loss, grad norm, weights, TRL's token metrics), and
    `evaluate()` after it gives the trained stock model's loss on every document alone."""
    import torch

    ref = gloo(1).run(train_case, timeout=240, cp_size=1, stock=True, pad_token=None, max_steps=1)[0]
    for rank, got in enumerate(gloo(2).run(train_case, timeout=240, cp_size=2, pad_token=None, max_steps=1)):
        assert_same_training(got, ref, f"pad = EOS rank {rank}", steps=1)
        for name in TOKEN_METRICS:
            assert abs(got["metrics"][0][name] - ref["metrics"][0][name]) <= METRIC_TOL, (
                f"rank {rank}: {name} is {got['metrics'][0][name]}; stock SFTTrainer logs {ref['metrics'][0][name]}")
        docs = [{"input_ids": doc.tolist()} for row in got["rows"]["eval"]
                for doc in torch.tensor(row["input_ids"]).split(list(row["seq_lengths"]))]
        trained = stock_eval_loss(docs, weights=got["weights"])
        assert abs(got["eval"]["eval_loss"] - trained) <= EVAL_TOL * trained, f"rank {rank}: {got['eval']} vs {trained}"

"""Sharded `evaluate()` / `predict()` of `BlockdiagCPTrainer` in the stock Trainer's precision. Under
`TrainingArguments(bf16=True)` the forward runs under the same autocast as the stock Trainer's
evaluation (which gets it from accelerate wrapping the model's forward), so on an fp32 model the
sharded eval loss at cp = 2 is the stock Trainer's bf16 eval loss, not its fp32 one; with
`bf16_full_eval=True` the model is cast to bf16 for an evaluation outside training, as the stock
Trainer does; without either it stays the fp32 loss.

Reference: the stock Trainer with the stock `sdpa` model evaluating the same documents as one
pack in Transformers' packed convention (position ids restarting per document, labels masked at
document starts), with bf16 off and on. A larger initialiser range than the other tests' makes
the bf16 rounding visible in the loss (about 1e-4 relative; the kernels differ by about 1e-7).
"""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from hf_blockdiag_cp.data import PackedExamples
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.reference import VOCAB
from helpers.trainer import accelerate_env, quiet, tiny_model, trainer_settings

MAX_TOKENS = 352  # every eval document in one pack: the stock eval loss is then token-weighted too
INIT_RANGE = 0.2
FP32_TOL = 1e-5  # relative: sharded vs stock, fp32
BF16_SHARE = 0.1  # sharded bf16 vs stock bf16, as a share of the stock run's own bf16 - fp32 difference


def eval_docs() -> list[dict]:
    g = torch.Generator().manual_seed(11)
    lengths = [2, 5, 9, 13, 17, 23, 31, 40, 47, 3, 8, 19, 26, 6, 1, 11, 44]
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


# TrainingArguments of each precision: fp32, bf16 autocast, and the model cast to bf16 for evaluation.
MODES = {"fp32": {}, "bf16": {"bf16": True}, "bf16_full_eval": {"bf16_full_eval": True}}


def arguments(output_dir: str, mode: str) -> TrainingArguments:
    return TrainingArguments(**{**trainer_settings(output_dir, 1, 1), **MODES[mode]})


class _PackTrainer(Trainer):
    """The stock Trainer; only its eval data is fixed: the one pack."""

    def __init__(self, *args, pack: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self._pack = pack

    def get_eval_dataloader(self, eval_dataset=None):
        return torch.utils.data.DataLoader([self._pack], batch_size=None)


def stock_case(rank, world_size, group):
    full = BlockdiagCPCollator(MAX_TOKENS)(list(PackedExamples(eval_docs())))
    labels = full["labels"].clone()
    labels[full["position_ids"] == 0] = -100  # no target crosses into the next document
    pack = {"input_ids": full["input_ids"], "labels": labels, "position_ids": full["position_ids"]}
    losses = {}
    for mode in MODES:
        with accelerate_env(rank, world_size) as out:
            trainer = _PackTrainer(model=tiny_model("sdpa", initializer_range=INIT_RANGE), args=arguments(out, mode),
                                   eval_dataset=[pack], pack=pack)
            losses[mode] = quiet(trainer).evaluate()["eval_loss"]
    return losses


def sharded_case(rank, world_size, group):
    """Per precision: sharded eval_loss, predict's test_loss, the dtypes of the LM head's outputs."""
    results = {}
    for mode in MODES:
        with accelerate_env(rank, world_size) as out:
            model = tiny_model(initializer_range=INIT_RANGE)
            dtypes = set()
            model.lm_head.register_forward_hook(lambda module, args, output: dtypes.add(output.dtype))
            trainer = quiet(BlockdiagCPTrainer(model=model, args=arguments(out, mode), train_dataset=eval_docs(),
                                               eval_dataset=eval_docs(), cp_size=2, max_tokens=MAX_TOKENS))
            results[mode] = (trainer.evaluate()["eval_loss"], trainer.predict(eval_docs()).metrics["test_loss"], dtypes)
    return results


def test_sharded_evaluate_runs_in_the_stock_trainers_precision(gloo):
    stock = gloo(1).run(stock_case, timeout=180)[0]
    effects = {mode: abs(stock[mode] - stock["fp32"]) for mode in MODES if mode != "fp32"}
    for mode, effect in effects.items():
        assert effect > 1e-5 * stock["fp32"], f"{mode} does not change the stock eval loss ({stock}): nothing to test"
    for rank, results in enumerate(gloo(2).run(sharded_case, timeout=180)):
        for mode, (eval_loss, test_loss, dtypes) in results.items():
            want = stock[mode]
            for name, got in (("eval_loss", eval_loss), ("test_loss", test_loss)):
                bound = BF16_SHARE * effects[mode] if mode in effects else FP32_TOL * want
                assert abs(got - want) <= bound, (
                    f"rank {rank}, {mode}: {name} {got}; expected the stock Trainer's {mode} eval loss {want} "
                    f"within {bound:.2e} (the stock fp32 loss is {stock['fp32']})")
            want_dtype = torch.float32 if mode == "fp32" else torch.bfloat16
            assert dtypes == {want_dtype}, f"rank {rank}, {mode}: LM head output dtypes {dtypes}"

"""I2 through `transformers.Trainer`: `BlockdiagCPTrainer` at dp=1 x cp=2, dp=2 x cp=1 and
dp=2 x cp=2 logs the same loss and grad norm at every step and ends with the same weights
as the *stock* Trainer with the *stock* `sdpa` model on the same packs in one process (labels
masked at document starts, position ids restarting per document: Transformers' own packed
path). SGD without clipping, so a gradient scale error shows in the weights (Adam would hide
it). The first log names the kernel, exchange and layout the steps ran, once. Plus the Trainer's
setup checks, which must raise on every rank. The callback's own checks
and the token meter, in one process: unit/test_trainer_parts.py.

The Trainers run inside the shared gloo pool: accelerate's PartialState joins an already
initialised process group when RANK/WORLD_SIZE/LOCAL_RANK are set and `use_cpu=True`.
Also sharded evaluation: `evaluate()` under CP equals the stock model's token-weighted loss on every
eval document unpacked; with an eval document longer than a pack it equals the loss on the pieces,
counts the split document in `eval_split_documents` and warns.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import TrainerCallback

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from hf_blockdiag_cp.data import PackedBatchSampler, dataset_lengths
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from hf_blockdiag_cp.logprobs.capture import PROBE_ROWS
from hf_blockdiag_cp.planning import PAIR_COUNT
from hf_blockdiag_cp.step import SHARD_KEY
from helpers.reference import VOCAB
from helpers.trainer import accelerate_env, checkpointing_settings, counting_attention, counting_lm_head_rows, tiny_model
from helpers.trainer import quiet as _quiet
from helpers.trainer_reference import (
    LOSS_TOL,
    MAX_TOKENS,
    PACKS_PER_STEP,
    STEPS,
    assert_same_training,
    eval_docs,
    outcome,
    reference_case,
    stock_eval_loss,
    train_docs,
    training_args,
)

# --------------------------------------------------------------------------- block-diagonal CP runs


def cp_case(rank, world_size, group, cp_size, arg_overrides, balanced=False):
    dp_size = world_size // cp_size
    # PAIR_COUNT: the tiny packs fit in one kernel tile, where the default cost keeps contiguous chunks.
    cp_config = bdcp.CPConfig("dense", layout="balanced", kernel_cost=PAIR_COUNT) if balanced else None
    with accelerate_env(rank, world_size) as out:
        model = tiny_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = BlockdiagCPTrainer(
            model=model,
            args=training_args(out, PACKS_PER_STEP // dp_size, **arg_overrides),
            train_dataset=train_docs(),
            cp_size=cp_size,
            max_tokens=MAX_TOKENS,
            cp_config=cp_config,
        )
        with counting_lm_head_rows(model) as head_rows:
            output = _quiet(trainer).train()
        result = outcome(trainer, initial, output)
        result["head_rows"] = head_rows
        layouts = [trainer._local_batch(batch)[SHARD_KEY].layout for batch in trainer.get_train_dataloader()]
        result["permuted_packs"] = sum(
            not torch.equal(lay.slot_positions.reshape(-1), torch.arange(lay.padded_seq_len)) for lay in layouts
        )
        return result


@pytest.fixture(scope="module")
def reference(gloo):
    return gloo(1).run(reference_case, timeout=120)[0]


def _logged_choices(got: dict) -> list[dict]:
    """The step choices of every training log that has them; they must come with the first log."""
    keys = ("cp_attn_kernel", "cp_kv_exchange", "cp_layout")
    assert "cp_attn_kernel" in got["logs"][0], got["logs"][0]
    return [{k: h[k] for k in keys} for h in got["logs"] if any(k in h for k in keys)]


@pytest.mark.parametrize(
    "world_size,cp_size,arg_overrides",
    [
        (2, 2, {}),
        (2, 1, {}),
        (4, 2, {}),
        # The Trainer's own token counting then stays per rank; ours must not depend on it.
        (2, 2, {"average_tokens_across_devices": False}),
    ],
    ids=["dp1xcp2", "dp2xcp1", "dp2xcp2", "dp1xcp2-no-token-averaging"],
)
def test_trainer_matches_stock_trainer(gloo, reference, world_size, cp_size, arg_overrides):
    results = gloo(world_size).run(cp_case, timeout=180, cp_size=cp_size, arg_overrides=arg_overrides)
    for rank, got in enumerate(results):
        assert_same_training(got, reference, f"world {world_size} cp {cp_size} rank {rank}")
        last = got["logs"][-1]
        per_rank = [last[f"cp_real_tokens_rank{r}"] for r in range(world_size)]
        assert sum(per_rank) > 0 and 0 < last["cp_packing_efficiency"] <= 1 and last["cp_tokens_per_second"] > 0
        # What the steps ran, once, in the first log (on CPU `auto` runs the dense kernel).
        assert _logged_choices(got) == [{"cp_attn_kernel": "dense", "cp_kv_exchange": "allgather", "cp_layout": "contiguous"}]


def test_trainer_loss_builds_no_logits_of_the_shard(gloo, reference):
    """dp = 2 x cp = 1 (one rank per core, the cheapest CP step): the loss comes from the chunked
    log-prob head, so the model's output embedding projects at most the head's probe rows, never a
    shard's [tokens, vocab] logits, and training is still exactly the stock Trainer's."""
    for rank, got in enumerate(gloo(2).run(cp_case, timeout=180, cp_size=1, arg_overrides={})):
        assert_same_training(got, reference, f"head rank {rank}")
        assert got["head_rows"] and max(got["head_rows"]) <= PROBE_ROWS < MAX_TOKENS, (rank, got["head_rows"])


def test_trainer_with_a_balanced_cp_config_matches_stock_trainer(gloo, reference):
    """`cp_config` reaches the shard step: its balanced layout permutes the packs, and training is
    still exactly the stock Trainer's."""
    results = gloo(2).run(cp_case, timeout=180, cp_size=2, arg_overrides={}, balanced=True)
    for rank, got in enumerate(results):
        assert_same_training(got, reference, f"balanced rank {rank}")
        assert got["permuted_packs"] > 0, "no pack was laid out by the balanced strategy"
        assert _logged_choices(got) == [{"cp_attn_kernel": "dense", "cp_kv_exchange": "allgather", "cp_layout": "balanced"}]


def test_final_train_loss_is_the_loss_of_the_whole_pack(gloo, reference):
    """Steps not yet logged when training ends enter `train_loss` too: under CP that remainder must
    be averaged over the ranks like the logged losses, or each rank reports its own shard's loss."""
    results = gloo(2).run(cp_case, timeout=180, cp_size=2, arg_overrides={"logging_steps": STEPS + 1})
    want, _ = reference["train_loss"]
    for rank, got in enumerate(results):
        returned, logged = got["train_loss"]
        assert not got["losses"], "the case must log no step loss before the end"
        for what, value in (("returned", returned), ("logged", logged)):
            assert abs(value - want) <= LOSS_TOL * abs(want), f"rank {rank}: {what} train_loss {value} vs reference {want}"


# --------------------------------------------------------------------------- torch_compile


class _GraphsCompiled(TrainerCallback):
    """Dynamo's running total of graphs compiled after every optimizer step. (Its frame count is no
    measure here: DDP logs its bucket rebuild in the second step from inside the compiled call, and
    dynamo counts those logging frames, which hold no graph.)"""

    def __init__(self):
        self.totals = []

    def on_step_end(self, args, state, control, **kwargs):
        from hf_blockdiag_cp.compat.torch import compile_counters

        self.totals.append(compile_counters()["graphs_compiled"])


# The compiled runs: their TrainingArguments beyond the common ones.
COMPILED_RUNS = {"plain": {}, "activation checkpointing": checkpointing_settings(use_reentrant=False)}


def compiled_case(rank, world_size, group):
    """The dp1 x cp2 run with `torch_compile=True` (aot_eager: inductor is slow on this CPU), each of
    COMPILED_RUNS in turn in one process, as a user's second run would: the second runs the graphs the
    first compiled where dynamo's guards let it (the decoder layers' pieces), and compiles the rest."""
    torch.compiler.reset()
    return {name: _compiled_run(rank, world_size, overrides) for name, overrides in COMPILED_RUNS.items()}


def _compiled_run(rank, world_size, arg_overrides):
    from hf_blockdiag_cp.compat.transformers import checkpoint_function
    from hf_blockdiag_cp.integrations.compile import CompiledCheckpointBody

    totals = _GraphsCompiled()
    with accelerate_env(rank, world_size) as out:
        model = tiny_model()
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        args = training_args(out, PACKS_PER_STEP, torch_compile=True, torch_compile_backend="aot_eager", **arg_overrides)
        trainer = BlockdiagCPTrainer(model=model, args=args, train_dataset=train_docs(), cp_size=2, max_tokens=MAX_TOKENS,
                                     callbacks=[totals])
        output = _quiet(trainer).train()
        result = outcome(trainer, initial, output)
        result["totals"] = totals.totals
        result["eval"] = trainer.evaluate(eval_docs())  # sharded, through the compiled model
        result["compiled_bodies"] = sum(isinstance(checkpoint_function(layer), CompiledCheckpointBody)
                                        for layer in model.model.layers)
        result["wrapped"] = type(trainer.model_wrapped).__name__
    return result


def test_trainer_torch_compile_matches_stock_trainer(gloo, reference):
    """`torch_compile=True`, without and with activation checkpointing: the compiled model trains
    exactly as the stock Trainer does, no step after the first compiles anything (every step has new
    packs), and its sharded `evaluate` is the trained stock model's per-document loss; with activation
    checkpointing, every decoder layer's body is compiled inside its checkpoint."""
    layers = tiny_model().config.num_hidden_layers
    for rank, runs in enumerate(gloo(2).run(compiled_case, timeout=300)):
        for name, got in runs.items():
            what = f"compiled rank {rank} {name}"
            assert_same_training(got, reference, what)
            assert got["wrapped"] == "OptimizedModule", got["wrapped"]
            first, *rest = got["totals"]
            assert first > 0 and rest == [first] * len(rest), f"{what}: graphs compiled after the first step: {got['totals']}"
            assert got["compiled_bodies"] == (layers if COMPILED_RUNS[name] else 0)
            want = stock_eval_loss(eval_docs(), weights=got["weights"])
            assert abs(got["eval"]["eval_loss"] - want) <= 1e-5 * want, f"{what}: eval_loss {got['eval']['eval_loss']} vs {want}"


# --------------------------------------------------------------------------- setup checks


def setup_error_case(rank, world_size, group, mistake):
    """Build (and train) a BlockdiagCPTrainer with one mistake; the error text, or None if nothing raised."""
    with accelerate_env(rank, world_size) as out:
        attn = "sdpa" if mistake == "attn" else "blockdiag_cp"
        model = tiny_model(attn)
        overrides, kwargs = {}, dict(cp_size=2, max_tokens=MAX_TOKENS)
        if mistake == "use_cache":  # the Trainer copies TrainingArguments.use_cache into model.config
            overrides["use_cache"] = True
        elif mistake == "batch_size":
            overrides["per_device_train_batch_size"] = 2
        elif mistake == "reentrant":
            overrides.update(checkpointing_settings(use_reentrant=True))
        elif mistake == "cp_size":
            kwargs["cp_size"] = 3
            kwargs["max_tokens"] = 6 * 8
        elif mistake == "accelerate_cp":
            from accelerate import ParallelismConfig

            overrides["parallelism_config"] = ParallelismConfig(cp_size=2)
        elif mistake == "collator":
            kwargs["data_collator"] = BlockdiagCPCollator(MAX_TOKENS)
        elif mistake == "dataset_per_rank":
            kwargs["train_dataset"] = train_docs()[: 10 + 10 * rank]
        try:
            trainer = BlockdiagCPTrainer(model=model, args=training_args(out, 1, **overrides), **{"train_dataset": train_docs(), **kwargs})
            _quiet(trainer).train()
        except (ValueError, RuntimeError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return None


@pytest.mark.parametrize(
    "mistake,expected",
    [
        ("attn", "attention implementation is 'sdpa'; expected 'blockdiag_cp'"),
        ("use_cache", "use_cache is True; expected False"),
        ("batch_size", "per_device_train_batch_size is 2; expected 1"),
        ("reentrant", "use_reentrant=True; expected {'use_reentrant': False}"),
        ("cp_size", "world size 2 is not divisible by cp_size=3"),
        ("accelerate_cp", "TrainingArguments parallelism_config has cp_enabled; expected no context/sequence/tensor"),
        ("collator", "data_collator must not be given"),
        ("dataset_per_rank", "ranks disagree on the number of packs per epoch"),
    ],
)
def test_setup_mistakes_raise_on_every_rank(gloo, mistake, expected):
    results = gloo(2).run(setup_error_case, timeout=120, mistake=mistake)
    for rank, message in enumerate(results):
        assert message is not None and expected in message, f"rank {rank}: {message!r}"


# --------------------------------------------------------------------------- sharded evaluation


def eval_case(rank, world_size, group, cp_size):
    with counting_attention() as query_rows, accelerate_env(rank, world_size) as out:
        trainer = BlockdiagCPTrainer(
            model=tiny_model(), args=training_args(out, 1), train_dataset=train_docs(), eval_dataset=eval_docs(),
            cp_size=cp_size, max_tokens=MAX_TOKENS,
        )
        metrics = _quiet(trainer).evaluate()
    return metrics, query_rows


def test_eval_docs_need_a_fill_pack_at_dp2():
    packs = PackedBatchSampler(dataset_lengths(eval_docs()), MAX_TOKENS, shuffle=False).epoch_packs()
    assert len(packs) % 2 == 1
    assert [PackedBatchSampler(dataset_lengths(eval_docs()), MAX_TOKENS, shuffle=False, dp_size=2, dp_rank=r)
            .replica_repeats() for r in (0, 1)] == [[False] * (len(packs) // 2 + 1), [False] * (len(packs) // 2) + [True]]


@pytest.mark.parametrize("world_size,cp_size", [(2, 2), (4, 2)], ids=["dp1xcp2", "dp2xcp2"])
def test_sharded_evaluate_matches_stock_per_document_loss(gloo, world_size, cp_size):
    want = stock_eval_loss(eval_docs())
    results = gloo(world_size).run(eval_case, timeout=180, cp_size=cp_size)
    real_tokens = sum(len(d["input_ids"]) for d in eval_docs())
    for rank, (metrics, query_rows) in enumerate(results):
        assert abs(metrics["eval_loss"] - want) <= 1e-5 * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        assert metrics["eval_tokens"] == real_tokens  # every eval token once: nothing dropped, fill packs weigh 0
        # Every eval forward went through blockdiag_cp, each rank holding 1/cp_size of a pack.
        assert query_rows and set(query_rows) == {MAX_TOKENS // cp_size}, f"rank {rank}: {sorted(set(query_rows))}"


def split_eval_case(rank, world_size, group, docs):
    with accelerate_env(rank, world_size) as out, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = BlockdiagCPTrainer(model=tiny_model(), args=training_args(out, 1), train_dataset=train_docs(),
                                     eval_dataset=docs, cp_size=2, max_tokens=MAX_TOKENS)
        metrics = _quiet(trainer).evaluate()
    return metrics, [str(w.message) for w in caught]


def test_evaluate_counts_split_documents_and_warns_that_the_loss_is_the_pieces(gloo):
    g = torch.Generator().manual_seed(5)
    docs = eval_docs() + [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in (MAX_TOKENS + 9, 130)]
    want = stock_eval_loss(docs, piece=MAX_TOKENS)
    for rank, (metrics, messages) in enumerate(gloo(2).run(split_eval_case, timeout=180, docs=docs)):
        assert metrics["eval_split_documents"] == 2, (rank, metrics)
        assert abs(metrics["eval_loss"] - want) <= 1e-5 * want, f"rank {rank}: eval_loss {metrics['eval_loss']} vs {want}"
        about_loss = [m for m in messages if "eval_loss is the loss of the pieces" in m]
        assert len(about_loss) == 1 and about_loss[0].startswith(f"2 of {len(docs)} eval documents"), messages


def predict_case(rank, world_size, group, cp_size):
    with accelerate_env(rank, world_size) as out:
        trainer = BlockdiagCPTrainer(
            model=tiny_model(), args=training_args(out, 1), train_dataset=train_docs(), cp_size=cp_size,
            max_tokens=MAX_TOKENS,
        )
        result = _quiet(trainer).predict(eval_docs())
    return result.predictions, result.label_ids, result.metrics


@pytest.mark.parametrize("world_size,cp_size", [(2, 2), (4, 2)], ids=["dp1xcp2", "dp2xcp2"])
def test_sharded_predict_returns_every_packs_logits_in_pack_order(gloo, world_size, cp_size):
    docs = eval_docs()
    packs = PackedBatchSampler(dataset_lengths(docs), MAX_TOKENS, shuffle=False).epoch_packs()
    model = tiny_model("eager").eval()
    with torch.no_grad():
        stock = [model(input_ids=torch.tensor(d["input_ids"])[None]).logits[0] for d in docs]
    for rank, (predictions, label_ids, metrics) in enumerate(gloo(world_size).run(predict_case, timeout=180, cp_size=cp_size)):
        assert predictions.shape == (len(packs), MAX_TOKENS, VOCAB), (rank, predictions.shape)
        assert abs(metrics["test_loss"] - stock_eval_loss(docs)) <= 1e-5 * metrics["test_loss"]
        for p, items in enumerate(packs):
            want = torch.cat([stock[i] for i in items])
            ids = torch.cat([torch.tensor(docs[i]["input_ids"]) for i in items])
            n = want.shape[0]
            torch.testing.assert_close(torch.from_numpy(predictions[p, :n]), want, rtol=1e-5, atol=1e-5)
            # label i is the token logit row i predicts: the next token of the same document, else -100
            ends = torch.cumsum(torch.tensor([len(docs[i]["input_ids"]) for i in items]), 0) - 1
            expected = torch.cat([ids[1:], torch.tensor([-100])])
            expected[ends] = -100
            assert label_ids[p, :n].tolist() == expected.tolist()
            assert (label_ids[p, n:] == -100).all()

"""One hybrid family per token-mixer kind trains exactly through the Trainers at cp = 2 (I1, I2, I5).

Gated delta rule (qwen3_5), Mamba2 / SSD (nemotron_h), short gated convolution (lfm2), KDA
(kimi_linear), Mamba1 (jamba): one optimizer step of `BlockdiagCPTrainer` with activation
checkpointing, under FSDP2 (`fully_shard` through accelerate, as `TrainingArguments(fsdp=True,
fsdp_config={"version": 2})` sets it up) and under DDP, against the stock eager model run on
each document alone in fp32: the logged loss and every full gradient before the optimizer step.
The step's two packs put a 45-token document across both ranks (many Mamba2 scan chunks) and
leave the second rank of the other pack only padding, so the recompute, the state passing and
FSDP2's reduce-scatter of every mixer parameter see both. Plus TRL's `SFTTrainer` with packing
(`BlockdiagCPSFTTrainer`, FSDP2 and DDP, checkpointing) on lfm2, against the same per-document
reference of TRL's tokenized texts: the stock SFTTrainer, the reference of test_trl_sft.py, is
no reference here, as Transformers lets these mixers cross documents on a packed row.

accelerate runs FSDP only on accelerator devices: on the CPU it drops the FSDP plugin and wraps
the model in DDP. `helpers.fsdp.fsdp_on_cpu` lets it keep the plugin for CPU processes, so that the
Trainer takes its FSDP2 path (accelerate's `fully_shard` per decoder layer, then the root) on gloo.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

from hf_blockdiag_cp.data import PackedBatchSampler
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from hf_blockdiag_cp.step import SHARD_KEY
from helpers.fsdp import fsdp_on_cpu
from helpers.model_zoo import build_hybrid_pair
from helpers.reference import make_docs, reference_loss_and_grads, rel_err
from helpers.trainer import accelerate_env, checkpointing_settings, quiet, trainer_settings

TOL = 1e-4
FAMILIES = ("qwen3_5", "nemotron_h", "lfm2", "kimi_linear", "jamba")  # one per mixer kind
MAX_TOKENS = 64  # 32 rows per rank
# First-fit decreasing packs [45, 6, 3, 1] (the 45 tokens over both ranks) and [20] (rank 1: padding only).
LENGTHS = [45, 20, 6, 3, 1]


class _GradientsBeforeStep(TrainerCallback):
    """Every full gradient when the optimizer is about to step (FSDP2's sharded ones gathered: a
    collective, which every rank runs here in the same parameter order)."""

    def __init__(self):
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for n, p in model.named_parameters() if p.grad is not None}


def _errors(got_loss: float, grads: dict, ref_loss, ref_grads) -> dict[str, float]:
    """Relative error of the loss and of every gradient the reference has (a missing one counts as 1)."""
    errors = {"loss": rel_err(torch.tensor(got_loss), ref_loss)}
    for name, want in ref_grads.items():
        errors[name] = rel_err(grads[name], want) if name in grads else 1.0
    return errors


def _pack_shapes(trainer) -> list[tuple[list[int], bool]]:
    """Per pack of the epoch: real tokens per rank, and whether a document lies on both ranks."""
    shapes = []
    for batch in trainer.get_train_dataloader():
        layout = trainer._local_batch(batch)[SHARD_KEY].layout
        held = layout.document_ids[layout.slot_positions]  # [G, L] document of every slot, 0 = padding
        shared = set(held[0][held[0] > 0].tolist()) & set(held[1][held[1] > 0].tolist())
        shapes.append((layout.real_tokens_per_rank(), bool(shared)))
    return shapes


def _engine(engine: str) -> tuple[dict, contextlib.AbstractContextManager]:
    """(TrainingArguments fields, context to build and train in) of `engine`: "fsdp2" or "ddp"
    (the Trainer's default over several processes); activation checkpointing on with both."""
    args = checkpointing_settings(use_reentrant=False)
    if engine == "ddp":
        return args, contextlib.nullcontext()
    return {**args, "fsdp": True, "fsdp_config": {"version": 2}}, fsdp_on_cpu()


def _trained(trainer, gradients: _GradientsBeforeStep, ref_loss, ref_grads) -> tuple[dict, str]:
    """Train one optimizer step: (errors against the reference, the type the Trainer wrapped the model in)."""
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    return _errors(log["loss"], gradients.grads, ref_loss, ref_grads), type(trainer.model_wrapped).__name__


def trainer_case(rank, world_size, group, family, engine):
    """One optimizer step over the epoch's packs: (errors, wrapper type, pack shapes)."""
    ref, model = build_hybrid_pair(family)
    docs = make_docs(LENGTHS, seed=2)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs, group=group)
    packs = len(PackedBatchSampler(LENGTHS, MAX_TOKENS).epoch_packs())
    gradients = _GradientsBeforeStep()
    fields, context = _engine(engine)
    with accelerate_env(rank, world_size) as out, context:
        args = TrainingArguments(**trainer_settings(out, packs, 1), **fields)
        trainer = quiet(BlockdiagCPTrainer(model=model, args=args, train_dataset=[{"input_ids": d.tolist()} for d in docs],
                                           cp_size=2, max_tokens=MAX_TOKENS, callbacks=[gradients]))
        errors, wrapped = _trained(trainer, gradients, ref_loss, ref_grads)
        return errors, wrapped, _pack_shapes(trainer)


def _assert_engine(wrapped: str, engine: str) -> None:
    assert wrapped.startswith("FSDP") if engine == "fsdp2" else wrapped == "DistributedDataParallel", (engine, wrapped)


def _assert_exact(errors: dict, what: str) -> None:
    worst = max(errors, key=errors.get)
    assert errors["loss"] <= TOL, f"{what}: loss relative error {errors['loss']:.2e}"
    assert errors[worst] <= TOL, f"{what}: {worst} relative error {errors[worst]:.2e}"


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
@pytest.mark.parametrize("family", FAMILIES)
def test_trainer_step_matches_per_document_reference(gloo, family, engine):
    for rank, (errors, wrapped, shapes) in enumerate(gloo(2).run(trainer_case, timeout=180, family=family, engine=engine)):
        _assert_engine(wrapped, engine)
        assert any(0 in tokens for tokens, _ in shapes), f"no pack leaves a rank only padding: {shapes}"
        assert any(shared for _, shared in shapes), f"no document lies on both ranks: {shapes}"
        _assert_exact(errors, f"{family} {engine} rank {rank}")


# --------------------------------------------------------------------------- TRL


TEXTS = 10  # the first texts of helpers.sft: TRL packs them into 5 rows of at most SFT_LENGTH tokens
SFT_LENGTH = 128


def _texts() -> list[str]:
    from helpers.sft import texts

    return texts()[:TEXTS]


def sft_case(rank, world_size, group, family, engine):
    """One optimizer step of BlockdiagCPSFTTrainer over every pack of the texts: (errors against the
    stock model on each tokenized text alone, wrapper type, document lengths of TRL's packs)."""
    from datasets import Dataset

    from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer
    from helpers.sft import EOS_ID, char_tokenizer, encode, sft_config

    ref, model = build_hybrid_pair(family)
    chosen = _texts()
    ref_loss, ref_grads = reference_loss_and_grads(ref, [torch.tensor(encode(t) + [EOS_ID]) for t in chosen], group=group)
    gradients = _GradientsBeforeStep()
    fields, context = _engine(engine)
    with accelerate_env(rank, world_size) as out, context:
        args = sft_config(out, max_length=SFT_LENGTH, max_steps=1, **fields)
        trainer = quiet(BlockdiagCPSFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": chosen}),
                                              processing_class=char_tokenizer(), cp_size=2, callbacks=[gradients]))
        errors, wrapped = _trained(trainer, gradients, ref_loss, ref_grads)
        return errors, wrapped, [list(row["seq_lengths"]) for row in trainer.train_dataset]


def _crosses(lengths: list[int], row: int) -> bool:
    """Whether a document of a pack with these document lengths holds rows `row - 1` and `row`."""
    ends = torch.tensor(lengths).cumsum(0)
    return bool(((ends - torch.tensor(lengths) < row) & (ends > row)).any())


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_trl_sft_step_matches_per_document_reference(gloo, engine):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    from helpers.sft import ACCUMULATION

    for rank, (errors, wrapped, packs) in enumerate(gloo(2).run(sft_case, timeout=180, family="lfm2", engine=engine)):
        _assert_engine(wrapped, engine)
        assert len(packs) <= ACCUMULATION, f"{len(packs)} packs: the optimizer step must cover the epoch"
        assert sorted(n for p in packs for n in p) == sorted(len(t) + 1 for t in _texts()), f"texts cut or lost: {packs}"
        assert any(_crosses(p, SFT_LENGTH // 2) for p in packs), f"no document lies on both ranks: {packs}"
        assert any(sum(p) <= SFT_LENGTH // 2 for p in packs), f"no pack leaves a rank only padding: {packs}"
        _assert_exact(errors, f"lfm2 TRL {engine} rank {rank}")

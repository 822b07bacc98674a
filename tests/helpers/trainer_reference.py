"""The stock-Trainer reference of the Trainer tests: the stock `transformers.Trainer` with the stock
`sdpa` model on the same packs in one process (labels masked at document starts, position ids
restarting per document: Transformers' own packed path), the documents they train and evaluate on,
the stock eager model's per-document eval loss, and the comparison of two training runs (logged
loss, grad norm, final weights). SGD without clipping (`helpers.trainer.trainer_settings`), so a
gradient scale error shows in the weights."""

from __future__ import annotations

import torch
from transformers import Trainer, TrainingArguments

from hf_blockdiag_cp.data import PackedBatchSampler, PackedExamples, dataset_lengths
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from helpers.reference import VOCAB
from helpers.trainer import accelerate_env, quiet, tiny_model, trainer_settings

MAX_TOKENS = 48
STEPS = 3
PACKS_PER_STEP = 2  # global batch: packs per optimizer step, over all DP replicas and accumulation
LOSS_TOL = 1e-5
GRAD_NORM_TOL = 1e-4
UPDATE_TOL = 1e-3  # max |w_cp - w_ref| / max |w_ref - w_init|, per tensor


def train_docs() -> list[dict]:
    """Heavy-tailed document lengths, one longer than a pack (split into pieces)."""
    g = torch.Generator().manual_seed(3)
    lengths = [1, 2, 3, 3, 4, 5, 6, 7, 9, 11, 14, 17, 21, 26, 33, 40, 47, 70, 5, 8, 12, 2, 30, 19, 9, 4, 110]
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def eval_docs() -> list[dict]:
    """Held-out documents, none longer than a pack; they pack into an odd number of packs, the last
    one partial, so dp = 2 needs a fill pack (which must weigh 0)."""
    g = torch.Generator().manual_seed(11)
    lengths = [2, 5, 9, 13, 17, 23, 31, 40, 47, 3, 8, 19, 26, 6, 1, 11, 44]
    return [{"input_ids": torch.randint(1, VOCAB, (n,), generator=g).tolist()} for n in lengths]


def training_args(output_dir: str, accumulation: int, **overrides) -> TrainingArguments:
    return TrainingArguments(**{**trainer_settings(output_dir, accumulation, STEPS), **overrides})


def outcome(trainer: Trainer, initial: dict, output=None) -> dict:
    """What a finished run logged (losses, grad norms, final `train_loss`) and its initial and final weights."""
    logs = [h for h in trainer.state.log_history if "loss" in h]
    final = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    weights = {k: v.detach().cpu().clone() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
    return {
        "losses": [h["loss"] for h in logs],
        "grad_norms": [float(h["grad_norm"]) for h in logs],
        "logs": logs,
        "weights": weights,
        "initial": initial,
        "train_loss": (output.training_loss if output is not None else None, final[-1] if final else None),
    }


class ReferenceTrainer(Trainer):
    """Stock Trainer; only the data is fixed: the epoch's packs in order, labels masked at document starts."""

    def __init__(self, *args, packs: list[dict], **kwargs):
        super().__init__(*args, **kwargs)
        self._packs = packs

    def get_train_dataloader(self):
        return torch.utils.data.DataLoader(self._packs, batch_size=None, shuffle=False)


def reference_packs(docs: list[dict]) -> list[dict]:
    """The packs of one epoch in dealing order, in Transformers' packed convention (no document_ids)."""
    sampler = PackedBatchSampler(dataset_lengths(docs), MAX_TOKENS, seed=0)
    examples, collator = PackedExamples(docs), BlockdiagCPCollator(MAX_TOKENS)
    packs = []
    for items in sampler.epoch_packs():
        full = collator([examples[i] for i in items])
        labels = full["labels"].clone()
        labels[full["position_ids"] == 0] = -100  # no target crosses into the next document
        packs.append({"input_ids": full["input_ids"], "labels": labels, "position_ids": full["position_ids"]})
    return packs


def with_lora(model):
    """`model` with PEFT LoRA adapters on the attention projections; the same adapters from the same
    weights every time (B starts at 0, A from a fixed seed)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def reference_case(rank, world_size, group, lora: bool = False):
    """The stock run in a one-process pool (with `lora`, of the model `with_lora` adapts)."""
    assert world_size == 1
    with accelerate_env(rank, world_size) as out:
        model = tiny_model("sdpa")
        if lora:
            model = with_lora(model)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = ReferenceTrainer(model=model, args=training_args(out, PACKS_PER_STEP), packs=reference_packs(train_docs()))
        output = quiet(trainer).train()
        return outcome(trainer, initial, output)


def assert_same_training(got: dict, ref: dict, what: str, steps: int = STEPS, frozen: bool = False) -> None:
    """The same logged loss and grad norm at every step and the same final weights. Every weight must
    have trained in the reference, or with `frozen` (adapters on a frozen model) some, the rest unchanged in both."""
    assert len(got["losses"]) == len(ref["losses"]) == steps, (what, got["losses"], ref["losses"])
    for step, (a, b) in enumerate(zip(got["losses"], ref["losses"]), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(b), f"{what} step {step}: logged loss {a} vs reference {b}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], ref["grad_norms"]), start=1):
        assert abs(a - b) <= GRAD_NORM_TOL * abs(b), f"{what} step {step}: grad norm {a} vs reference {b}"
    trained = 0
    for name, w_ref in ref["weights"].items():
        update = (w_ref - ref["initial"][name]).abs().max()
        err = (got["weights"][name] - w_ref).abs().max()
        assert update > 0 or frozen, f"reference did not train {name}"
        trained += bool(update > 0)
        assert err <= UPDATE_TOL * update or (update == 0 and err == 0), \
            f"{what}: {name} differs by {err:.3e}, its update is {update:.3e}"
    assert trained, f"{what}: the reference trained no weight"


def stock_eval_loss(docs: list[dict], piece: int | None = None, weights: dict | None = None) -> float:
    """The stock eager model (same initial weights, or `weights`) on every document unpacked: token-weighted mean
    loss; with `piece`, on every `piece`-token slice of each document as its own document."""
    model = tiny_model("eager").eval()
    if weights is not None:
        model.load_state_dict(weights)
    total, count = 0.0, 0
    whole = [torch.tensor(doc["input_ids"]) for doc in docs]
    with torch.no_grad():
        for ids in whole if piece is None else [part for ids in whole for part in ids.split(piece)]:
            logits = model(input_ids=ids[None]).logits[0]
            total += float(torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="sum"))
            count += ids.numel() - 1
    return total / count

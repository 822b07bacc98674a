"""The trainers' CP loss through the chunked log-prob head (`integrations.trainer.head_loss`), in one process.

- `head_token_loss` at cp = 1 against the model's own loss of the same step (Transformers'
  `ForCausalLMLoss` over the full logits, with the step's `shift_labels` and `num_items_in_batch`):
  the loss and every parameter gradient, for Llama, Gemma2 (final soft-capping) and Granite
  (logits_scaling); its per-token entropy and top-1 flags against the model's own logits (float64);
  the output embedding builds no logits.
- `head_loss_refusal`: what keeps the model's own loss (a custom `loss_function`, a forward that
  Liger replaced, a class forward from outside Transformers, a LoRA adapter on the LM head, an MoE
  router auxiliary loss the model's loss would add), and what does not (TRL's fused LM head on the
  instance, a LoRA adapter elsewhere, an MoE model whose auxiliary loss the trainer adds itself).
- A model whose logit transform the head does not know: `head_token_loss` gives None, and the model
  keeps its own loss from then on.
The trainers against the stock Trainer / SFTTrainer on gloo groups: multiprocess/test_trainer.py,
test_trl_sft.py, test_trainer_recipes.py, test_moe_aux_loss.py.
"""

from __future__ import annotations

import types

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.integrations.trainer.head_loss import HeadLossOutput, head_loss_refusal, head_token_loss
from helpers.model_zoo import build_pair, moe_config
from helpers.reference import build_models, make_docs, rel_err
from helpers.trainer import counting_lm_head_rows

TOL = 1e-5  # fp32, the same logits: only the order of the sums differs
LENGTHS, N_PAD = (9, 1, 14, 7), 5
LABELLED = {"shift_labels": torch.zeros(1, 4, dtype=torch.long)}  # a step's inputs, as far as the refusal reads them


def pack():
    docs = make_docs(LENGTHS, seed=3)
    labels = [d.clone() for d in docs]
    labels[2][:4] = -100  # a masked prompt
    ids = torch.cat(docs + [torch.zeros(N_PAD, dtype=torch.long)])[None]
    return {"input_ids": ids, "labels": torch.cat(labels + [torch.full((N_PAD,), -100)])[None],
            "document_ids": bdcp.planning.document_ids_from_lengths(LENGTHS, ids.shape[1])[None]}


def step_run(model, fn):
    """`fn(local)` inside a cp = 1 step of the pack, with `num_items_in_batch` as the trainers pass it."""
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, pack(), model=model)
    local["num_items_in_batch"] = torch.tensor(7.5)
    with train_ctx():
        return fn(local), local


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite"])
def test_head_loss_is_the_models_own_loss(family):
    _, model = build_models("llama") if family == "llama" else build_pair(family)
    assert head_loss_refusal(model, LABELLED, keeps_router_aux=True) is None

    def own(local):
        out = model(**local)
        out.loss.backward()
        return out

    want, local = step_run(model, own)
    want_grads = grads(model)
    with counting_lm_head_rows(model) as rows:
        for _ in range(2):  # the second call runs without the probe rows
            got, _ = step_run(model, lambda local: head_token_loss(model, local, ("entropy", "is_top1")))
            got.loss.backward()
            got_grads = grads(model)
            assert isinstance(got, HeadLossOutput) and "logits" not in got
            assert abs(got.loss.item() - want.loss.item()) <= TOL * abs(want.loss.item()), (got.loss, want.loss)
            assert set(got_grads) == set(want_grads)
            for name, g in want_grads.items():
                assert rel_err(got_grads[name], g) <= TOL, f"{family}: {name}"
    assert max(rows) <= 2, rows  # the probe rows of the first call; never the shard's logits
    labels = local["shift_labels"][0]
    mask = labels != -100
    logits = want.logits[0].detach().double()
    p = logits.softmax(-1)
    entropy = torch.where(mask, -(p * p.log()).sum(-1), 0.0)
    assert rel_err(got.entropy[0].double(), entropy) <= TOL
    assert torch.equal(got.is_top1[0].bool(), (logits.argmax(-1) == labels) & mask)


def test_what_keeps_the_models_own_loss():
    from accelerate.utils import convert_outputs_to_fp32
    from peft import LoraConfig, get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    def refusal(model, keeps_router_aux=True):
        return head_loss_refusal(model, LABELLED, keeps_router_aux=keeps_router_aux)

    _, model = build_models("llama")
    add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))  # what TRL's SFTTrainer does
    assert refusal(model) is None

    _, model = build_models("llama")
    model.loss_function = lambda logits, labels, vocab_size, **kwargs: logits.sum()
    assert "loss_function is not Transformers' ForCausalLMLoss" in refusal(model)

    _, model = build_models("llama")
    original = model.forward

    def lce_forward(self, *args, **kwargs):  # as Liger installs it on the instance, then accelerate wraps it
        return original(*args, **kwargs)

    lce_forward.__module__ = "liger_kernel.transformers.model.llama"
    model.forward = convert_outputs_to_fp32(types.MethodType(lce_forward, model))
    assert "Liger" in refusal(model)
    add_fused_lm_head(model)  # TRL's SFTTrainer wraps whatever forward the instance has
    assert "Liger" in refusal(model)

    class OwnForward(type(model)):
        def forward(self, *args, **kwargs):
            return super().forward(*args, **kwargs)

    _, model = build_models("llama")
    model.__class__ = OwnForward
    assert "not from Transformers" in refusal(model)

    _, model = build_models("llama")
    assert refusal(get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"]))) is None
    _, model = build_models("llama")
    assert "PEFT adapter" in refusal(get_peft_model(model, LoraConfig(r=2, target_modules=["lm_head"])))

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    moe = AutoModelForCausalLM.from_config(moe_config("mixtral"))
    assert head_loss_refusal(moe, {}, keeps_router_aux=False) == "the step has no labels"
    assert "router auxiliary loss" in refusal(moe)
    assert refusal(moe, keeps_router_aux=False) is None  # the SFT trainer adds TRL's own term


def test_unknown_logit_transform_keeps_the_models_own_loss():
    """A Llama whose forward rescales its logits: the head's probe notices, the step gets None (the
    trainer then runs the model's own loss), and the model is refused from then on, saying why."""
    _, model = build_models("llama")
    model.register_forward_hook(lambda module, args, out: out.__setitem__("logits", out["logits"] * 3.0) or out)
    got, _ = step_run(model, lambda local: head_token_loss(model, local))
    assert got is None
    assert "transforms its logits" in head_loss_refusal(model, LABELLED, keeps_router_aux=True)


def test_forward_without_its_output_embedding_keeps_the_models_own_loss():
    """A model whose forward never calls the module `get_output_embeddings()` names: the head cannot run,
    the step gets None, and the model is refused from then on."""
    _, model = build_models("llama")
    model.get_output_embeddings = lambda: torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    got, _ = step_run(model, lambda local: head_token_loss(model, local))
    assert got is None
    assert "did not call its output embedding" in head_loss_refusal(model, LABELLED, keeps_router_aux=True)

"""`TrainingArguments(use_liger_kernel=True)` with `BlockdiagCPTrainer` on the GPU (skipped without
CUDA or liger-kernel).

The Trainer applies Liger when `train()` starts (for Llama by default: fused linear cross-entropy,
RMSNorm, RoPE, SwiGLU). The CP step must still reach Liger's loss with the pre-shifted local labels
and `num_items_in_batch = N / G`, so that one optimizer step on a pack gives, as the mean over the CP
group, the loss and gradients of the stock model on each document unpacked (fp32,
`reference_loss_and_grads`). Checked at cp = 1 and at G = 2 (gloo with CUDA tensors on one GPU, DDP
over it, as in tests/gpu/test_fa4_fused_ce.py), with that test's fused-CE tolerance: relative error
(norm) <= 1e-4 for the loss and for every parameter's gradient. Also checked: Liger really took
over (the model's forward is Liger's and returned no logits), so a Trainer that silently keeps the
stock loss fails.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback, TrainingArguments

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer
from helpers.packs import layout_lengths
from helpers.reference import make_docs, mean_over_group, reference_loss_and_grads, rel_err
from helpers.trainer import accelerate_env, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = 1e-4  # as test_fused_cross_entropy_matches_the_stock_loss


class _LigerProbe(BlockdiagCPTrainer):
    """Records the loss this rank backpropagates and whether the model returned logits."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        self.probe = {"loss": loss.detach().clone(), "logits_returned": outputs.get("logits") is not None}
        return (loss, outputs) if return_outputs else loss


class _GradsBeforeStep(TrainerCallback):
    """The gradients the optimizer is about to apply (after DDP's mean over the ranks; no clipping)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
                      for n, p in model.named_parameters()}


def liger_trainer_case(rank, world_size, group, layout, max_tokens):
    from transformers.models.llama import modeling_llama

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    docs = make_docs(layout_lengths(layout, world_size)[0])  # all in one pack of max_tokens
    # The reference first: Liger's RoPE / RMSNorm / SwiGLU patches are global to modeling_llama.
    loss32, grads32 = reference_loss_and_grads(tiny_model("eager").cuda().train(), [d.cuda() for d in docs])
    stock_llama = dict(vars(modeling_llama))
    bdcp.configure_cp("dense")  # fp32 and exact, as in the fused-CE test: the loss is what differs
    try:
        with accelerate_env(rank, world_size, local_rank=0) as out:
            args = TrainingArguments(
                output_dir=out, use_liger_kernel=True, max_steps=1, per_device_train_batch_size=1, optim="sgd",
                learning_rate=0.5, max_grad_norm=0.0, report_to="none", save_strategy="no", disable_tqdm=True,
                ddp_backend="gloo" if world_size > 1 else None,
            )
            grads = _GradsBeforeStep()
            trainer = _LigerProbe(
                model=tiny_model(), args=args, train_dataset=[{"input_ids": d.tolist()} for d in docs],
                cp_size=world_size, max_tokens=max_tokens, cp_mesh=group if world_size > 1 else None, callbacks=[grads],
            )
            trainer.train()
            forward = getattr(trainer.model.forward, "__func__", trainer.model.forward)
    finally:  # leave the pool worker as it was for the next test
        bdcp.configure_cp()
        vars(modeling_llama).update(stock_llama)
    loss = mean_over_group(trainer.probe["loss"], group, world_size)
    grad_errs = {n: rel_err(grads.grads[n].cpu(), g.cpu()) for n, g in grads32.items()}
    worst = max(grad_errs, key=grad_errs.get)
    return {
        "forward": f"{forward.__module__}.{forward.__qualname__}",
        "logits_returned": trainer.probe["logits_returned"],
        "loss_err": rel_err(loss.cpu(), loss32.cpu()),
        "grad_err": grad_errs[worst],
        "worst_grad": worst,
    }


@pytest.mark.parametrize("world_size,layout,max_tokens", [(1, "straddle", 32), (2, "straddle", 32), (2, "padding_rank", 12)])
def test_trainer_use_liger_kernel_matches_the_unpacked_reference(gloo, world_size, layout, max_tokens):
    from hf_blockdiag_cp.integrations.liger import fused_cross_entropy_unavailable

    reason = fused_cross_entropy_unavailable()
    if reason is not None:
        pytest.skip(reason)
    results = gloo(world_size).run(liger_trainer_case, timeout=600, layout=layout, max_tokens=max_tokens)
    for rank, e in enumerate(results):
        assert e["forward"].startswith("liger_kernel."), f"rank {rank}: the Trainer kept the stock forward: {e}"
        assert not e["logits_returned"], f"rank {rank}: the training forward returned logits (not Liger's fused loss): {e}"
        assert e["loss_err"] <= TOL, f"rank {rank}: mean loss over the CP group vs the reference: {e}"
        assert e["grad_err"] <= TOL, f"rank {rank}: gradient vs the reference: {e}"

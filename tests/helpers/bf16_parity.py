"""The bf16 parity criterion (docs/testing.md, "The reference"): errors are compared, not values.

A run in bf16 is measured against the fp32 stock model run on each document unpacked, and so
is the stock model itself in bf16 on the same documents; the CP run must stay within 1.5x the
stock model's error on the flattened gradient of every parameter, and within 1e-2 on the loss.
Shared by the GPU parity tests (`gpu/test_gpu.py`, `gpu/test_hybrid_gpu.py`, `gpu/test_trl_rl_gpu.py`).
"""

from __future__ import annotations

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.step.state import STEP_KWARG
from helpers.reference import mean_over_group, rel_err

GRAD_FACTOR = 1.5  # CP's gradient error may be at most this multiple of the stock bf16 model's
LOSS_TOL = 1e-2


def flat_grads(grads: dict, names) -> torch.Tensor:
    """The gradients `names` of `grads`, as one fp32 vector on the host."""
    return torch.cat([grads[n].float().reshape(-1).cpu() for n in names])


def cp_loss_and_grads(model, batch, group, world_size, config, checkpointing=True, device="cuda"):
    """One CP step of `model` on the full pack `batch`: (mean loss over the group, {name: mean
    gradient over the group}, the step object). Parameters without a gradient count as zero."""
    device = torch.device(device)
    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    model.zero_grad(set_to_none=True)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    with train_ctx():
        loss = model(**local).loss
        loss.backward()
    grads = {n: mean_over_group(p.grad if p.grad is not None else torch.zeros_like(p), group, world_size)
             for n, p in model.named_parameters()}
    return mean_over_group(loss, group, world_size), grads, local[STEP_KWARG]


def bf16_errors(reference, stock, cp) -> dict[str, float]:
    """Relative errors against `reference` of `stock` and `cp`, each a (loss, {name: gradient}) pair:
    the gradients of every parameter of the reference flattened into one vector, and the loss."""
    (loss32, grads32), (loss_s, grads_s), (loss_cp, grads_cp) = reference, stock, cp
    names = list(grads32)
    return {
        "stock_grad_err": rel_err(flat_grads(grads_s, names), flat_grads(grads32, names)),
        "cp_grad_err": rel_err(flat_grads(grads_cp, names), flat_grads(grads32, names)),
        "stock_loss_err": rel_err(loss_s.float().cpu(), loss32.cpu()),
        "cp_loss_err": rel_err(loss_cp.float().cpu(), loss32.cpu()),
    }


def assert_bf16(results) -> None:
    """`results[rank][case]` holds `bf16_errors` (and possibly more keys); every case must pass."""
    for rank, per_case in enumerate(results):
        for case, e in per_case.items():
            assert e["cp_grad_err"] <= GRAD_FACTOR * e["stock_grad_err"], f"rank {rank} {case}: {e}"
            assert e["cp_loss_err"] <= LOSS_TOL, f"rank {rank} {case}: {e}"


# Per parameter group, over seeds (the TRL trainers' GPU tests: `gpu/test_trl_rl_gpu.py`)
GROUPS = ("self_attn", "mlp", "other")


def group_of(name: str) -> str:
    """A parameter's group: attention, MLP, or the rest (embeddings, norms, the LM head)."""
    return "self_attn" if ".self_attn." in name else "mlp" if ".mlp." in name else "other"


def group_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Relative error against `reference` of each group's gradients, flattened into one vector."""
    out = {}
    for group in GROUPS:
        names = [n for n in reference if group_of(n) == group]
        out[group] = rel_err(flat_grads(grads, names), flat_grads(reference, names))
    return out


def median_ratios(ours: list[dict], stock: list[dict]) -> dict[str, float]:
    """Per group, the median over seeds of ours / stock (the two `group_errors` of one seed)."""
    import statistics

    return {g: statistics.median(o[g] / s[g] for o, s in zip(ours, stock)) for g in GROUPS}

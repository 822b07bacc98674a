"""`BlockdiagCPDPOTrainer` in bf16 on one GPU (I1): the DPO gradient per parameter group, over seeds.

For every seed (model, reference and pairs), one DPO step of TRL's own `DPOTrainer` in fp32 (stock
`sdpa` model, every pair in one padded batch, no TF32) is the reference; TRL's trainer in bf16 on the
same batch is the yardstick; ours runs the same pairs packed in bf16 (attention `auto`: FA4 where
installed; activation checkpointing) at G = 1 and G = 2 (gloo with CUDA tensors, both ranks on GPU 0).
Per parameter group (attention, MLP, the rest), the median over `SEEDS` of ours/stock (the two
gradient errors of one seed) must stay within 1.5x, and the loss within 1e-2 (docs/testing.md,
"The reference"). `pytest -s` prints every group's medians.
"""

from __future__ import annotations

import os
import statistics

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.bf16_parity import GRAD_FACTOR, LOSS_TOL  # noqa: E402
from helpers.preference import (  # noqa: E402
    GradCapture, char_tokenizer, dpo_config, preference_dataset, preference_rows, reference_model, training_logs,
)
from helpers.reference import rel_err  # noqa: E402
from helpers.reference import tiny_config  # noqa: E402
from helpers.trainer import accelerate_env, checkpointing_settings, quiet  # noqa: E402

DEVICE = os.environ.get("BDCP_BF16_DEVICE", "cuda")
SEEDS = tuple(range(int(os.environ.get("BDCP_BF16_SEEDS", "3"))))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU_DIMS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, initializer_range=0.02)
GROUPS = ("self_attn", "mlp", "other")
PACK = 2400  # every pair of `preference_rows(long_chars=1500)`; a multiple of 2*G for G = 1, 2
ROWS = dict(count=8, long_chars=1500)  # the long pair straddles the two ranks at G = 2


def llama(attn: str, seed: int):
    """The tiny Llama at head dim 64 (FA4 verified there), Transformers' initialisation, seeded."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config("llama", use_cache=False, **GPU_DIMS), attn_implementation=attn,
                                            dtype=torch.float32)


def group_of(name: str) -> str:
    return "self_attn" if ".self_attn." in name else "mlp" if ".mlp." in name else "other"


def group_errors(grads: dict, reference: dict) -> dict[str, float]:
    out = {}
    for group in GROUPS:
        names = [n for n in reference if group_of(n) == group]
        flat = torch.cat([grads[n].float().reshape(-1) for n in names])
        out[group] = rel_err(flat, torch.cat([reference[n].float().reshape(-1) for n in names]))
    return out


def dpo_step_case(rank, world_size, group, seed: int, ours: bool, dtype: str):
    """(first log, gradients) of one DPO step: ours packed under CP, or TRL's stock trainer (sdpa, padded)."""
    from trl import DPOTrainer

    import hf_blockdiag_cp as bdcp
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = preference_rows(seed=seed, **ROWS)
    with accelerate_env(rank, world_size, local_rank=0) as out:
        policy = llama("blockdiag_cp" if ours else "sdpa", seed)
        ref = reference_model(policy, scale=0.02, seed=seed + 1)
        policy, ref = (m.to(DEVICE, getattr(torch, dtype)) for m in (policy, ref))
        settings = checkpointing_settings(False) if ours else {}
        args = dpo_config(out, len(rows), use_cpu=DEVICE == "cpu", per_device_train_batch_size=len(rows),
                          ddp_backend="gloo" if world_size > 1 else None, max_length=2048, **settings)
        capture = GradCapture()
        kwargs = dict(model=policy, ref_model=ref, args=args, train_dataset=preference_dataset(rows),
                      processing_class=char_tokenizer(), callbacks=[capture])
        if ours:
            trainer = BlockdiagCPDPOTrainer(**kwargs, cp_size=world_size, max_tokens=PACK,
                                            cp_config=bdcp.CPConfig(attn_backend="auto"),
                                            cp_mesh=group if world_size > 1 else None)
        else:
            trainer = DPOTrainer(**kwargs)
        quiet(trainer).train()
        return training_logs(trainer)["loss"], capture.grads


def _ratios(ours: list[dict], stock: list[dict]) -> dict[str, float]:
    return {g: statistics.median(o[g] / s[g] for o, s in zip(ours, stock)) for g in GROUPS}


@pytest.mark.parametrize("world_size", [1, 2])
def test_dpo_bf16_gradient_per_group_within_the_stock_error(gloo, world_size):
    stock, ours, losses = [], [], []
    for seed in SEEDS:
        (loss32, grads32), = gloo(1).run(dpo_step_case, timeout=600, seed=seed, ours=False, dtype="float32")
        (_, grads16), = gloo(1).run(dpo_step_case, timeout=600, seed=seed, ours=False, dtype="bfloat16")
        runs = gloo(world_size).run(dpo_step_case, timeout=600, seed=seed, ours=True, dtype="bfloat16")
        stock.append(group_errors(grads16, grads32))
        ours.append(group_errors(runs[0][1], grads32))
        losses.append(abs(runs[0][0] - loss32) / abs(loss32))
    ratio = _ratios(ours, stock)
    print(f"\nG={world_size}: median over {len(SEEDS)} seeds of ours/stock bf16 gradient error: "
          + ", ".join(f"{g} {ratio[g]:.2f}x ({statistics.median(o[g] for o in ours):.2e}/"
                      f"{statistics.median(s[g] for s in stock):.2e})" for g in GROUPS)
          + f"; loss {statistics.median(losses):.1e}")
    assert all(ratio[g] <= GRAD_FACTOR for g in GROUPS), ratio
    assert statistics.median(losses) <= LOSS_TOL, losses

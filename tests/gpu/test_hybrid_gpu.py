"""Gated delta-rule hybrids (Qwen3.5, Qwen3-Next, Qwen3.5-MoE text) in bf16 on one GPU (I1).

At cp = 1 and G = 2 and 4 (gloo ranks with CUDA tensors on one GPU), with activation
checkpointing, the contiguous and the balanced layout, and attention kernel `auto` (FA4 where
installed, else torch varlen, for the full-attention layers): the mean loss and gradients of
the patched model under CP in bf16, and those of the stock model in bf16 on each document
unpacked, are both measured against the stock model in fp32 (eager attention, no TF32) on each
document unpacked; both stock runs use Transformers' own torch convolution and delta rule.
CP's error must stay within 1.5x the stock model's on the flattened gradient and within 1e-2
on the loss (docs/testing.md, "The reference"). `pytest -s` prints both errors of every case.
Skipped without CUDA, and per family where the installed Transformers lacks it.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch
import transformers

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.model_patches.gated_delta import stock_torch_kernels
from hf_blockdiag_cp.planning import PAIR_COUNT, document_ids_from_lengths
from helpers.bf16_parity import GRAD_FACTOR, assert_bf16, bf16_errors, cp_loss_and_grads
from helpers.model_zoo import HYBRID_FAMILIES, build_hybrid_pair
from helpers.reference import make_docs, reference_loss_and_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# Full attention at head dim 64 (one FA4 was verified at); delta-rule heads with Dk = 64 != Dv = 128,
# whose 4 key heads split over every G tested.
GPU_SIZES = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.02,
    linear_num_key_heads=4, linear_key_head_dim=64, linear_value_head_dim=128,
)
# Every expert chosen: top-k routing is discontinuous, and a near-tie that bf16 rounding flips
# changes one token's output by O(1) in either bf16 run, which would swamp the rounding errors
# compared here. The routing weights and the MoE code path stay.
GPU_MOE_SIZES = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128)
# 1-token documents, one of 480 tokens over every rank at G = 4, then padding (document id 0).
DOC_LENGTHS = (1, 57, 41, 480, 1, 33, 12)
PADDING = 7
LAYOUTS = ("contiguous", "balanced")


def gpu_sizes(family: str) -> dict:
    """Overrides of `tiny_hybrid_config(family)` for the bf16 comparison."""
    if family == "qwen3_5":
        return dict(GPU_SIZES, linear_num_value_heads=8, intermediate_size=512)
    value_heads = 4 if family == "qwen3_5_moe" else 8  # one or two value heads per key head, as in model_zoo
    return dict(GPU_SIZES, **GPU_MOE_SIZES, linear_num_value_heads=value_heads)


def hybrid_pack(seed: int = 6):
    """(documents, packed batch): `DOC_LENGTHS` end to end, then `PADDING` tokens without labels."""
    docs = make_docs(DOC_LENGTHS, seed=seed)
    ids = torch.cat(docs + [torch.zeros(PADDING, dtype=torch.long)])[None]
    labels = ids.clone()
    labels[0, ids.shape[1] - PADDING :] = -100
    document_ids = document_ids_from_lengths(DOC_LENGTHS, ids.shape[1])[None]
    return docs, {"input_ids": ids, "labels": labels, "document_ids": document_ids}


def _kernels(step) -> list[str]:
    """The attention kernels the step resolved (`auto`) for its layers."""
    return sorted({v.name for k, v in step.mask_cache.items() if isinstance(k, tuple) and k and k[0] == "kernel"})


def hybrid_bf16_case(rank, world_size, group, family, device="cuda"):
    """Per layout: `bf16_errors` of CP and of the stock model, the kernels `auto` chose and
    whether the layout reordered the pack."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference (matmuls, and the stock convolution)
    torch.backends.cudnn.allow_tf32 = False
    ref32, model = build_hybrid_pair(family, **gpu_sizes(family))
    docs, batch = hybrid_pack()
    docs = [d.to(device) for d in docs]
    with stock_torch_kernels(ref32):
        reference = reference_loss_and_grads(ref32.to(device), docs)
        stock = reference_loss_and_grads(copy.deepcopy(ref32).to(torch.bfloat16), docs)
    model = model.to(device, torch.bfloat16)
    out = {}
    for layout in LAYOUTS:
        config = bdcp.CPConfig(attn_backend="auto", kv_exchange="allgather", layout=layout, kernel_cost=PAIR_COUNT)
        loss, grads, step = cp_loss_and_grads(model, batch, group, world_size, config, checkpointing=True, device=device)
        slots = step.layout.slot_positions.reshape(-1).cpu()
        out[f"{family} G={world_size} {layout}+ac"] = dict(
            bf16_errors(reference, stock, (loss, grads)),
            kernels=_kernels(step),
            permuted=not torch.equal(slots, torch.arange(slots.numel())),
        )
    return out


def _require_family(family: str) -> None:
    """Skip (not fail) where the installed Transformers has no modeling module for `family`."""
    try:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as exc:
        pytest.skip(f"transformers {transformers.__version__} has no {family} model ({exc})")


def _report(results, record_property) -> None:
    for case, e in results[0].items():  # every rank holds the same means over the group
        line = (
            f"{case}: grad rel err stock bf16 {e['stock_grad_err']:.3e}, CP bf16 {e['cp_grad_err']:.3e} "
            f"(ratio {e['cp_grad_err'] / e['stock_grad_err']:.2f}, limit {GRAD_FACTOR}); loss rel err stock "
            f"{e['stock_loss_err']:.2e}, CP {e['cp_loss_err']:.2e}; attention kernels {e['kernels']}"
        )
        print(line)
        record_property(case, line)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_hybrid_bf16_parity(gloo, record_property, family, world_size):
    _require_family(family)
    results = gloo(world_size).run(hybrid_bf16_case, timeout=600, family=family)
    _report(results, record_property)
    assert_bf16(results)
    if world_size > 1:  # the balanced layout really reordered the pack (else it tested nothing new)
        for rank, per_case in enumerate(results):
            balanced = per_case[f"{family} G={world_size} balanced+ac"]
            assert balanced["permuted"], f"rank {rank}: the balanced layout left the pack contiguous"

"""`bdcp.compile_model` on the GPU (inductor, bf16, activation checkpointing): a compiled model
with `attn_backend="auto"` (fa4 where installed, else varlen) stays within 1.5x the stock bf16
model's own error against the fp32 per-document reference (docs/testing.md, "The reference"), at
cp = 1 and at G = 2 (gloo on one GPU), whole model and per layer, and a second pack of the same
length compiles nothing new. Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from helpers.bf16_parity import assert_bf16, bf16_errors, cp_loss_and_grads
from helpers.packs import make_pack
from helpers.reference import build_models, reference_loss_and_grads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

GPU_MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)


def compiled_case(rank, world_size, group, regions):
    from torch._dynamo.utils import counters

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref32, model = build_models("llama", **GPU_MODEL)
    ref32 = ref32.cuda()
    docs, batch = make_pack("straddle", world_size)
    docs_cuda = [d.cuda() for d in docs]
    loss32, grads32 = reference_loss_and_grads(ref32, docs_cuda)
    stock16 = copy.deepcopy(ref32).to(torch.bfloat16)
    loss_s, grads_s = reference_loss_and_grads(stock16, docs_cuda)
    model = model.cuda().to(torch.bfloat16)
    enable_activation_checkpointing(model, use_reentrant=False)
    bdcp.compile_model(model, regions)
    config = bdcp.CPConfig(attn_backend="auto")
    loss_cp, grads_cp, step = cp_loss_and_grads(model, batch, group, world_size, config, checkpointing=False)
    graphs = counters["stats"]["unique_graphs"]
    _, other = make_pack("straddle", world_size, seed=2)  # other tokens, same length
    cp_loss_and_grads(model, other, group, world_size, config, checkpointing=False)
    errors = bf16_errors((loss32, grads32), (loss_s, grads_s), (loss_cp, grads_cp))
    return {regions: {**errors, "new_graphs": counters["stats"]["unique_graphs"] - graphs, "graphs": graphs,
                      "kernels": step.choices.kernels}}


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("regions", ["layers", "model"])
def test_compiled_bf16_within_stock_error(gloo, world_size, regions):
    results = gloo(world_size).run(compiled_case, timeout=900, regions=regions)
    print(f"\nG={world_size} {regions}: {results[0]}")
    assert_bf16(results)
    for rank, per_case in enumerate(results):
        assert per_case[regions]["graphs"] > 0, f"rank {rank}: nothing was compiled"
        assert per_case[regions]["new_graphs"] == 0, f"rank {rank}: a new pack recompiled: {per_case}"

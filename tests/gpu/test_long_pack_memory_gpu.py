"""The long-pack memory helpers on a GPU (integrations/memory.py): with activation checkpointing,
host offload frees the layers' inputs that checkpointing holds between forward and backward and
lowers the peak, a tiled MLP lowers the peak by its intermediates, and either bf16 run stays as
close to the fp32 run as the plain bf16 run (GPU backward kernels are not bitwise deterministic).
Skipped without CUDA."""

from __future__ import annotations

import copy

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from helpers.reference import build_models, rel_err
from hf_blockdiag_cp.integrations.memory import enable_checkpoint_offload, enable_tiled_mlp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOKENS, HIDDEN, INTERMEDIATE, LAYERS = 32768, 512, 4096, 8


def _run(model, batch):
    """Loss, gradients, and the bytes one forward and backward at cp = 1 allocate above what was
    allocated before it (other models on the GPU do not count): at the peak, and held between
    forward and backward (what checkpointing keeps: the layers' inputs)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, {k: v.cuda() for k, v in batch.items()})
    with train_ctx():
        loss = model(**local).loss
        torch.cuda.synchronize()
        torch.empty(1, device="cuda")  # lets the allocator retire blocks freed behind the offload stream
        held = torch.cuda.memory_allocated() - before
        loss.backward()
    torch.cuda.synchronize()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads, torch.cuda.max_memory_allocated() - before, held


def test_offload_and_tiled_mlp_lower_the_peak_and_keep_the_gradients():
    _, base = build_models("llama", hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS,
                           num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=256)
    base = base.cuda()
    enable_activation_checkpointing(base, use_reentrant=False)
    fp32 = copy.deepcopy(base)
    base = base.to(torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (1, TOKENS), generator=g)
    lengths = [4096] * (TOKENS // 4096)
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    loss32, grads32 = _run(fp32, batch)[:2]
    del fp32
    plain = _run(base, batch)
    offloaded, tiled = copy.deepcopy(base), copy.deepcopy(base)
    enable_checkpoint_offload(offloaded)
    enable_tiled_mlp(tiled, tile_tokens=4096)
    off, til = _run(offloaded, batch), _run(tiled, batch)
    layer_input = TOKENS * HIDDEN * 2
    intermediates = TOKENS * INTERMEDIATE * 2
    print(f"peak GiB: plain {plain[2] / 2**30:.3f}, offload {off[2] / 2**30:.3f}, tiled MLP {til[2] / 2**30:.3f}; "
          f"held after forward: plain {plain[3] / 2**30:.3f}, offload {off[3] / 2**30:.3f}")
    assert off[3] <= plain[3] - (LAYERS - 1) * layer_input, "offload did not free the layers' kept inputs"
    assert off[2] < plain[2], "offload did not lower the peak"
    assert til[2] <= plain[2] - intermediates, "the tiled MLP did not lower the peak by one intermediate"
    for name, run in (("offload", off), ("tiled MLP", til)):  # GPU backward kernels are not bitwise deterministic
        for what, index in (("loss", 0), ("gradients", 1)):
            if index == 0:
                err_plain, err = abs(plain[0] - loss32) / abs(loss32), abs(run[0] - loss32) / abs(loss32)
            else:
                err_plain = max(rel_err(plain[1][n], grads32[n]) for n in grads32)
                err = max(rel_err(run[1][n], grads32[n]) for n in grads32)
            print(f"{what}: bf16 error vs fp32, plain {err_plain:.2e}, {name} {err:.2e}")
            assert err <= 1.5 * err_plain + 1e-6, f"{name} {what}: {err:.2e} vs the plain bf16 run's {err_plain:.2e}"

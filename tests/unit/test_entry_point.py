"""The entry point's own autograd work at cp = 1: between the attention output and q, k, v there
are only views and the kernel. A select (`t[0]`) or a slice of the key rows would add a
backward that zero-fills a q/k/v-sized tensor and copies the gradient into it, every layer;
the H200 kernel bench measured that as ~10% of an attention fwd+bwd at 32k tokens. Plus the
process default: a step built without `config=` uses what `configure_cp_varlen` set."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from hf_blockdiag_cp import CPConfig, configure_cp_varlen, make_cp_blockdiag_batch_and_ctx, shard_batch
from hf_blockdiag_cp import kernels
from hf_blockdiag_cp.attention import blockdiag_attention
from hf_blockdiag_cp.planning import PAIR_COUNT
from hf_blockdiag_cp.step import SHARD_KEY, STEP_KWARG

_COPYING = ("Select", "Slice", "Index", "Clone", "Copy", "Cat", "Stack", "Gather")


def _backward_nodes(out: torch.Tensor) -> list[str]:
    seen, names, stack = set(), [], [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(type(fn).__name__)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return names


def test_cp1_entry_point_backward_is_views_and_the_kernel():
    doc_ids = torch.repeat_interleave(torch.tensor([1, 2, 3]), torch.tensor([5, 3, 8]))[None]
    batch = {"input_ids": torch.zeros_like(doc_ids), "document_ids": doc_ids}
    config = CPConfig(attn_backend="dense", kv_exchange="allgather")
    _, local, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, config=config)
    step = local[STEP_KWARG]
    # Transformers' layout: projections [1, S, H, D], attention gets the [1, H, S, D] view.
    leaves = [torch.randn(1, doc_ids.shape[1], h, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = blockdiag_attention(step, q, k, v, scale=None, sliding_window=None)
    names = _backward_nodes(out)
    assert [n for n in names if n.startswith(_COPYING)] == [], names
    kernels = [n for n in names if not n.startswith(("Transpose", "Squeeze", "Unsqueeze", "View", "AccumulateGrad"))]
    assert len(kernels) == 1, names
    assert names.count("AccumulateGrad") == 3


def test_configure_cp_varlen_sets_the_process_default():
    """`configure_cp_varlen` (a convenience for scripts) sets the config of every step built
    without `config=`; an explicit `config=` still wins; no arguments restore the defaults."""
    doc_ids = torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([5, 3]))[None]
    batch = {"input_ids": torch.zeros_like(doc_ids), "document_ids": doc_ids}
    try:
        configured = configure_cp_varlen("dense", "all-to-all", layout="balanced")
        assert configured == CPConfig(attn_backend="dense", kv_exchange="a2a", layout="balanced")
        _, local, layout = make_cp_blockdiag_batch_and_ctx(None, None, batch)
        assert (local[STEP_KWARG].attn_backend, local[STEP_KWARG].kv_exchange, layout.strategy) == ("dense", "a2a", "balanced")
        _, local, layout = make_cp_blockdiag_batch_and_ctx(None, None, batch, config=CPConfig())
        assert (local[STEP_KWARG].attn_backend, local[STEP_KWARG].kv_exchange, layout.strategy) == ("auto", "allgather", "contiguous")
        # shard_batch (the pure step, e.g. in DataLoader workers) reads the same default, kernel cost included.
        assert configure_cp_varlen(layout="balanced", kernel_cost=PAIR_COUNT).kernel_cost is PAIR_COUNT
        assert shard_batch(batch, 2, 0)[SHARD_KEY].layout.strategy == "balanced"
    finally:
        assert configure_cp_varlen() == CPConfig()
    _, local, layout = make_cp_blockdiag_batch_and_ctx(None, None, batch)
    assert (local[STEP_KWARG].attn_backend, local[STEP_KWARG].kv_exchange, layout.strategy) == ("auto", "allgather", "contiguous")


def test_under_autocast_the_step_attends_in_the_autocast_dtype_as_stock_sdpa():
    """An fp32 model under `torch.autocast` (the Trainer's `bf16=True`) hands the attention fp32
    q, k, v (its rotary output is fp32). Stock SDPA attends in bf16 there, and fa4 / varlen accept
    only bf16 or fp16 (on the H200, `sft_trl.py --bf16 --attn-backend fa4` was refused: "needs
    float16 or bfloat16, got torch.float32"). Here the dense kernel's record gets that same
    refusal of fp32; the step must pick the kernel for the autocast dtype and give a bf16 output
    whose error against float64 is the stock one's (docs/testing.md, "The reference": within 1.5x)."""
    lengths = [5, 3, 8]
    doc_ids = torch.repeat_interleave(torch.tensor([1, 2, 3]), torch.tensor(lengths))[None]
    batch = {"input_ids": torch.zeros_like(doc_ids), "document_ids": doc_ids}
    _, local, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, config=CPConfig(attn_backend="dense"))
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, doc_ids.shape[1], 16, generator=g) for h in (4, 2, 2))

    def stock(q, k, v):  # per document, causal: Transformers' sdpa on each document unpacked
        outs = [F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), is_causal=True, enable_gqa=True)
                for a, b in zip([0, 5, 8], [5, 8, 16])]
        return torch.cat(outs, dim=2).transpose(1, 2)

    def half_only(device, dtype, head_dim_k, head_dim_v):
        return None if dtype in (torch.float16, torch.bfloat16) else f"needs float16 or bfloat16, got {dtype}"

    exact = stock(q.double(), k.double(), v.double())
    dense = kernels.get_kernel("dense")
    kernels.register_kernel(dataclasses.replace(dense, check=half_only))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = blockdiag_attention(local[STEP_KWARG], q, k, v, scale=None, sliding_window=None)
            stock_bf16 = stock(q, k, v)
    finally:
        kernels.register_kernel(dense)
    assert stock_bf16.dtype == torch.bfloat16 and ours.dtype == torch.bfloat16
    stock_err = (stock_bf16.double() - exact).abs().max().item()
    ours_err = (ours.double() - exact).abs().max().item()
    assert 0 < ours_err <= 1.5 * stock_err, (ours_err, stock_err)

"""The entry point's own autograd work at cp = 1: between the attention output and q, k, v there
are only views and the kernel. A select (`t[0]`) or a slice of the key rows would add a
backward that zero-fills a q/k/v-sized tensor and copies the gradient into it, every layer;
the H200 kernel bench measured that as ~10% of an attention fwd+bwd at 32k tokens. Plus the
process default: a step built without `config=` uses what `configure_cp_varlen` set."""

from __future__ import annotations

import torch

from hf_blockdiag_cp import CPConfig, configure_cp_varlen, make_cp_blockdiag_batch_and_ctx, shard_batch
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

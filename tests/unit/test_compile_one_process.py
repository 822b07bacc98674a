"""`torch.compile` in one process (docs/performance.md, "torch.compile"): the SDPA drop-in compiled
inside a custom module equals float64 attention per document and compiles nothing after the first
pack; a compiled `blockdiag_cp` model outside a step is the eager model (I8); `compile_model`
refuses what it cannot do. The compiled models under CP: multiprocess/test_compile.py."""

from __future__ import annotations

import copy

import pytest
import torch
import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.torch import compile_counters
from hf_blockdiag_cp.integrations.compile import compile_model, decoder_layers
from helpers.reference import build_models, make_docs, rel_err

TOL = 1e-5


class PackedAttention(torch.nn.Module):
    """A custom module that calls the SDPA drop-in itself: q, k, v from one projection, 2 heads of 8."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return bdcp.cp_blockdiag_sdpa(q, k, v, is_causal=True)


def _per_document(module, x, lengths):
    """float64 causal softmax attention on every document alone, [1, H, S, D]."""
    q, k, v = (t.double() for t in module.qkv(x).view(1, -1, 3, 2, 8).permute(2, 0, 3, 1, 4))
    outs, start = [], 0
    for n in lengths:
        qs, ks, vs = (t[:, :, start : start + n] for t in (q, k, v))
        scores = (qs @ ks.transpose(-1, -2)) / 8**0.5
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        outs.append(scores.softmax(-1) @ vs)
        start += n
    return torch.cat(outs, dim=2)


def test_compiled_sdpa_drop_in_is_exact_and_compiles_once():
    torch.compiler.reset()
    torch.manual_seed(0)
    module = PackedAttention()
    compiled = copy.deepcopy(module)
    compiled.compile(backend="aot_eager")
    config = bdcp.CPConfig("dense", "allgather")
    graphs = []
    for lengths in ([5, 7, 4], [10, 6], [1, 15]):
        x = torch.randn(1, 16, 16)
        batch = {"input_ids": torch.zeros(1, 16, dtype=torch.long), "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
        train_ctx, _, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, config=config)
        with train_ctx():
            out = compiled(x)
            out.square().sum().backward()
        want = _per_document(module, x, lengths)
        (want.square().sum()).backward()
        assert rel_err(out.detach(), want) <= TOL
        for (name, p), q in zip(compiled.named_parameters(), module.parameters()):
            assert rel_err(p.grad, q.grad.float()) <= TOL, name
            p.grad, q.grad = None, None
        graphs.append(compile_counters()["graphs_compiled"])
    assert graphs[0] > 0 and graphs == graphs[:1] * 3, graphs


def test_compiled_model_outside_a_step_is_the_eager_model():
    """I8 under compile: no step, so the attention call is stock SDPA inside the compiled graphs."""
    torch.compiler.reset()
    ref, model = build_models("llama")
    compile_model(model, "layers", backend="eager")
    ids = torch.cat(make_docs([9]))[None]
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        got = model(input_ids=ids).logits
    assert rel_err(got, want) <= 1e-4
    assert compile_counters()["graphs_compiled"] > 0


def test_compile_model_refuses_what_it_cannot_do():
    _, model = build_models("llama")
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError, match="fullgraph=True cannot hold the graph break"):
        compile_model(model, "layers", fullgraph=True)
    with pytest.raises(ValueError, match="regions must be one of"):
        compile_model(model, "blocks")
    with pytest.raises(ValueError, match="has no Transformers decoder layer"):
        compile_model(torch.nn.Linear(2, 2), "layers")

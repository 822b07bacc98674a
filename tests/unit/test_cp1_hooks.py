"""cp = 1 packed hooks for modules that call F.scaled_dot_product_attention directly.

Parity: a packed forward + backward through hooked modules equals the same model run on
each document separately (plain SDPA, unpacked), also when the attention modules sit inside
torch checkpoint wrappers (recompute must stay packed) and for an HF model on `sdpa` with
HF gradient checkpointing. Scope: F.scaled_dot_product_attention is the stock function
everywhere except inside a hooked attention forward, including after a forward that raised.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from hf_blockdiag_cp.planning import document_ids_from_lengths
from hf_blockdiag_cp.attention.sdpa_hooks import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
    packed_sdpa,
)
from helpers.reference import build_models, make_docs, rel_err

STOCK_SDPA = F.scaled_dot_product_attention
TOL = 1e-4
LENGTHS = [5, 7, 3, 9, 4]

SEEN: list = []  # (phase, the function F.scaled_dot_product_attention was while a module ran)
PHASE = {"now": "forward"}


class ToyAttention(nn.Module):
    """Attention that calls F.scaled_dot_product_attention itself (GQA, causal, no positions)."""

    def __init__(self, dim=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.fail = False

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        SEEN.append((PHASE["now"], "attention", F.scaled_dot_product_attention))
        if self.fail:
            raise RuntimeError("boom")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class ToyMLP(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        SEEN.append((PHASE["now"], "mlp", F.scaled_dot_product_attention))
        return self.down(F.gelu(self.up(x)))


class ToyBlock(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = ToyAttention(dim), ToyMLP(dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyLM(nn.Module):
    def __init__(self, vocab=101, dim=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _doc_loss(logits, docs):
    total, count, start = 0.0, 0, 0
    for d in docs:
        n = d.numel()
        total = total + F.cross_entropy(logits[start : start + n - 1], d[1:], reduction="sum")
        count, start = count + n - 1, start + n
    return total / count


def _reference(model, docs):
    """Unpacked: every document alone through the stock model (plain SDPA, no hooks)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(d[None])[0] for d in docs])
    loss = _doc_loss(logits, docs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_grad_err(model, ref_grads):
    return max(rel_err(p.grad, ref_grads[n.replace("._checkpoint_wrapped_module", "")]) for n, p in model.named_parameters())


@pytest.fixture(autouse=True)
def _clean_state():
    SEEN.clear()
    PHASE["now"] = "forward"
    disable_cp1_packed_varlen()
    yield
    disable_cp1_packed_varlen()
    assert F.scaled_dot_product_attention is STOCK_SDPA


@pytest.mark.parametrize("wrap", ["none", "attention", "block"])
def test_packed_parity_with_checkpoint_wrappers(wrap):
    torch.manual_seed(0)
    ref = ToyLM()
    docs = make_docs(LENGTHS)
    ref_loss, ref_grads = _reference(ref, docs)

    model = copy.deepcopy(ref)
    for block in model.blocks:
        if wrap == "attention":
            block.attn = checkpoint_wrapper(block.attn, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if wrap == "block":
        model.blocks = nn.ModuleList(checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for b in model.blocks)
    hooks = attach_cp1_packed_varlen_hooks(model)
    assert len(hooks.attention_modules) == 2 and all(type(m) is ToyAttention for m in hooks.attention_modules)

    model.zero_grad(set_to_none=True)
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS)[None], backend="auto")
    assert cp1_packed_varlen_backend() == "auto"
    SEEN.clear()
    loss = _doc_loss(model(torch.cat(docs)[None])[0], docs)
    PHASE["now"] = "backward"
    loss.backward()

    assert rel_err(loss, ref_loss) <= TOL
    assert _max_grad_err(model, ref_grads) <= TOL
    attention_calls = [(phase, fn) for phase, where, fn in SEEN if where == "attention"]
    recomputes = [fn for phase, fn in attention_calls if phase == "backward"]
    assert all(fn is packed_sdpa for _, fn in attention_calls)
    assert len(recomputes) == (0 if wrap == "none" else 2)  # recompute ran, and on the packed path
    assert all(fn is STOCK_SDPA for _, where, fn in SEEN if where == "mlp")
    assert F.scaled_dot_product_attention is STOCK_SDPA


def test_without_enable_hooks_are_transparent_and_state_clears_at_next_forward():
    torch.manual_seed(0)
    model = ToyLM()
    attach_cp1_packed_varlen_hooks(model)
    ids = torch.cat(make_docs(LENGTHS))[None]
    plain = ToyLM()
    plain.load_state_dict(model.state_dict())
    want_causal = plain(ids)

    torch.testing.assert_close(model(ids), want_causal, rtol=0, atol=0)  # not enabled: stock SDPA
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS), backend="sdpa")
    assert cp1_packed_varlen_backend() == "dense"
    packed = model(ids)
    assert rel_err(packed, want_causal) > 1e-3  # documents no longer see each other
    assert cp1_packed_varlen_backend() == "dense"  # kept for this forward's backward
    torch.testing.assert_close(model(ids), want_causal, rtol=0, atol=0)  # next outer forward: cleared
    assert cp1_packed_varlen_backend() is None


def test_sdpa_restored_when_the_forward_raises():
    model = ToyLM()
    attach_cp1_packed_varlen_hooks(model)
    enable_cp1_packed_varlen(document_ids_from_lengths([4, 4]))
    model.blocks[1].attn.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.randint(1, 100, (1, 8)))
    assert F.scaled_dot_product_attention is STOCK_SDPA
    assert [fn is packed_sdpa for _, where, fn in SEEN if where == "attention"] == [True, True]


def test_bad_inputs_raise_clear_errors():
    model = ToyLM()
    attach_cp1_packed_varlen_hooks(model)
    enable_cp1_packed_varlen(document_ids_from_lengths([4, 4]))
    with pytest.raises(ValueError, match="doc_ids.*hold 8"):
        model(torch.randint(1, 100, (1, 9)))
    with pytest.raises(ValueError, match="doc_ids"):
        enable_cp1_packed_varlen(torch.tensor([1, 1, 2, 2, 1]))  # document 1 in two runs
    with pytest.raises(ValueError, match="doc_ids"):
        enable_cp1_packed_varlen(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_backend"):
        enable_cp1_packed_varlen(torch.ones(4, dtype=torch.long), backend="nope")
    with pytest.raises(ValueError, match="no attention module"):
        attach_cp1_packed_varlen_hooks(nn.Sequential(nn.Linear(2, 2)))


def test_hf_model_on_sdpa_with_gradient_checkpointing():
    """An HF model whose attention calls F.scaled_dot_product_attention (attn_implementation='sdpa'),
    fed the pack with default positions (so HF itself sees one causal row), HF checkpointing on."""
    ref, _ = build_models("llama")
    docs = make_docs(LENGTHS)
    from helpers.reference import reference_loss_and_grads

    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("sdpa")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    hooks = attach_cp1_packed_varlen_hooks(model)
    assert len(hooks.attention_modules) == 2
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS))
    logits = model(input_ids=torch.cat(docs)[None], use_cache=False).logits[0]
    loss = _doc_loss(logits.float(), docs)
    loss.backward()
    assert rel_err(loss, ref_loss) <= TOL
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()) <= TOL

"""cp = 1 packed hooks for modules that call scaled_dot_product_attention themselves: exact or loud.

Exact: an armed packed forward + backward through hooked modules equals the independent
reference, each document on its own (a float64 matmul-softmax per document, or the stock model
run on every document unpacked), also for SDPA bound at import time, nested hooked modules,
checkpoint recompute and an HF model on `sdpa`. Loud: an explicit mask, is_causal=False,
dropout, a wrong shape, a hooked forward with no SDPA call raises naming the module, and so does
an armed pack inside a torch.compile region (modules compiled outside the hooks stay exact). Scoped:
SDPA outside hooked forwards, or unarmed, is stock; F.scaled_dot_product_attention is never
replaced; every hooks object holds its own pack.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.nn.functional import scaled_dot_product_attention as sdpa  # bound at import time

from hf_blockdiag_cp.attention import sdpa_hooks
from hf_blockdiag_cp.attention.sdpa_hooks import (
    attach_cp1_packed_varlen_hooks,
    cp1_packed_varlen_backend,
    disable_cp1_packed_varlen,
    enable_cp1_packed_varlen,
)
from hf_blockdiag_cp.compat.torch import unwrapped_name
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.planning import Layout, document_ids_from_lengths
from helpers.reference import build_models, make_docs, reference_loss_and_grads, rel_err

STOCK_SDPA = torch._C._nn.scaled_dot_product_attention
TOL = 1e-4
LENGTHS = [5, 7, 3, 9, 4]

SEEN: list = []  # (phase, module class) of every attention forward
PHASE = {"now": "forward"}


def _attend(how: str, q, k, v):
    """One attention call, spelled the way `how` names."""
    s = q.shape[2]
    if how == "causal":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    if how == "bound":  # the import-time binding, arguments positional
        return sdpa(q, k, v, None, 0.0, True, enable_gqa=True)
    if how == "mask":  # a plain causal mask, spelled out
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril(), enable_gqa=True)
    if how == "noncausal":
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if how == "dropout":
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True, enable_gqa=True)
    if how == "no_gqa_flag":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if how == "manual":  # eager attention, no SDPA call
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        return scores.softmax(-1) @ v
    raise AssertionError(how)


def _per_document(q, k, v, lengths):
    """The independent reference: float64 matmul-softmax causal attention on each document alone."""
    outs, start = [], 0
    for n in lengths:
        outs.append(_attend("manual", *(t[:, :, start : start + n].double() for t in (q, k, v))))
        start += n
    return torch.cat(outs, dim=2)


class CoreAttention(nn.Module):
    """Attention on given q, k, v ([1,H,S,D]), by the call `how` names."""

    def __init__(self, how="causal"):
        super().__init__()
        self.how = how

    def forward(self, q, k, v):
        return _attend(self.how, q, k, v)


class WrapperAttention(nn.Module):
    """A hooked module around another hooked module (both match the default filter)."""

    def __init__(self):
        super().__init__()
        self.core = CoreAttention()

    def forward(self, q, k, v):
        return self.core(q, k, v) * 2


class Mixer(nn.Module):
    """Not an attention module by name: never hooked, its SDPA call stays stock."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


class ToyAttention(nn.Module):
    """Projections around `_attend` (GQA, no positions), like a remote-code attention module."""

    def __init__(self, dim=32, heads=4, kv_heads=2, how="causal"):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.how = heads, kv_heads, dim // heads, how
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = nn.Linear(dim, dim)
        self.fail = False

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        SEEN.append((PHASE["now"], type(self).__name__))
        if self.fail:
            raise RuntimeError("boom")
        out = _attend(self.how, q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class ToyBlock(nn.Module):
    def __init__(self, dim=32, how="causal"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ToyAttention(dim, how=how)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ToyLM(nn.Module):
    def __init__(self, vocab=101, dim=32, layers=2, how="causal"):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim, how) for _ in range(layers))
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
    """Unpacked: every document alone through the model, unarmed (stock SDPA)."""
    model.zero_grad(set_to_none=True)
    logits = torch.cat([model(d[None])[0] for d in docs])
    loss = _doc_loss(logits, docs)
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _max_grad_err(model, ref_grads):
    return max(rel_err(p.grad, ref_grads[unwrapped_name(n)]) for n, p in model.named_parameters())


def _qkv(lengths, heads=4, kv_heads=2, dim=8, dtype=torch.float64):
    g = torch.Generator().manual_seed(3)
    s = sum(lengths)
    return [torch.randn(1, h, s, dim, generator=g, dtype=dtype, requires_grad=True) for h in (heads, kv_heads, kv_heads)]


@pytest.fixture(autouse=True)
def _clean_state():
    SEEN.clear()
    PHASE["now"] = "forward"
    yield
    for hooks in list(sdpa_hooks._LIVE):
        hooks.remove()
    assert F.scaled_dot_product_attention is STOCK_SDPA  # never replaced
    assert torch.overrides._get_current_function_mode_stack() == []  # no mode left behind


@pytest.mark.parametrize("how", ["causal", "bound"])
@pytest.mark.parametrize("backend", ["auto", "dense"])
def test_sdpa_call_is_exact_per_document_forward_and_backward(how, backend):
    """Also for SDPA bound at import time: the mode sees the builtin however it was bound."""
    module = CoreAttention(how)
    hooks = attach_cp1_packed_varlen_hooks(module)
    q, k, v = _qkv(LENGTHS)
    want = _per_document(q, k, v, LENGTHS)
    want_grads = torch.autograd.grad(want.square().sum(), (q, k, v))
    mixed = _attend("causal", q, k, v)  # one causal row: what a silent miss would return
    assert (mixed - want).abs().max() > 0.1

    hooks.enable(document_ids_from_lengths(LENGTHS), backend)
    out = module(q, k, v)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-10)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)


def test_nested_hooked_modules_are_exact():
    """The outer module's frame must not catch the packed kernel's own (masked) SDPA call."""
    module = WrapperAttention()
    hooks = attach_cp1_packed_varlen_hooks(module)
    assert len(hooks.attention_modules) == 2
    q, k, v = _qkv(LENGTHS)
    hooks.enable(document_ids_from_lengths(LENGTHS), "dense")
    torch.testing.assert_close(module(q, k, v), 2 * _per_document(q, k, v, LENGTHS), rtol=1e-10, atol=1e-10)


def test_sdpa_outside_hooked_forwards_is_stock():
    model = nn.ModuleDict({"attn": CoreAttention(), "mixer": Mixer()})
    hooks = attach_cp1_packed_varlen_hooks(model)
    assert hooks.attention_modules == [model["attn"]]
    q, k, v = _qkv(LENGTHS)
    whole_row = _attend("manual", q, k, v)  # float64 causal over the whole row
    hooks.enable(document_ids_from_lengths(LENGTHS))
    torch.testing.assert_close(model["mixer"](q, k, v), whole_row, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), whole_row)
    torch.testing.assert_close(model["attn"](q, k, v), _per_document(q, k, v, LENGTHS), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "how, length, batch, match",
    [
        ("mask", 28, 1, "an explicit attn_mask of shape \\(28, 28\\)"),
        ("noncausal", 28, 1, "is_causal=False"),
        ("dropout", 28, 1, "dropout_p=0.1"),
        ("no_gqa_flag", 28, 1, "enable_gqa=True"),
        ("causal", 27, 1, "27/27/27 positions.*hold 28"),
        ("causal", 28, 2, "one packed row"),
    ],
)
def test_unsupported_calls_raise_naming_the_module(how, length, batch, match):
    torch.manual_seed(0)
    model = ToyLM()
    model.blocks[1].attn.how = how
    hooks = attach_cp1_packed_varlen_hooks(model)
    ids = torch.randint(1, 100, (batch, length))
    if how != "no_gqa_flag":  # unarmed, the hooks leave every call to stock SDPA
        model(ids)
    hooks.enable(document_ids_from_lengths(LENGTHS))
    where = "blocks.0.attn" if how == "causal" else "blocks.1.attn"  # the first module whose call is wrong
    with pytest.raises(ValueError, match=rf"{where} \(ToyAttention\) called scaled_dot_product_attention with .*{match}"):
        model(ids)


def test_explicit_causal_mask_is_stock_unarmed_and_raises_armed():
    torch.manual_seed(0)
    model = ToyLM(how="mask")
    plain = ToyLM()
    plain.load_state_dict(model.state_dict())
    hooks = attach_cp1_packed_varlen_hooks(model)
    ids = torch.cat(make_docs(LENGTHS))[None]
    torch.testing.assert_close(model(ids), plain(ids))  # unarmed: the mask is the causal mask
    hooks.enable(document_ids_from_lengths(LENGTHS))
    with pytest.raises(ValueError, match=r"blocks\.0\.attn \(ToyAttention\).*explicit attn_mask"):
        model(ids)


@pytest.mark.parametrize("inside_except", [False, True])
def test_hooked_forward_without_sdpa_raises(inside_except):
    """Also when the forward runs while an exception is being handled (a retry loop's `except`)."""
    model = ToyLM()
    model.blocks[0].attn.how = "manual"
    attach_cp1_packed_varlen_hooks(model)
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS))
    ids = torch.cat(make_docs(LENGTHS))[None]
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn \(ToyAttention\).*made no scaled_dot_product_attention"):
        if not inside_except:
            model(ids)
        try:
            raise KeyError("an earlier failure the caller is handling")
        except KeyError:
            model(ids)


def test_hf_eager_attention_raises():
    ref, _ = build_models("llama")  # attn_implementation="eager"
    attach_cp1_packed_varlen_hooks(ref)
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS), model=ref)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.self_attn \(LlamaAttention\).*no scaled_dot"):
        ref(input_ids=torch.cat(make_docs(LENGTHS))[None], use_cache=False)


@pytest.mark.parametrize("wrap", ["none", "attention", "block"])
def test_packed_parity_with_checkpoint_wrappers(wrap):
    torch.manual_seed(0)
    ref = ToyLM()
    docs = make_docs(LENGTHS)
    _, ref_loss, ref_grads = _reference(ref, docs)

    model = copy.deepcopy(ref)
    for block in model.blocks:
        if wrap == "attention":
            block.attn = checkpoint_wrapper(block.attn, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    if wrap == "block":
        model.blocks = nn.ModuleList(checkpoint_wrapper(b, checkpoint_impl=CheckpointImpl.NO_REENTRANT) for b in model.blocks)
    hooks = attach_cp1_packed_varlen_hooks(model)
    assert len(hooks.attention_modules) == 2 and all(type(m) is ToyAttention for m in hooks.attention_modules)

    model.zero_grad(set_to_none=True)
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS)[None], backend="auto", model=model)
    assert cp1_packed_varlen_backend(model) == "auto"
    SEEN.clear()
    loss = _doc_loss(model(torch.cat(docs)[None])[0], docs)
    PHASE["now"] = "backward"
    loss.backward()

    assert rel_err(loss, ref_loss) <= TOL
    assert _max_grad_err(model, ref_grads) <= TOL  # recompute ran packed, or the gradients would differ
    recomputes = [phase for phase, _ in SEEN if phase == "backward"]
    assert len(recomputes) == (0 if wrap == "none" else 2)


def test_two_models_keep_their_own_packs():
    torch.manual_seed(0)
    a, b = ToyLM(), ToyLM()
    lengths_a, lengths_b = LENGTHS, [10, 6, 12]  # same total length, different documents
    docs_a, docs_b = make_docs(lengths_a), make_docs(lengths_b, seed=2)
    want_a, want_b = _reference(a, docs_a)[0], _reference(b, docs_b)[0]
    ids_a, ids_b = torch.cat(docs_a)[None], torch.cat(docs_b)[None]
    whole_row_b = b(ids_b)[0]
    hooks_a, hooks_b = attach_cp1_packed_varlen_hooks(a), attach_cp1_packed_varlen_hooks(b)

    for _ in range(2):  # armed alternately: each model runs its own pack
        hooks_a.enable(document_ids_from_lengths(lengths_a))
        hooks_b.enable(document_ids_from_lengths(lengths_b), "dense")
        assert not [n for n, v in vars(sdpa_hooks).items() if isinstance(v, (sdpa_hooks._PackedState, Layout))]
        assert rel_err(a(ids_a)[0], want_a) <= TOL
        assert rel_err(b(ids_b)[0], want_b) <= TOL

    disable_cp1_packed_varlen()
    enable_cp1_packed_varlen(document_ids_from_lengths(lengths_a), model=a)  # arms a only
    assert (hooks_a.backend, hooks_b.backend) == ("auto", None)
    torch.testing.assert_close(b(ids_b)[0], whole_row_b)
    assert rel_err(a(ids_a)[0], want_a) <= TOL

    enable_cp1_packed_varlen(document_ids_from_lengths(lengths_b))  # no model: every live hooks object
    assert (hooks_a.backend, hooks_b.backend) == ("auto", "auto")
    disable_cp1_packed_varlen(model=b)
    assert (hooks_a.backend, hooks_b.backend) == ("auto", None)


def test_unarmed_is_stock_and_the_pack_clears_at_the_next_forward():
    torch.manual_seed(0)
    model = ToyLM()
    plain = ToyLM()
    plain.load_state_dict(model.state_dict())
    hooks = attach_cp1_packed_varlen_hooks(model)
    ids = torch.cat(make_docs(LENGTHS))[None]
    want_causal = plain(ids)

    torch.testing.assert_close(model(ids), want_causal, rtol=0, atol=0)  # unarmed: stock SDPA
    hooks.enable(document_ids_from_lengths(LENGTHS), backend="sdpa")
    assert hooks.backend == cp1_packed_varlen_backend() == "dense"
    packed = model(ids)
    assert rel_err(packed, want_causal) > 1e-3  # documents no longer see each other
    assert hooks.backend == "dense"  # kept for this forward's backward
    torch.testing.assert_close(model(ids), want_causal, rtol=0, atol=0)  # next outer forward: cleared
    assert hooks.backend is None and cp1_packed_varlen_backend() is None

    hooks.enable(document_ids_from_lengths(LENGTHS))
    hooks.remove()
    torch.testing.assert_close(model(ids), want_causal, rtol=0, atol=0)  # removed: stock SDPA


def test_a_forward_that_raises_leaves_no_mode_behind():
    torch.manual_seed(0)
    model = ToyLM()
    docs = make_docs(LENGTHS)
    want = _reference(model, docs)[0]
    hooks = attach_cp1_packed_varlen_hooks(model)
    hooks.enable(document_ids_from_lengths(LENGTHS))
    model.blocks[1].attn.fail = True
    with pytest.raises(RuntimeError, match="boom"):
        model(torch.cat(docs)[None])
    assert torch.overrides._get_current_function_mode_stack() == []
    model.blocks[1].attn.fail = False
    hooks.enable(document_ids_from_lengths(LENGTHS))
    assert rel_err(model(torch.cat(docs)[None])[0], want) <= TOL


def test_bad_inputs_raise_clear_errors():
    model = ToyLM()
    with pytest.raises(ValueError, match="no cp1 hooks attached"):
        enable_cp1_packed_varlen(document_ids_from_lengths([4, 4]))
    hooks = attach_cp1_packed_varlen_hooks(model)
    with pytest.raises(ValueError, match="doc_ids"):
        hooks.enable(torch.tensor([1, 1, 2, 2, 1]))  # document 1 in two runs
    with pytest.raises(ValueError, match="doc_ids"):
        enable_cp1_packed_varlen(torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="attn_backend"):
        hooks.enable(torch.ones(4, dtype=torch.long), backend="nope")
    with pytest.raises(ValueError, match="no cp1 hooks attached on ToyLM"):
        enable_cp1_packed_varlen(torch.ones(4, dtype=torch.long), model=ToyLM())
    with pytest.raises(ValueError, match="no attention module"):
        attach_cp1_packed_varlen_hooks(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="ToyAttention, ToyAttention already hooked"):
        attach_cp1_packed_varlen_hooks(model)


def test_a_copy_of_a_hooked_model_is_not_hooked():
    """copy.deepcopy(model) (e.g. a reference model) works; the copy runs stock SDPA and arming the
    original does not arm it, so its output on the pack is the mixed (stock) one."""
    model = ToyLM()
    hooks = attach_cp1_packed_varlen_hooks(model)
    ids = torch.cat(make_docs(LENGTHS))[None]
    with torch.no_grad():
        stock = model(ids)
    twin = copy.deepcopy(model)
    hooks.enable(document_ids_from_lengths(LENGTHS))
    with torch.no_grad():
        packed, twin_out = model(ids), twin(ids)
    assert torch.equal(twin_out, stock)
    assert not torch.allclose(packed, stock)  # the pack really changes the original's output
    assert attach_cp1_packed_varlen_hooks(twin).attention_modules  # the copy can be hooked itself


def test_hf_model_on_sdpa_with_gradient_checkpointing():
    """An HF model whose attention calls F.scaled_dot_product_attention (attn_implementation='sdpa'),
    fed the pack with default positions (so HF itself sees one causal row), HF checkpointing on."""
    ref, _ = build_models("llama")
    docs = make_docs(LENGTHS)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("sdpa")
    enable_activation_checkpointing(model, use_reentrant=False)
    hooks = attach_cp1_packed_varlen_hooks(model)
    assert len(hooks.attention_modules) == 2
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS), model=model)
    logits = model(input_ids=torch.cat(docs)[None], use_cache=False).logits[0]
    loss = _doc_loss(logits.float(), docs)
    loss.backward()
    assert rel_err(loss, ref_loss) <= TOL
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()) <= TOL


@pytest.mark.parametrize("region", ["model", "layer", "attention"])
def test_a_compiled_hooked_forward_raises(region):
    """torch.compile is not supported through the hooks: an armed pack met while dynamo traces the
    model, a decoder layer or the hooked attention raises (not a silent eager fallback)."""
    torch.compiler.reset()
    _, model = build_models("llama")
    model.set_attn_implementation("sdpa")
    attach_cp1_packed_varlen_hooks(model)
    compiled = {"model": model, "layer": model.model.layers[0], "attention": model.model.layers[0].self_attn}[region]
    compiled.compile(backend="eager")
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS), model=model)
    with pytest.raises(AssertionError, match="hooks do not support torch.compile"):
        model(input_ids=torch.cat(make_docs(LENGTHS))[None], use_cache=False)


def test_compiled_modules_without_hooked_attention_stay_exact():
    """Compiling only modules that hold no hooked attention (the MLPs) leaves the packed step exact."""
    torch.compiler.reset()
    ref, _ = build_models("llama")
    docs = make_docs(LENGTHS)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    model = copy.deepcopy(ref)
    model.set_attn_implementation("sdpa")
    attach_cp1_packed_varlen_hooks(model)
    for layer in model.model.layers:
        layer.mlp.compile(backend="aot_eager")
    enable_cp1_packed_varlen(document_ids_from_lengths(LENGTHS), model=model)
    loss = _doc_loss(model(input_ids=torch.cat(docs)[None], use_cache=False).logits[0].float(), docs)
    loss.backward()
    assert rel_err(loss, ref_loss) <= TOL
    assert max(rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()) <= TOL

"""I8: outside a CP step `blockdiag_cp` is Transformers' `sdpa` (logits, padded eval, generate),
and the SDPA drop-in is `F.scaled_dot_product_attention`; misuse during a step raises (I7)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.step import active_step
from helpers.packs import make_pack
from helpers.reference import build_models


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_logits_equal_sdpa_outside_a_step(family):
    _, model = build_models(family)
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    model.eval(), sdpa.eval()
    ids = torch.randint(1, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: needs the padding mask, like sdpa
    with torch.no_grad():
        for kwargs in ({}, {"attention_mask": mask}):
            assert torch.equal(model(input_ids=ids, **kwargs).logits, sdpa(input_ids=ids, **kwargs).logits)
        # A packed row outside a step: sdpa's own packed-sequence mask from restarting position ids.
        pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
        assert torch.equal(model(input_ids=ids[:1], position_ids=pos).logits, sdpa(input_ids=ids[:1], position_ids=pos).logits)


def test_generate_matches_sdpa():
    _, model = build_models("llama")
    sdpa = copy.deepcopy(model)
    sdpa.set_attn_implementation("sdpa")
    model.eval(), sdpa.eval()
    ids = torch.randint(1, 100, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    ref = sdpa.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
    assert out.shape == (2, 11) and torch.equal(out, ref)


def test_sdpa_drop_in_outside_a_step():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    for kwargs in ({"is_causal": True}, {"is_causal": False}, {"attn_mask": torch.rand(7, 7, generator=g) > 0.3}):
        assert torch.equal(bdcp.cp_blockdiag_sdpa(q, k, v, **kwargs), F.scaled_dot_product_attention(q, k, v, **kwargs))


def test_sdpa_drop_in_inside_a_step_is_block_diagonal():
    """`cp_blockdiag_sdpa` with is_causal=True during a step equals per-document causal SDPA."""
    _, batch = make_pack("straddle", 1)
    train_ctx, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    g = torch.Generator().manual_seed(3)
    length = layout.local_len
    q, k, v = torch.randn(1, 4, length, 8, generator=g), torch.randn(1, 2, length, 8, generator=g), torch.randn(1, 2, length, 8, generator=g)
    with train_ctx():
        out = bdcp.cp_blockdiag_sdpa(q, k, v, is_causal=True, enable_gqa=True)
        with pytest.raises(ValueError, match="attn_mask"):
            bdcp.cp_blockdiag_sdpa(q, k, v, attn_mask=torch.ones(length, length, dtype=torch.bool), is_causal=True)
    doc = layout.document_ids
    want = torch.empty_like(out)
    for d in doc.unique():
        idx = (doc == d).nonzero().flatten()
        want[:, :, idx] = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx], is_causal=True, enable_gqa=True)
    assert torch.allclose(out, want, atol=1e-6)


def test_step_without_blockdiag_attention_raises():
    """A model on another attn_implementation inside train_ctx would attend locally: refuse it."""
    ref, _ = build_models("llama")  # eager
    _, batch = make_pack("straddle", 1)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with pytest.raises(RuntimeError, match="no attention call went through 'blockdiag_cp'"):
        with train_ctx():
            ref(**local).loss.backward()


def test_no_attention_error_names_the_models_current_attn_implementation():
    """The cause met in practice: a second model built on the same config object and switched to
    eager, which switches the CP model too; the error must name that implementation."""
    _, model = build_models("llama")
    other = type(model)(model.config)  # shares the config object
    other.set_attn_implementation("eager")
    _, batch = make_pack("straddle", 1)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with pytest.raises(RuntimeError, match=r"attention implementation is 'eager'; expected 'blockdiag_cp'.*"
                                           r"shares this config object"):
        with train_ctx():
            model(**local).loss.backward()
    # Without model=, the error says how to get that name.
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with pytest.raises(RuntimeError, match="pass model= to make_cp_blockdiag_batch_and_ctx"):
        with train_ctx():
            model(**local).loss.backward()
    # The right implementation, but its forward ran outside the step: that is what the error says.
    model.set_attn_implementation("blockdiag_cp")
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
    with pytest.raises(RuntimeError, match=r"is 'blockdiag_cp', so its forward did not run in this step"):
        with train_ctx():
            pass


def test_the_step_travels_in_the_local_batch_and_train_ctx_checks_it():
    """What README.md says of `train_ctx()`: attention finds the step in the local batch's
    `blockdiag_cp_step`, so `model(**local)` is block-diagonal with or without the context (equal
    loss and gradients, both the per-document eager loss); the context makes the step the active one
    (for code without the keyword, e.g. the SDPA drop-in) and checks on exit that attention ran."""
    ref, model = build_models("llama")
    docs, batch = make_pack("straddle", 1)
    want = sum(F.cross_entropy(ref(input_ids=d[None]).logits[0, :-1], d[1:], reduction="sum") for d in docs)
    want = want / sum(d.numel() - 1 for d in docs)
    results = []
    for inside in (True, False):
        model.zero_grad()
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, model=model)
        if inside:
            with train_ctx():
                assert active_step() is local["blockdiag_cp_step"]
                loss = model(**local).loss
                loss.backward()
        else:
            assert active_step() is None
            loss = model(**local).loss
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_in, grads_in), (loss_out, grads_out) = results
    assert torch.allclose(loss_in, want, rtol=1e-5) and torch.equal(loss_in, loss_out)
    assert all(torch.equal(a, b) for a, b in zip(grads_in, grads_out))

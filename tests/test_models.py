"""Model coverage (issue 6): every family trains exactly under blockdiag_cp.

Gloo parity (I1, I2): loss and every gradient under CP, with and without activation
checkpointing, equal the stock model with `eager` on each document separately, at
world sizes chosen so that each family runs at two sizes (one >= 3) and every size 1-4 is
covered. Then single-process tests of the attention features themselves: softcap and sinks
in the dense and flex kernels against an fp64 reference, kernel choice per feature,
bidirectional calls, and the pass-through outside a step.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.kernels import choose_kernel, unsupported_reason
from hf_blockdiag_cp.kernels.flex import flex_attention_kernel
from hf_blockdiag_cp.planning import document_ids_from_lengths, plan_layout
from hf_blockdiag_cp.attention import AttentionFeatures, blockdiag_cp_attention_forward, local_attention
from hf_blockdiag_cp.step import CPStep, build_step
from model_zoo import (
    IMAGE_GRID,
    LONGROPE_ORIGINAL_CONTEXT,
    WINDOW,
    build_pair,
    mrope_positions,
    reference_loss_and_grads,
    vl_image_docs,
)
from packs import make_pack
from reference import compare_with_reference, make_docs, rel_err

TOL = 1e-4

# family -> world sizes (each family at two sizes, one >= 3; every size 1-4 covered).
WORLD_SIZES = {
    "mistral": (2, 4),
    "qwen2": (1, 3),
    "qwen3": (3, 4),
    "gemma2": (2, 3),
    "gpt_oss": (1, 4),
    "deepseek_v3": (2, 3),
    "granite": (1, 4),
    "olmo2": (2, 3),
    "phi3": (2, 4),
    "qwen2_vl": (1, 3),  # text stack, 3-D positions given
    "qwen2_vl_image": (2, 4),  # with images: vision tower unsharded on every rank
}
CASES = [(family, g) for family, sizes in WORLD_SIZES.items() for g in sizes]


# --------------------------------------------------------------------------- packs and references


def _pack_from_docs(docs, extra_rows=None):
    ids = torch.cat(docs)[None]
    batch = {"input_ids": ids, "labels": ids.clone(), "document_ids": document_ids_from_lengths([d.numel() for d in docs])[None]}
    if extra_rows is not None:
        batch.update(extra_rows)
    return batch


def family_pack(family: str, world_size: int, mixed_longrope: bool = False, model=None):
    """(docs, packed batch, per-document extra reference inputs, shard_primary)."""
    if family == "phi3":
        # Every document is longer than the original context (LongRoPE's long factors for each
        # of them run alone), and at G = 4 rank 0 holds only positions 0..7 of the first one:
        # its own max(position_ids) would pick the short factors.
        lengths = [3, 12, 5, 9] if mixed_longrope else [9, 12, 11]
        assert max(lengths) > LONGROPE_ORIGINAL_CONTEXT
        docs = make_docs(lengths, seed=3)
        return docs, _pack_from_docs(docs), None, True
    if family == "qwen2_vl":
        docs = make_docs([5, 7, 3, 9, 4], seed=2)
        positions = torch.cat([mrope_positions(d.numel()) for d in docs], dim=-1)
        extra = [{"position_ids": mrope_positions(d.numel())} for d in docs]
        return docs, _pack_from_docs(docs, {"position_ids": positions}), extra, False
    if family == "qwen2_vl_image":
        return _vl_image_pack(model)
    docs, batch = make_pack("straddle", world_size)
    return docs, batch, None, True


def _vl_image_pack(model):
    """Text-image-text documents. The pack's 3-D positions are every document's stock
    `get_rope_index`, concatenated (what a user's collator does); the reference instead lets
    the stock model compute them from mm_token_type_ids, document by document."""
    items = vl_image_docs()
    grid = torch.tensor([IMAGE_GRID])
    rope_index = model.model.get_rope_index
    positions = torch.cat([rope_index(ids[None], types[None], image_grid_thw=grid)[0] for ids, types, _ in items], dim=-1)
    docs = [ids for ids, _, _ in items]
    batch = _pack_from_docs(docs, {
        "position_ids": positions,
        "pixel_values": torch.cat([px for _, _, px in items]),
        "image_grid_thw": grid.repeat(len(items), 1),
    })
    extra = [{"pixel_values": px, "image_grid_thw": grid, "mm_token_type_ids": types[None]} for _, types, px in items]
    return docs, batch, extra, False


def packed_stock_reference(ref, docs):
    """The stock model (eager) on the whole pack with restarting position ids: what a non-CP
    packed run computes, including its pack-wide dynamic-RoPE choice."""
    ref.zero_grad(set_to_none=True)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(d.numel()) for d in docs])[None]
    logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    total, count, start = 0.0, 0, 0
    for d in docs:
        n = d.numel()
        total = total + F.cross_entropy(logits[start : start + n - 1].float(), d[1:], reduction="sum")
        count, start = count + n - 1, start + n
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}


# --------------------------------------------------------------------------- gloo parity


def model_parity_case(rank, world_size, group, family, mixed_longrope=False):
    """Worst relative error per variant (plain, activation checkpointing) for one family."""
    bdcp.configure_cp_varlen("auto")
    try:
        ref, model = build_pair(family)
        docs, batch, extra, shard_primary = family_pack(family, world_size, mixed_longrope, ref)
        if mixed_longrope:
            ref_loss, ref_grads = packed_stock_reference(ref, docs)
        else:
            ref_loss, ref_grads = reference_loss_and_grads(ref, docs, extra)
        results = {}
        for checkpointing in (False, True):
            m = copy.deepcopy(model)
            if checkpointing:
                m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, shard_primary=shard_primary)
            with train_ctx() as step:
                loss = m(**local).loss
                loss.backward()
            errors = compare_with_reference(m, ref_loss, ref_grads, loss, group, world_size)
            worst = max(errors, key=errors.get)
            results["ac" if checkpointing else "plain"] = {
                "worst": (errors[worst], worst),
                "loss": errors["loss"],
                "sinks": {n: e for n, e in errors.items() if n.endswith("sinks")},
                "attention_calls": step.attention_calls,
            }
        results["sink_grad_norms"] = [float(g.norm()) for n, g in ref_grads.items() if n.endswith("sinks")]
        return results
    finally:
        bdcp.configure_cp_varlen()


def _assert_parity(results, family):
    for rank, res in enumerate(results):
        for variant in ("plain", "ac"):
            err, name = res[variant]["worst"]
            assert res[variant]["attention_calls"] > 0
            assert res[variant]["loss"] <= TOL, f"{family} rank {rank} {variant}: loss relative error {res[variant]['loss']:.2e}"
            assert err <= TOL, f"{family} rank {rank} {variant}: {name} relative error {err:.2e} > {TOL}"


@pytest.mark.parametrize("family,world_size", CASES, ids=[f"{f}-G{g}" for f, g in CASES])
def test_model_parity(gloo, family, world_size):
    results = gloo(world_size).run(model_parity_case, family=family)
    _assert_parity(results, family)
    if family == "gpt_oss":  # the sinks are trained: their gradient is non-zero and exact
        assert all(n > 1e-4 for n in results[0]["sink_grad_norms"]) and len(results[0]["sink_grad_norms"]) == 2
        for variant in ("plain", "ac"):
            assert len(results[0][variant]["sinks"]) == 2
            assert max(results[0][variant]["sinks"].values()) <= TOL


def test_phi3_longrope_mixed_pack_matches_stock_packed_run(gloo):
    """Documents on both sides of the original context: the pack's longest document picks the
    long factors for the whole pack (stock packed semantics); CP at G = 3 must agree."""
    results = gloo(3).run(model_parity_case, family="phi3", mixed_longrope=True)
    _assert_parity(results, "phi3 (mixed pack)")


def test_phi3_mixed_pack_reference_differs_per_document():
    """The mixed-pack reference is not the per-document one (so the test above can tell them apart)."""
    ref, _ = build_pair("phi3")
    docs, _, _, _ = family_pack("phi3", 3, mixed_longrope=True)
    _, packed_grads = packed_stock_reference(ref, docs)
    _, per_doc_grads = reference_loss_and_grads(ref, docs)
    assert max(rel_err(packed_grads[n], per_doc_grads[n]) for n in packed_grads) > 100 * TOL


# --------------------------------------------------------------------------- kernels and features


def naive_attention(q, k, v, doc_ids, *, scale, window=None, softcap=None, sinks=None):
    """fp64 reference over the whole pack: q/k/v [S,H*,D], per-document causal, window, softcap, sinks."""
    q, k, v = q.double(), k.double(), v.double()
    heads, group = q.shape[1], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    pos = torch.arange(q.shape[0])
    allowed = (doc_ids[:, None] == doc_ids[None, :]) & (pos[None, :] <= pos[:, None])
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double().view(heads, 1, 1).expand(heads, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : k.shape[0]]
    return torch.einsum("hqk,khd->qhd", probs, v)


def _kernel_inputs(world_size, lengths=(5, 7, 3, 9, 4, 2), heads=4, kv_heads=2, dk=8, dv=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = document_ids_from_lengths(list(lengths))
    layout = plan_layout(ids, world_size)
    s_pad = layout.padded_seq_len
    q = torch.randn(s_pad, heads, dk, generator=g, dtype=torch.float64)
    k = torch.randn(s_pad, kv_heads, dk, generator=g, dtype=torch.float64)
    v = torch.randn(s_pad, kv_heads, dv, generator=g, dtype=torch.float64)
    sinks = torch.randn(heads, generator=g, dtype=torch.float64)
    return layout, q, k, v, sinks


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("softcap,use_sinks", [(0.7, False), (None, True), (0.7, True)])
def test_dense_features_match_fp64_reference(world_size, window, softcap, use_sinks):
    """Every rank's rows of the dense kernel (softcap, sinks, window, GQA, Dv != Dk) against fp64,
    including the gradient of the sinks and of q/k/v."""
    layout, q, k, v, sinks = _kernel_inputs(world_size)
    sinks = sinks if use_sinks else None
    scale = 0.4
    leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sinks.clone().requires_grad_()] if use_sinks else [])
    want = naive_attention(*leaves[:3], layout.document_ids, scale=scale, window=window, softcap=softcap,
                           sinks=leaves[3] if use_sinks else None)
    cot = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * cot).sum(), leaves)
    got_rows, got_grads = [], [torch.zeros_like(t) for t in leaves]
    for rank in range(world_size):
        step = build_step(layout, rank, None, torch.device("cpu"), "dense", "allgather")
        lv = [t.clone().requires_grad_() for t in leaves]
        rows = layout.slot_positions.reshape(-1)  # what the all-gather would return, in slot order
        features = AttentionFeatures(softcap, lv[3] if use_sinks else None)
        out = local_attention(step, lv[0][layout.slot_positions[rank]], lv[1][rows], lv[2][rows], scale=scale,
                              sliding_window=window, features=features)
        mine = layout.slot_positions[rank]
        got_rows.append((mine, out))
        for acc, g in zip(got_grads, torch.autograd.grad((out * cot[mine]).sum(), lv)):
            acc += g
    for mine, out in got_rows:
        assert rel_err(out, want[mine]) < 1e-10
    for name, got, ref in zip(("q", "k", "v", "sinks"), got_grads, want_grads):
        assert rel_err(got, ref) < 1e-10, name


@pytest.mark.parametrize("softcap,use_sinks", [(0.7, False), (None, True), (0.7, True)])
def test_flex_features_forward_match_fp64_reference(softcap, use_sinks):
    """FlexAttention on CPU has no backward: its softcap and sinks are checked forward only."""
    layout, q, k, v, sinks = _kernel_inputs(2, dv=8)
    q, k, v, sinks = q.float(), k.float(), v.float(), sinks.float()
    want = naive_attention(q, k, v, layout.document_ids, scale=0.4, window=3, softcap=softcap,
                           sinks=sinks if use_sinks else None)
    rows = layout.slot_positions.reshape(-1)
    for rank in range(2):
        step = build_step(layout, rank, None, torch.device("cpu"), "flex", "allgather")
        features = AttentionFeatures(softcap, sinks if use_sinks else None)
        out = local_attention(step, q[layout.slot_positions[rank]], k[rows], v[rows], scale=0.4, sliding_window=3,
                              features=features)
        assert rel_err(out, want[layout.slot_positions[rank]]) < 1e-5
    assert flex_attention_kernel is not None


def test_kernel_choice_follows_layer_features():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_kernel("auto", cpu, torch.float32, 8, 8, frozenset({"softcap", "sinks"})).name == "dense"
    # On CUDA, auto skips varlen for a softcapped or sink layer (device type only: no GPU needed here).
    assert choose_kernel("auto", cuda, torch.bfloat16, 16, 16, frozenset({"sinks"})).name == "flex"
    assert choose_kernel("auto", cuda, torch.bfloat16, 16, 16, frozenset({"softcap"})).name == "flex"
    # Compiled flex cannot lower head dims under 16: auto falls back to dense, an explicit choice says why.
    assert choose_kernel("auto", cuda, torch.bfloat16, 8, 8, frozenset({"sinks"})).name == "dense"
    with pytest.raises(ValueError, match=r"attn_backend='flex'.*head dims of at least 16, got 16 \(key\) and 8"):
        choose_kernel("flex", cuda, torch.bfloat16, 16, 8)
    for feature in ("softcap", "sinks"):
        reason = unsupported_reason("varlen", cuda, torch.bfloat16, 8, 8, frozenset({feature}))
        assert reason is not None and feature in reason
        with pytest.raises(ValueError, match=rf"attn_backend='varlen'.*{feature}"):
            choose_kernel("varlen", cuda, torch.bfloat16, 8, 8, frozenset({feature}))
    assert unsupported_reason("dense", cpu, torch.float32, 8, 6, frozenset({"softcap", "sinks"})) is None
    assert unsupported_reason("flex", cpu, torch.float32, 8, 8, frozenset({"softcap", "sinks"})) is None


def _cp1_step_ctx(seq_len):
    batch = {"input_ids": torch.ones(1, seq_len, dtype=torch.long), "position_ids": torch.arange(seq_len)[None]}
    return bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)


def test_bidirectional_call_in_a_step_is_stock_sdpa_and_unsharded():
    """is_causal=False (vision towers): stock SDPA over whatever length it gets, never sharded."""
    train_ctx, local, _ = _cp1_step_ctx(8)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 13, 8, generator=g) for _ in range(3))  # 13 != the shard's 8 rows
    module = torch.nn.Module()
    module.is_causal = False
    step = local["blockdiag_cp_step"]
    with pytest.raises(RuntimeError, match="no attention call"):
        with train_ctx():
            out, _ = blockdiag_cp_attention_forward(module, q, k, v, None, scaling=0.3, is_causal=False, blockdiag_cp_step=step)
            assert step.attention_calls == 0
    want = F.scaled_dot_product_attention(q, k, v, scale=0.3).transpose(1, 2)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.parametrize("kwarg,value", [("position_bias", torch.zeros(1, 4, 8, 8)), ("sinks", torch.zeros(1, 4, 8, 1))])
def test_unsupported_attention_arguments_raise_in_a_step(kwarg, value):
    train_ctx, local, _ = _cp1_step_ctx(8)
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    module = torch.nn.Module()
    with pytest.raises(NotImplementedError, match=kwarg):
        with train_ctx():
            blockdiag_cp_attention_forward(module, q, k, v, None, **{kwarg: value}, **local)


@pytest.mark.parametrize("kwargs,field", [({"softcap": -1.0}, "softcap"), ({"s_aux": torch.zeros(3)}, "s_aux")])
def test_bad_feature_values_name_the_field(kwargs, field):
    q, k, v = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8)
    with pytest.raises(ValueError, match=field):
        blockdiag_cp_attention_forward(torch.nn.Module(), q, k, v, None, **kwargs)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_outside_a_step_softcap_and_sinks_match_eager(family):
    """I8 with features SDPA lacks: plain forward (train, and eval with a padding mask) equals eager."""
    ref, model = build_pair(family)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding on the second row
    for train in (True, False):
        ref.train(train)
        model.train(train)
        want = ref(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        assert rel_err(got[mask.bool()], want[mask.bool()]) < 1e-5
    out = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    want = ref.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(out, want)


def test_window_is_smaller_than_every_shard():
    """Guard on the test data itself: the parity cases exercise windows smaller than a shard."""
    for family, sizes in WORLD_SIZES.items():
        for g in sizes:
            _, batch, _, _ = family_pack(family, g, model=build_pair(family)[0] if "image" in family else None)
            local = plan_layout(batch["document_ids"][0] if "document_ids" in batch else torch.ones(batch["input_ids"].shape[1]), g).local_len
            assert WINDOW < local


def qwen2_vl_sharded_primary_case(rank, world_size, group):
    _, model = build_pair("qwen2_vl")
    _, batch, _, _ = family_pack("qwen2_vl", world_size)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, shard_primary=True)
    with train_ctx():
        model(**local).loss.backward()


def test_qwen2_vl_needs_the_full_pack(gloo):
    """Qwen2-VL sharded like a text model (shard_primary=True) is refused on every rank, by name."""
    results, errors = gloo(2).run_collecting(qwen2_vl_sharded_primary_case)
    assert not results and sorted(errors) == [0, 1]
    for tb in errors.values():
        assert "ValueError" in tb and "shard_primary=False" in tb, tb[-800:]


def test_qwen2_vl_images_need_3d_positions():
    """Images with the shard step's 1-D text positions would rotate image tokens as text: refused."""
    ref, model = build_pair("qwen2_vl_image")
    _, batch, _, _ = _vl_image_pack(ref)
    del batch["position_ids"]
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, shard_primary=False)
    with pytest.raises(ValueError, match=r"position_ids \[3,1,S\]"):
        with train_ctx():
            model(**local)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention has no CPU backward)")
@pytest.mark.parametrize("softcap,use_sinks", [(0.7, False), (None, True), (0.7, True)])
def test_flex_features_forward_and_backward_cuda(softcap, use_sinks):
    """On CUDA the flex kernel trains: outputs and gradients of q, k, v and the sinks equal the dense kernel's."""
    layout, q, k, v, sinks = _kernel_inputs(2, dk=16, dv=32)  # compiled flex needs head dims >= 16
    device = torch.device("cuda")
    leaves = [t.float().to(device).requires_grad_() for t in (q, k, v, sinks)]
    rows = layout.slot_positions.reshape(-1).to(device)
    results = {}
    for backend in ("dense", "flex"):
        grads, outs = [torch.zeros_like(t) for t in leaves], []
        for rank in range(2):
            step = build_step(layout, rank, None, device, backend, "allgather")
            mine = layout.slot_positions[rank].to(device)
            lv = [t.detach().clone().requires_grad_() for t in leaves]
            features = AttentionFeatures(softcap, lv[3] if use_sinks else None)
            out = local_attention(step, lv[0][mine], lv[1][rows], lv[2][rows], scale=0.4, sliding_window=3, features=features)
            out.square().sum().backward()
            outs.append(out.detach())
            for acc, t in zip(grads, lv):
                if t.grad is not None:
                    acc += t.grad
        results[backend] = (outs, grads)
    for a, b in zip(results["flex"][0], results["dense"][0]):
        assert rel_err(a, b) < 1e-4
    for name, a, b in zip(("q", "k", "v", "sinks"), results["flex"][1], results["dense"][1]):
        assert rel_err(a, b) < 1e-4, name

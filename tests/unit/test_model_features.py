"""Model features in one process (docs/models.md): softcap and sinks in the dense and flex
kernels against an fp64 reference, kernel choice per layer feature, bidirectional calls and
unsupported arguments inside a step, the pass-through outside a step (invariant I8,
docs/design.md) and Qwen2-VL's refusal of images without 3-D positions (I7). The gloo parity of
every family is in multiprocess/test_model_parity.py; flex forward and backward on CUDA in
gpu/test_flex_features_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.attention import AttentionFeatures, blockdiag_cp_attention_forward, local_attention
from hf_blockdiag_cp.kernels import choose_kernel, unsupported_reason
from hf_blockdiag_cp.kernels.attention.flex import flex_attention_kernel
from hf_blockdiag_cp.step import build_step
from helpers.kernel_inputs import kernel_inputs, naive_attention
from helpers.model_packs import vl_image_pack
from helpers.model_zoo import build_pair
from helpers.reference import rel_err


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("softcap,use_sinks", [(0.7, False), (None, True), (0.7, True)])
def test_dense_features_match_fp64_reference(world_size, window, softcap, use_sinks):
    """Every rank's rows of the dense kernel (softcap, sinks, window, GQA, Dv != Dk) against fp64,
    including the gradient of the sinks and of q/k/v."""
    layout, q, k, v, sinks = kernel_inputs(world_size)
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
    layout, q, k, v, sinks = kernel_inputs(2, dv=8)
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


def test_qwen2_vl_images_need_3d_positions():
    """Images with the shard step's 1-D text positions would rotate image tokens as text: refused."""
    ref, model = build_pair("qwen2_vl_image")
    _, batch, _, _ = vl_image_pack(ref)
    del batch["position_ids"]
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, shard_primary=False)
    with pytest.raises(ValueError, match=r"position_ids \[3,1,S\]"):
        with train_ctx():
            model(**local)

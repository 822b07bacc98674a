"""The gated delta-rule patch on one process (model_patches/gated_delta.py; docs/models.md).

- A patched layer on a 2-document pack equals the stock layer on each document alone (outputs
  and parameter gradients), and the reference discriminates: the stock layer on the pack, a
  convolution that crosses the boundary, and a state that crosses it all differ from it.
- Outside a CP step without packing information the patched model is the stock model (forward
  and cached generation), for the KDA and short-convolution hybrids too.
- A hybrid without the patch cannot run a CP step; the VL model's text steps equal its stock
  model per document, and it refuses images in a step.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.kernels import RunTable
from hf_blockdiag_cp.kernels.mixers.delta_rule import torch_delta_rule
from hf_blockdiag_cp.kernels.mixers.short_conv import torch_short_conv
from hf_blockdiag_cp.mixers import MixerContext
from hf_blockdiag_cp.model_patches import gated_delta
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from helpers.model_zoo import (
    CONV_FAMILIES, HYBRID_FAMILIES, KDA_FAMILIES, build_hybrid_pair, check_stock_outside_a_step, tiny_hybrid_config,
    tiny_hybrid_vl_model,
)
from helpers.reference import check_layer_per_document, make_docs, reference_loss_and_grads, rel_err

LENGTHS = (70, 45)  # the first document spans two 64-token chunks of the delta rule


def _layers(family):
    ref, model = build_hybrid_pair(family)
    pick = [m for m in model.modules() if gated_delta.is_gated_delta_net(m)][0]
    stock = [m for m in ref.modules() if gated_delta.is_gated_delta_net(m)][0]
    return stock, pick


def _inputs(hidden_size):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, sum(LENGTHS), hidden_size, generator=g)
    probe = torch.randn(1, sum(LENGTHS), hidden_size, generator=g)
    return x, probe


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_packed_layer_equals_each_document_alone(family):
    check_layer_per_document(*_layers(family), LENGTHS)


def _mixer_out(layer, x, conv_runs: MixerRuns, rule_runs: MixerRuns):
    """The layer's core output with its convolution restarted at `conv_runs` and its delta rule at `rule_runs`
    (the torch kernels called directly)."""
    mixed, _, b, a = gated_delta.input_projections(layer, x[0])
    spec = gated_delta.mixer_layer(layer)
    mixed = torch_short_conv(mixed, spec.conv_weight, spec.conv_bias, spec.activation, RunTable.build(conv_runs, "cpu"))
    rows, kw = mixed.shape[0], spec.key_heads * spec.key_dim
    q, k, v = mixed.split([kw, kw, spec.value_heads * spec.value_dim], dim=-1)
    q, k, v = q.reshape(rows, spec.key_heads, -1), k.reshape(rows, spec.key_heads, -1), v.reshape(rows, spec.value_heads, -1)
    beta, g = spec.gates(b, a, slice(None))
    return torch_delta_rule(q, k, v, g, beta, RunTable.build(rule_runs, "cpu"), torch_rule=spec.torch_rule)[0]


@pytest.mark.parametrize("family", HYBRID_FAMILIES)
def test_reference_catches_a_crossing_convolution_or_state(family):
    """Letting only the convolution, or only the recurrent state, cross the boundary changes the
    second document: each mechanism on its own is seen by the per-document reference."""
    _, layer = _layers(family)
    x, _ = _inputs(layer.hidden_size)
    length = sum(LENGTHS)
    split = MixerRuns.documents(torch.tensor([0, LENGTHS[0], length]), length)
    whole = MixerRuns.documents(torch.tensor([0, length]), length)
    with torch.no_grad():
        exact = _mixer_out(layer, x, split, split)
        conv_crosses = _mixer_out(layer, x, whole, split)
        state_crosses = _mixer_out(layer, x, split, whole)
        mixed, _, b, a = gated_delta.input_projections(layer, x[0])
        mixer = gated_delta.gated_delta_mix(gated_delta.mixer_layer(layer), mixed, b, a, MixerContext.from_runs(split))
    assert rel_err(mixer, exact) <= 1e-6  # the mixer the patch runs is this composition
    second = slice(LENGTHS[0], length)
    assert rel_err(conv_crosses[second], exact[second]) > 1e-3
    assert rel_err(state_crosses[second], exact[second]) > 1e-3
    assert torch.equal(conv_crosses[: LENGTHS[0]], exact[: LENGTHS[0]])


@pytest.mark.parametrize("family", HYBRID_FAMILIES + CONV_FAMILIES + KDA_FAMILIES)
def test_outside_a_step_the_model_is_stock(family):
    check_stock_outside_a_step(family, generate=family == "qwen3_5")  # generation: once for the patched forward


def test_the_step_logs_what_the_token_mixers_ran():
    _, model = build_hybrid_pair("qwen3_5")
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch, config=bdcp.CPConfig(mixer_backend="torch"))
    with train_ctx() as step:
        model(**local).loss.backward()
    assert step.choices.mixers == "gated_delta_rule=torch short_conv=torch transport=local"
    assert step.choices.as_logs()["cp_mixers"] == step.choices.mixers
    assert "token mixers gated_delta_rule=torch" in step.choices.describe()


def test_hybrid_without_the_patch_cannot_run_a_step():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config("qwen3_next"), attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with pytest.raises(RuntimeError, match=r"gated_delta_packed.*apply_model_patches\(model\)"):
        with train_ctx():
            model(**local).loss.backward()
    assert bdcp.apply_model_patches(copy.deepcopy(model)) == ("gated_delta_packed", "router_aux_loss")  # an MoE


def test_vl_model_text_steps_equal_its_stock_model_per_document_and_images_are_refused():
    torch.manual_seed(0)
    model = tiny_hybrid_vl_model()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    ref.train(), model.train()
    assert bdcp.apply_model_patches(model) == ("gated_delta_packed",)
    lengths = [70, 3, 50]  # the first document spans two 64-token chunks of the delta rule
    docs = make_docs(lengths, seed=2)
    ids = torch.cat(docs)[None]
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.cat([torch.arange(n) for n in lengths])[None]}
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with train_ctx():
        loss = model(**local).loss
        loss.backward()
    assert rel_err(loss.detach(), ref_loss) <= 1e-5
    for name, p in model.named_parameters():
        if name in ref_grads:
            assert rel_err(p.grad, ref_grads[name]) <= 1e-4, name
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, batch)
    with pytest.raises(ValueError, match="images or videos are not supported"):
        with train_ctx():
            model(**local, pixel_values=torch.randn(4, 12), image_grid_thw=torch.tensor([[1, 2, 2]]))

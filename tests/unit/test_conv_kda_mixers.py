"""The short-convolution (LFM2) and KDA (Kimi Linear, Bailing-Hybrid) patches on one process
(model_patches/lfm2.py, model_patches/kda.py; docs/models.md).

- Each family's model gets its patch from `apply_model_patches` (a type off the unsupported list
  without a registered patch would train silently wrong).
- A patched layer on a 2-document pack equals the stock layer on each document alone (outputs and
  parameter gradients), and the stock layer on the pack differs from it.
- The reference discriminates: a convolution that crosses the boundary and (KDA) a state that
  crosses it each change the second document.
- The head-parallel cost counts KDA's per-channel gate. (Outside a step the models are stock:
  `test_gated_delta.py`.)
"""

from __future__ import annotations

import importlib

import pytest
import torch

from hf_blockdiag_cp.kernels import RunTable
from hf_blockdiag_cp.kernels.mixers.delta_rule import torch_delta_rule
from hf_blockdiag_cp.kernels.mixers.short_conv import torch_short_conv
from hf_blockdiag_cp.mixers import MixerContext, gated_conv_mix, gated_delta_mix
from hf_blockdiag_cp.model_patches import apply_model_patches, gated_delta, kda, lfm2
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from helpers.model_zoo import CONV_FAMILIES, KDA_FAMILIES, build_hybrid_pair
from helpers.reference import check_layer_per_document, rel_err

LENGTHS = (70, 45)  # the first document spans two 64-token chunks of the KDA rule
FAMILIES = CONV_FAMILIES + KDA_FAMILIES
PATCH_NAMES = {"lfm2": "short_conv_packed", "lfm2_moe": "short_conv_packed", "kimi_linear": "kda_packed",
               "bailing_hybrid": "kda_packed"}


def _is_layer(family):
    return lfm2.is_short_conv if family in CONV_FAMILIES else kda.is_kda_layer


def _layers(family):
    ref, model = build_hybrid_pair(family)
    pick = _is_layer(family)
    return [m for m in ref.modules() if pick(m)][0], [m for m in model.modules() if pick(m)][0]


def _hidden(hidden_size):
    return torch.randn(1, sum(LENGTHS), hidden_size, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_gets_its_patch(family):
    ref, model = build_hybrid_pair(family)
    assert PATCH_NAMES[family] in apply_model_patches(model)
    assert sum(_is_layer(family)(m) and "forward" in vars(m) for m in model.modules()) == 2  # both mixer layers


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_layer_equals_each_document_alone(family):
    check_layer_per_document(*_layers(family), LENGTHS)


def _runs():
    length = sum(LENGTHS)
    return (MixerRuns.documents(torch.tensor([0, LENGTHS[0], length]), length),
            MixerRuns.documents(torch.tensor([0, length]), length))


@pytest.mark.parametrize("family", CONV_FAMILIES)
def test_conv_reference_catches_a_crossing_convolution(family):
    _, layer = _layers(family)
    x = _hidden(layer.config.hidden_size)
    split, whole = _runs()
    spec = lfm2.mixer_layer(layer)
    with torch.no_grad():
        gate_in, _, values = layer.in_proj(x[0]).chunk(3, dim=-1)
        gated = gate_in * values
        exact = torch_short_conv(gated, spec.conv_weight, spec.conv_bias, None, RunTable.build(split, "cpu"))
        crosses = torch_short_conv(gated, spec.conv_weight, spec.conv_bias, None, RunTable.build(whole, "cpu"))
        mixer = gated_conv_mix(spec, gated, MixerContext.from_runs(split))
    assert rel_err(mixer, exact) <= 1e-6  # the mixer the patch runs is this convolution
    second = slice(LENGTHS[0], sum(LENGTHS))
    assert rel_err(crosses[second], exact[second]) > 1e-3
    assert torch.equal(crosses[: LENGTHS[0]], exact[: LENGTHS[0]])


def _kda_out(layer, x, conv_runs: MixerRuns, rule_runs: MixerRuns):
    """The KDA layer's core output with its convolution restarted at `conv_runs` and its rule at `rule_runs`."""
    mixed, _, b, a = kda.input_projections(layer, x[0])
    spec = kda.mixer_layer(layer)
    mixed = torch_short_conv(mixed, spec.conv_weight, spec.conv_bias, spec.activation, RunTable.build(conv_runs, "cpu"))
    q, k, v = (t.reshape(mixed.shape[0], spec.key_heads, -1) for t in mixed.chunk(3, dim=-1))
    beta, g = spec.gates(b, a, slice(None))
    return torch_delta_rule(q, k, v, g, beta, RunTable.build(rule_runs, "cpu"), torch_rule=spec.torch_rule)[0]


@pytest.mark.parametrize("family", KDA_FAMILIES)
def test_kda_reference_catches_a_crossing_convolution_or_state(family):
    _, layer = _layers(family)
    x = _hidden(layer.hidden_size)
    split, whole = _runs()
    with torch.no_grad():
        exact = _kda_out(layer, x, split, split)
        conv_crosses = _kda_out(layer, x, whole, split)
        state_crosses = _kda_out(layer, x, split, whole)
        mixed, _, b, a = kda.input_projections(layer, x[0])
        mixer = gated_delta_mix(kda.mixer_layer(layer), mixed, b, a, MixerContext.from_runs(split))
    assert rel_err(mixer, exact) <= 1e-6
    second = slice(LENGTHS[0], sum(LENGTHS))
    assert rel_err(conv_crosses[second], exact[second]) > 1e-3
    assert rel_err(state_crosses[second], exact[second]) > 1e-3
    assert torch.equal(state_crosses[: LENGTHS[0]], exact[: LENGTHS[0]])


def test_kda_layer_shape_counts_its_per_channel_gate():
    """The head-parallel transport's cost counts what it sends per row: q, k, v, beta and KDA's forget-gate
    input, Dk channels per head (the gated delta rule sends one)."""
    _, layer = _layers("kimi_linear")
    spec = kda.mixer_layer(layer)
    heads, dim = layer.num_heads, layer.head_dim
    assert spec.shape(2).input_channels == 3 * heads * dim + heads + heads * dim
    _, olmo = build_hybrid_pair("olmo_hybrid")
    gdn = gated_delta.mixer_layer(next(m for m in olmo.modules() if gated_delta.is_gated_delta_net(m)))
    assert gdn.shape(2).input_channels == 2 * gdn.key_heads * gdn.key_dim + gdn.value_heads * gdn.value_dim + 2 * gdn.value_heads


@pytest.mark.parametrize("patch", ["gated_delta", "kda", "lfm2", "mamba1", "mamba2"])
def test_a_mixer_patch_that_finds_no_layer_raises_naming_it(patch):
    """Every mixer patch: a model whose type names the patch but that holds none of its layers (a
    renamed upstream class, say) must not train on the stock, document-crossing mixer silently."""
    module = importlib.import_module(f"hf_blockdiag_cp.model_patches.{patch}")
    with pytest.raises(RuntimeError, match=rf"model_patches\.{patch}: no .* found in Sequential"):
        module.apply(torch.nn.Sequential(torch.nn.Linear(2, 2)))

"""The Mamba2 (SSD) and Mamba1 (selective-scan) patches and kernels on one process
(model_patches/mamba2.py, mamba1.py; mixers/ssd.py, selective_scan.py; kernels/mixers/ssd.py,
selective_scan.py; docs/models.md).

- The torch SSD and selective-scan kernels equal a float64 step-by-step recurrence per run (the
  SSD scan from zero or given start states) and return each run's final state.
- A patched mixer layer of every family on a 3-document pack equals the stock layer on each
  document alone (outputs and parameter gradients), and the reference discriminates: the stock
  layer on the pack, a convolution that crosses a boundary, and a state that crosses it all differ.
- Outside a CP step without packing information the patched model is the stock model (forward
  and cached generation); without the patch a hybrid cannot run a step; the step logs its kernels.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.kernels import RunTable, choose_mixer_kernel
from hf_blockdiag_cp.kernels.mixers.registry import MixerDims
from hf_blockdiag_cp.kernels.mixers.selective_scan import torch_selective_scan
from hf_blockdiag_cp.kernels.mixers.short_conv import torch_short_conv
from hf_blockdiag_cp.kernels.mixers.ssd import torch_ssd_scan
from hf_blockdiag_cp.mixers import MixerContext, selective_scan, ssd
from hf_blockdiag_cp.model_patches import mamba1, mamba2
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from helpers.model_zoo import (MAMBA1_FAMILIES, MAMBA2_FAMILIES, build_hybrid_pair, check_stock_outside_a_step, step_mixers,
                               tiny_hybrid_config, two_document_row)
from helpers.reference import check_layer_per_document, fake_fla_gla, rel_err

LENGTHS = (37, 1, 26)  # the first document crosses two 16-row chunks of the scan


def _recurrence(x, dt, A, B, C, D, runs: MixerRuns, start=None, per_entry=False):
    """float64 S_t = exp(dt_t·A)·S_{t-1} + dt_t·x_t ⊗ B_t, y_t = S_t·C_t + D·x_t per head, restarted per run:
    x `[T, H, P]`, dt `[T, H]`, B, C `[T, G, N]`; A `[H]` (Mamba2) or, `per_entry`, `[H, N]` (Mamba1, P = 1)."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    heads, groups = x.shape[1], B.shape[1]
    B, C = B.repeat_interleave(heads // groups, 1), C.repeat_interleave(heads // groups, 1)
    out, finals = torch.zeros_like(x), []
    bounds = runs.boundaries.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = torch.zeros(heads, x.shape[2], B.shape[2], dtype=torch.float64) if start is None else start[i].double()
        for t in range(a, b):
            decay = torch.exp(dt[t][:, None] * A)[:, None, :] if per_entry else torch.exp(dt[t] * A)[:, None, None]
            state = decay * state + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
            out[t] = torch.einsum("hpn,hn->hp", state, C[t]) + D[:, None] * x[t]
        finals.append(state)
    return out, torch.stack(finals)


def test_torch_kernel_equals_the_recurrence_per_run():
    g = torch.Generator().manual_seed(0)
    rows, heads, head_dim, groups, state = 75, 4, 3, 2, 5
    x, B, C = torch.randn(rows, heads, head_dim, generator=g), torch.randn(rows, groups, state, generator=g), torch.randn(rows, groups, state, generator=g)
    dt = torch.rand(rows, heads, generator=g) * 0.5
    A, D = -torch.rand(heads, generator=g) - 0.1, torch.randn(heads, generator=g)
    runs = MixerRuns(torch.tensor([0, 37, 38, 70, 75]), torch.tensor([True, True, True, False]))
    table = RunTable.build(runs, "cpu")
    scan = mamba2.family_function(_stock_mixer(), "mamba2_chunk_scan")
    start = torch.randn(4, heads, head_dim, state, generator=g)
    for initial in (None, start):
        out, final = torch_ssd_scan(x, dt, A, B, C, D, table, initial, True, scan, chunk_size=16)
        ref_out, ref_final = _recurrence(x, dt, A, B, C, D, runs, initial)
        docs = runs.row_is_document
        assert rel_err(out[docs], ref_out[docs]) <= 1e-5
        assert torch.equal(out[~docs], torch.zeros_like(out[~docs]))  # a padding run's output is zero
        assert rel_err(final[:3], ref_final[:3]) <= 1e-5


def test_fla_ssd_scan_feeds_gla_the_ssd_scan(monkeypatch):
    """The SSD scan mapped onto GLA (q = C, k = B, v = dt·x, g = dt·A on every key channel, state [P, N]) equals the
    float64 recurrence, with fla's kernel replaced by its documented definition: the mapping is checked
    here on every CI run; the GPU check (tests/gpu/test_mixer_kernels_gpu.py) checks fla's kernel."""
    from hf_blockdiag_cp.kernels.mixers.ssd import fla_ssd_scan

    fake_fla_gla(monkeypatch)
    g = torch.Generator().manual_seed(3)
    rows, heads, head_dim, groups, state = 75, 4, 3, 2, 5
    x, B, C = torch.randn(rows, heads, head_dim, generator=g), torch.randn(rows, groups, state, generator=g), torch.randn(rows, groups, state, generator=g)
    dt, A, D = torch.rand(rows, heads, generator=g) * 0.5, -torch.rand(heads, generator=g) - 0.1, torch.randn(heads, generator=g)
    runs = MixerRuns(torch.tensor([0, 37, 38, 70, 75]), torch.tensor([True, True, True, False]))
    out, final = fla_ssd_scan(x, dt, A, B, C, D, RunTable.build(runs, "cpu"), None, True)
    ref_out, ref_final = _recurrence(x, dt, A, B, C, D, runs)
    docs = runs.row_is_document
    assert rel_err(out[docs], ref_out[docs]) <= 1e-5 and rel_err(final[:3], ref_final[:3]) <= 1e-5
    assert torch.equal(out[~docs], torch.zeros_like(out[~docs])) and torch.equal(final[3], torch.zeros_like(final[3]))


def test_torch_selective_scan_equals_the_recurrence_per_run():
    g = torch.Generator().manual_seed(1)
    rows, channels, state = 75, 6, 5
    x, B, C = torch.randn(rows, channels, generator=g), torch.randn(rows, state, generator=g), torch.randn(rows, state, generator=g)
    dt, A, D = torch.rand(rows, channels, generator=g) * 0.5, -torch.rand(channels, state, generator=g) - 0.1, torch.randn(channels, generator=g)
    runs = MixerRuns(torch.tensor([0, 37, 38, 70, 75]), torch.tensor([True, True, True, False]))
    scan = mamba1.family_function(_stock_mixer("mamba"), "mamba_selective_scan")
    out, final = torch_selective_scan(x, dt, A, B, C, D, RunTable.build(runs, "cpu"), None, True, scan)
    # the float64 recurrence, with one head per channel: x [T, Dc, 1], B, C shared by every channel
    ref_out, ref_final = _recurrence(x[:, :, None], dt, A, B[:, None].expand(-1, channels, -1), C[:, None].expand(-1, channels, -1),
                                     D, runs, per_entry=True)
    docs = runs.row_is_document
    assert rel_err(out[docs], ref_out[docs, :, 0]) <= 1e-5
    assert torch.equal(out[~docs], torch.zeros_like(out[~docs]))
    assert rel_err(final[:3], ref_final[:3, :, 0]) <= 1e-5


def _stock_mixer(family: str = "nemotron_h"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config(family), attn_implementation="eager")
    return [m for m in model.modules() if _is_mixer(m)][0]


def _is_mixer(module) -> bool:
    return mamba2.is_ssd_mixer(module) or mamba1.is_selective_scan_mixer(module)


def _layers(family, **overrides):
    ref, model = build_hybrid_pair(family, **overrides)
    stock = [m for m in ref.modules() if _is_mixer(m)][0]
    patched = [m for m in model.modules() if _is_mixer(m)][0]
    return stock, patched


def _inputs(hidden_size):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, sum(LENGTHS), hidden_size, generator=g), torch.randn(1, sum(LENGTHS), hidden_size, generator=g)


@pytest.mark.parametrize("family", MAMBA2_FAMILIES + MAMBA1_FAMILIES)
def test_packed_layer_equals_each_document_alone(family):
    check_layer_per_document(*_layers(family), LENGTHS)


def test_falcon_h1_with_its_gated_norm_equals_each_document_alone():
    """FalconH1's other output path: the gated RMS norm (`mamba_rms_norm`) instead of the SiLU gate."""
    check_layer_per_document(*_layers("falcon_h1", mamba_rms_norm=True), LENGTHS)


def _scan_out(layer, x, conv_runs: MixerRuns, scan_runs: MixerRuns):
    """The layer's scan output with its convolution restarted at `conv_runs` and its scan at `scan_runs`
    (the torch kernels called directly), and the output of the mixer the patch runs (runs: `conv_runs`)."""
    conv_table, scan_table = RunTable.build(conv_runs, "cpu"), RunTable.build(scan_runs, "cpu")
    if mamba1.is_selective_scan_mixer(layer):
        spec = mamba1.mixer_layer(layer)
        xs, _ = layer.in_proj(x)[0].chunk(2, dim=-1)
        mixer = selective_scan.selective_scan_mix(spec, xs, lambda xc: mamba1._time_step_b_c(layer, xc),
                                                  MixerContext.from_runs(conv_runs))
        xs = torch_short_conv(xs, spec.conv_weight, spec.conv_bias, spec.activation, conv_table)
        dt, B, C = mamba1._time_step_b_c(layer, xs)
        out = torch_selective_scan(xs, selective_scan.time_steps(spec, dt), -spec.A_log.float().exp(), B, C,
                                   spec.D.float(), scan_table, torch_scan=spec.torch_scan)[0]
        return out, mixer
    _, xbc, dt = mamba2.input_projections(layer, x[0])
    spec = mamba2.mixer_layer(layer)
    mixer = ssd.ssd_mix(spec, xbc, dt, MixerContext.from_runs(conv_runs))
    xbc = torch_short_conv(xbc, spec.conv_weight, spec.conv_bias, spec.activation, conv_table)
    rows, width = xbc.shape[0], spec.groups * spec.state_size
    xs, B, C = xbc.split([spec.heads * spec.head_dim, width, width], dim=-1)
    xs, B, C = xs.reshape(rows, spec.heads, -1), B.reshape(rows, spec.groups, -1), C.reshape(rows, spec.groups, -1)
    out = torch_ssd_scan(xs, ssd.time_steps(spec, dt), -spec.A_log.float().exp(), B, C, spec.D, scan_table,
                         torch_scan=spec.torch_scan, chunk_size=spec.chunk_size)[0]
    return out, mixer


@pytest.mark.parametrize("family", MAMBA2_FAMILIES + MAMBA1_FAMILIES)
def test_reference_catches_a_crossing_convolution_or_state(family):
    """Letting only the convolution, or only the scan state, cross the boundary changes the second
    document: each mechanism on its own is seen by the per-document reference."""
    _, layer = _layers(family)
    x, _ = _inputs(layer.hidden_size)
    length, first = sum(LENGTHS), LENGTHS[0]
    split = MixerRuns.documents(torch.tensor([0, first, length]), length)
    whole = MixerRuns.documents(torch.tensor([0, length]), length)
    with torch.no_grad():
        exact, mixer = _scan_out(layer, x, split, split)
        conv_crosses, _ = _scan_out(layer, x, whole, split)
        state_crosses, _ = _scan_out(layer, x, split, whole)
    assert rel_err(mixer, exact) <= 1e-6  # the mixer the patch runs is this composition
    second = slice(first, length)
    assert rel_err(conv_crosses[second], exact[second]) > 1e-3
    assert rel_err(state_crosses[second], exact[second]) > 1e-3
    assert torch.equal(conv_crosses[:first], exact[:first])


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2", "jamba", "mamba"])
def test_outside_a_step_the_model_is_stock(family):
    check_stock_outside_a_step(family)


@pytest.mark.parametrize("family,scan", [("nemotron_h", "ssd_scan"), ("mamba2", "ssd_scan"), ("jamba", "selective_scan"),
                                         ("mamba", "selective_scan")])
def test_the_step_logs_what_the_token_mixers_ran(family, scan):
    assert step_mixers(family) == " ".join(sorted([f"{scan}=torch", "short_conv=torch"])) + " transport=local"


def test_hybrid_without_the_patch_cannot_run_a_step():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config("nemotron_h"), attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, two_document_row())
    with pytest.raises(RuntimeError, match=r"mamba2_packed.*apply_model_patches\(model\)"):
        with train_ctx():
            model(**local).loss.backward()
    assert bdcp.apply_model_patches(copy.deepcopy(model)) == ("mamba2_packed",)


def test_a_hybrid_whose_attention_bypasses_the_step_still_raises():
    """Only a model without attention layers may run a step without an attention call: a patched
    NemotronH on `sdpa` attention (its attention layers attend inside the shard) raises."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_hybrid_config("nemotron_h"), attn_implementation="sdpa")
    bdcp.apply_model_patches(model)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, two_document_row())
    with pytest.raises(RuntimeError, match="no attention call went through"):
        with train_ctx():
            model(**local).loss.backward()


def test_unverified_scan_kernels_are_refused():
    """mamba-ssm has no record until verified; fla's scan is refused off CUDA; auto falls back to torch."""
    with pytest.raises(ValueError, match="mixer_backend='mamba_ssm' has no ssd_scan kernel"):
        choose_mixer_kernel("ssd_scan", "mamba_ssm", torch.device("cpu"), torch.float32, MixerDims(8, 8))
    with pytest.raises(ValueError, match="fla.*CUDA"):
        choose_mixer_kernel("ssd_scan", "fla", torch.device("cpu"), torch.bfloat16, MixerDims(8, 8))
    assert choose_mixer_kernel("ssd_scan", "auto", torch.device("cpu"), torch.bfloat16, MixerDims(8, 8)).name == "torch"


def test_gpu_fallback_warning_says_no_fast_selective_scan_exists(caplog):
    """On a GPU, Mamba1's scan runs the torch kernel because no library scans packed documents: the warning
    says so instead of pointing at an install (the gated delta rule's still names fla's refusal)."""
    from hf_blockdiag_cp.comm.notice import forget
    from hf_blockdiag_cp.mixers.context import _warn_torch_on_gpu

    x = torch.empty(4, 8, device="meta")
    keys = [("mixer torch on gpu", op, x.dtype, MixerDims(8, 8)) for op in ("selective_scan", "gated_delta_rule")]
    for key in keys:
        forget(key)
    with caplog.at_level("WARNING", logger="hf_blockdiag_cp"):
        _warn_torch_on_gpu("selective_scan", x, MixerDims(8, 8))
        _warn_torch_on_gpu("gated_delta_rule", x, MixerDims(8, 8))
    scan, rule = (r.getMessage() for r in caplog.records)
    assert "no fast selective_scan kernel exists for packed documents" in scan and "install" in scan
    assert "docs/gpu.md says what to install" not in scan
    assert "fla: " in rule and "docs/gpu.md says what to install" in rule
    for key in keys:
        forget(key)

"""The Mamba2 (SSD) patch and kernels on one process (model_patches/mamba2.py, mixers/ssd.py,
kernels/ssd.py; docs/models.md).

- The torch SSD kernel equals a float64 step-by-step recurrence per run, from zero or given
  start states, and returns each run's final state.
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
from hf_blockdiag_cp.kernels.mixer_registry import MixerDims
from hf_blockdiag_cp.kernels.short_conv import torch_short_conv
from hf_blockdiag_cp.kernels.ssd import torch_ssd_scan
from hf_blockdiag_cp.mixers import MixerContext
from hf_blockdiag_cp.mixers.ssd import ssd_mix, time_steps
from hf_blockdiag_cp.model_patches import mamba2
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from helpers.model_zoo import MAMBA2_FAMILIES, build_hybrid_pair, tiny_mamba2_config
from helpers.reference import rel_err

LENGTHS = (37, 1, 26)  # the first document crosses two 16-row chunks of the scan


def _recurrence(x, dt, A, B, C, D, runs: MixerRuns, start=None):
    """float64 S_t = exp(dt_t·A)·S_{t-1} + dt_t·x_t ⊗ B_t, y_t = S_t·C_t + D·x_t, restarted per run."""
    x, dt, A, B, C, D = (t.double() for t in (x, dt, A, B, C, D))
    heads, groups = x.shape[1], B.shape[1]
    B, C = B.repeat_interleave(heads // groups, 1), C.repeat_interleave(heads // groups, 1)
    out, finals = torch.zeros_like(x), []
    bounds = runs.boundaries.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = torch.zeros(heads, x.shape[2], B.shape[2], dtype=torch.float64) if start is None else start[i].double()
        for t in range(a, b):
            state = torch.exp(dt[t] * A)[:, None, None] * state + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
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


def _stock_mixer(family: str = "nemotron_h"):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mamba2_config(family), attn_implementation="eager")
    return [m for m in model.modules() if mamba2.is_ssd_mixer(m)][0]


def _layers(family):
    ref, model = build_hybrid_pair(family)
    stock = [m for m in ref.modules() if mamba2.is_ssd_mixer(m)][0]
    patched = [m for m in model.modules() if mamba2.is_ssd_mixer(m)][0]
    return stock, patched


def _inputs(hidden_size):
    g = torch.Generator().manual_seed(3)
    return torch.randn(1, sum(LENGTHS), hidden_size, generator=g), torch.randn(1, sum(LENGTHS), hidden_size, generator=g)


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_packed_layer_equals_each_document_alone(family):
    stock, patched = _layers(family)
    x, probe = _inputs(stock.hidden_size)
    stock.zero_grad(set_to_none=True)
    outs, start = [], 0
    for n in LENGTHS:
        outs.append(stock(x[:, start : start + n]))
        start += n
    ref_out = torch.cat(outs, dim=1)
    (ref_out * probe).sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in stock.named_parameters()}
    cu = torch.tensor([0, LENGTHS[0], LENGTHS[0] + LENGTHS[1], sum(LENGTHS)], dtype=torch.int32)
    out = patched(x, cu_seq_lens_q=cu)
    (out * probe).sum().backward()
    assert rel_err(out.detach(), ref_out.detach()) <= 1e-5
    for name, p in patched.named_parameters():
        assert rel_err(p.grad, ref_grads[name]) <= 1e-5, name
    with torch.no_grad():
        assert rel_err(stock(x), ref_out) > 1e-3  # stock on the pack: documents leak into each other


def _scan_out(layer, x, conv_runs: MixerRuns, scan_runs: MixerRuns):
    """The layer's scan output with its convolution restarted at `conv_runs` and its scan at `scan_runs`
    (the torch kernels called directly)."""
    _, xbc, dt = mamba2._project(layer, x[0])
    spec = mamba2.mixer_layer(layer)
    xbc = torch_short_conv(xbc, spec.conv_weight, spec.conv_bias, spec.activation, RunTable.build(conv_runs, "cpu"))
    rows, width = xbc.shape[0], spec.groups * spec.state_size
    xs, B, C = xbc.split([spec.heads * spec.head_dim, width, width], dim=-1)
    xs, B, C = xs.reshape(rows, spec.heads, -1), B.reshape(rows, spec.groups, -1), C.reshape(rows, spec.groups, -1)
    return torch_ssd_scan(xs, time_steps(spec, dt), -spec.A_log.float().exp(), B, C, spec.D, RunTable.build(scan_runs, "cpu"),
                          torch_scan=spec.torch_scan, chunk_size=spec.chunk_size)[0]


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_reference_catches_a_crossing_convolution_or_state(family):
    """Letting only the convolution, or only the scan state, cross the boundary changes the second
    document: each mechanism on its own is seen by the per-document reference."""
    _, layer = _layers(family)
    x, _ = _inputs(layer.hidden_size)
    length, first = sum(LENGTHS), LENGTHS[0]
    split = MixerRuns.documents(torch.tensor([0, first, length]), length)
    whole = MixerRuns.documents(torch.tensor([0, length]), length)
    with torch.no_grad():
        exact = _scan_out(layer, x, split, split)
        conv_crosses = _scan_out(layer, x, whole, split)
        state_crosses = _scan_out(layer, x, split, whole)
        _, xbc, dt = mamba2._project(layer, x[0])
        mixer = ssd_mix(mamba2.mixer_layer(layer), xbc, dt, MixerContext.from_runs(split))
    assert rel_err(mixer, exact) <= 1e-6  # the mixer the patch runs is this composition
    second = slice(first, length)
    assert rel_err(conv_crosses[second], exact[second]) > 1e-3
    assert rel_err(state_crosses[second], exact[second]) > 1e-3
    assert torch.equal(conv_crosses[:first], exact[:first])


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_outside_a_step_the_model_is_stock(family):
    ref, model = build_hybrid_pair(family)
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    ref.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        expected = ref.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


def _step_batch():
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}


@pytest.mark.parametrize("family", ["nemotron_h", "mamba2"])
def test_the_step_logs_what_the_token_mixers_ran(family):
    _, model = build_hybrid_pair(family)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, _step_batch(), config=bdcp.CPConfig(mixer_backend="torch"))
    with train_ctx() as step:
        model(**local).loss.backward()
    assert step.choices.mixers == "short_conv=torch ssd_scan=torch transport=local"


def test_hybrid_without_the_patch_cannot_run_a_step():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_mamba2_config("nemotron_h"), attn_implementation=bdcp.ATTN_IMPLEMENTATION)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, _step_batch())
    with pytest.raises(RuntimeError, match=r"mamba2_packed.*apply_model_patches\(model\)"):
        with train_ctx():
            model(**local).loss.backward()
    assert bdcp.apply_model_patches(copy.deepcopy(model)) == ("mamba2_packed",)


def test_mamba_ssm_is_refused_until_verified():
    with pytest.raises(ValueError, match="mamba_ssm.*CUDA"):
        choose_mixer_kernel("ssd_scan", "mamba_ssm", torch.device("cpu"), torch.float32, MixerDims(8, 8))
    assert choose_mixer_kernel("ssd_scan", "auto", torch.device("cpu"), torch.bfloat16, MixerDims(8, 8)).name == "torch"

"""MiniMax's lightning-attention patch and kernel on one process (model_patches/minimax.py,
mixers/lightning.py, kernels/mixers/lightning.py; docs/models.md).

- The torch kernel equals a float64 step-by-step recurrence per run (from zero or given start
  states, at block sizes that do and do not divide the runs) and returns each run's final state;
  padding runs give zero outputs and zero final states.
- A patched layer on a 3-document pack equals the stock layer on each document alone (output and
  parameter gradients); the stock layer on the pack differs, and so does the mixer when its state
  crosses the document boundary.
- `minimax` gets its patch from `apply_model_patches`; outside a CP step without packing
  information the patched model is the stock model (forward and cached generation); the step logs
  its kernel.
"""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.kernels import RunTable
from hf_blockdiag_cp.kernels.mixers.lightning import torch_lightning_attention
from hf_blockdiag_cp.mixers import MixerContext, lightning_mix
from hf_blockdiag_cp.model_patches import apply_model_patches, minimax
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from helpers.model_zoo import build_hybrid_pair, check_stock_outside_a_step, step_mixers
from helpers.reference import fake_fla_gla, rel_err

LENGTHS = (37, 1, 26)  # the first document crosses two 16-row blocks of the tiny config


def _recurrence(q, k, v, slope, runs: MixerRuns, start=None):
    """float64 S_t = exp(-slope)·S_{t-1} + k_tᵀ v_t, o_t = q_t·S_t per head, restarted per run."""
    q, k, v, decay = q.double(), k.double(), v.double(), torch.exp(-slope.double())[:, None, None]
    out, finals, bounds = torch.zeros(v.shape, dtype=torch.float64), [], runs.boundaries.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        state = torch.zeros(q.shape[1], q.shape[2], v.shape[2], dtype=torch.float64) if start is None else start[i].double()
        for t in range(a, b):
            state = decay * state + k[t][:, :, None] * v[t][:, None, :]
            out[t] = torch.einsum("hk,hkv->hv", q[t], state)
        finals.append(state)
    return out, torch.stack(finals)


@pytest.mark.parametrize("block_size", [16, 7, 256])
def test_torch_kernel_equals_the_recurrence_per_run(block_size):
    g = torch.Generator().manual_seed(0)
    rows, heads, key_dim, value_dim = 150, 3, 4, 5
    q, k = (torch.randn(rows, heads, key_dim, generator=g) for _ in range(2))
    v = torch.randn(rows, heads, value_dim, generator=g)
    slope = torch.rand(heads, generator=g) * 0.3
    runs = MixerRuns(torch.tensor([0, 70, 71, 140, 150]), torch.tensor([True, True, True, False]))
    start = torch.randn(4, heads, key_dim, value_dim, generator=g)
    docs = runs.row_is_document
    for initial in (None, start):
        out, final = torch_lightning_attention(q, k, v, slope, RunTable.build(runs, "cpu"), initial, True, block_size)
        ref_out, ref_final = _recurrence(q, k, v, slope, runs, initial)
        assert rel_err(out[docs], ref_out[docs]) <= 1e-5
        assert rel_err(final[:3], ref_final[:3]) <= 1e-5
        assert torch.equal(out[~docs], torch.zeros_like(out[~docs]))  # a padding run's output is zero
        assert torch.equal(final[3], torch.zeros_like(final[3]))  # and so is its final state


def test_fla_record_feeds_simple_gla_the_lightning_recurrence(monkeypatch):
    """g_gamma = -slope, scale 1, start states per run: equal to the float64 recurrence with fla's kernel
    replaced by its documented definition (the GPU check, tests/gpu/test_mixer_kernels_gpu.py, checks
    fla's kernel itself); on the CPU `auto` keeps the torch kernel and naming fla is refused."""
    from hf_blockdiag_cp.kernels import choose_mixer_kernel
    from hf_blockdiag_cp.kernels.mixers.lightning import fla_lightning_attention
    from hf_blockdiag_cp.kernels.mixers.registry import MixerDims

    fake_fla_gla(monkeypatch)
    g = torch.Generator().manual_seed(1)
    rows, heads, key_dim, value_dim = 75, 3, 4, 5
    q, k = (torch.randn(rows, heads, key_dim, generator=g) for _ in range(2))
    v, slope = torch.randn(rows, heads, value_dim, generator=g), torch.rand(heads, generator=g) * 0.3
    runs = MixerRuns(torch.tensor([0, 37, 38, 70, 75]), torch.tensor([True, True, True, False]))
    start, docs = torch.randn(4, heads, key_dim, value_dim, generator=g), runs.row_is_document
    for initial in (None, start):
        out, final = fla_lightning_attention(q, k, v, slope, RunTable.build(runs, "cpu"), initial, True)
        ref_out, ref_final = _recurrence(q, k, v, slope, runs, initial)
        assert rel_err(out[docs], ref_out[docs]) <= 1e-5 and rel_err(final[:3], ref_final[:3]) <= 1e-5
        assert torch.equal(out[~docs], torch.zeros_like(out[~docs])) and torch.equal(final[3], torch.zeros_like(final[3]))
    dims = MixerDims(key_dim, value_dim)
    assert choose_mixer_kernel("lightning_attention", "auto", torch.device("cpu"), torch.float32, dims).name == "torch"
    with pytest.raises(ValueError, match="fla.*CUDA"):
        choose_mixer_kernel("lightning_attention", "fla", torch.device("cpu"), torch.bfloat16, dims)


def _layers():
    ref, model = build_hybrid_pair("minimax")
    stock = [m for m in ref.modules() if minimax.is_lightning_attention(m)][0]
    return stock, [m for m in model.modules() if minimax.is_lightning_attention(m)][0]


def _hidden(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, sum(LENGTHS), 32, generator=g) for _ in range(2)]


def test_each_lightning_layer_gets_the_patch():
    _, model = build_hybrid_pair("minimax")
    assert "lightning_attention_packed" in apply_model_patches(model)
    assert sum(minimax.is_lightning_attention(m) and "forward" in vars(m) for m in model.modules()) == 2


def test_packed_layer_equals_each_document_alone():
    stock, patched = _layers()
    x, probe = _hidden()
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    ref_out = torch.cat([stock(x[:, a:b], None, None)[0] for a, b in zip(starts[:-1], starts[1:])], dim=1)
    (ref_out * probe).sum().backward()
    out, _ = patched(x, cu_seq_lens_q=torch.tensor(starts, dtype=torch.int32))
    (out * probe).sum().backward()
    assert rel_err(out.detach(), ref_out.detach()) <= 1e-5
    for (name, p), (_, q) in zip(patched.named_parameters(), stock.named_parameters()):
        assert rel_err(p.grad, q.grad) <= 1e-5, name
    with torch.no_grad():
        assert rel_err(stock(x, None, None)[0], ref_out) > 1e-3  # the stock layer on the pack mixes documents


def test_reference_catches_a_state_that_crosses_a_document():
    """The mixer with its state carried over the boundary changes the second document (and only it)."""
    _, layer = _layers()
    x, _ = _hidden()
    length, first = sum(LENGTHS), LENGTHS[0]
    with torch.no_grad():
        q, k, v = layer.act_fn(layer.qkv_proj(x[0])).reshape(length, 4, 24).split(8, dim=-1)
        spec = minimax.mixer_layer(layer)
        split = lightning_mix(spec, q, k, v, MixerContext.from_runs(MixerRuns.documents(torch.tensor([0, first, length]), length)))
        crosses = lightning_mix(spec, q, k, v, MixerContext.from_runs(MixerRuns.documents(torch.tensor([0, length]), length)))
    assert rel_err(crosses[first:], split[first:]) > 1e-3
    assert torch.equal(crosses[:first], split[:first])


def test_outside_a_step_the_model_is_stock():
    check_stock_outside_a_step("minimax")


def test_the_step_logs_what_the_token_mixers_ran():
    assert step_mixers("minimax") == "lightning_attention=torch transport=local"

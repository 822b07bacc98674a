"""The fla mixer kernels (`kernels.mixers.delta_rule`, `kernels.mixers.kda`, `kernels.mixers.ssd`, `kernels.mixers.lightning`,
`kernels.mixers.short_conv`) on a GPU, where their `FLA_*VERIFIED` sets come from.

Over runs of 1 to 1,500 tokens and a padding run, without states and with an initial state per run
and the final states (what state passing feeds in and takes out), the outputs and the gradients of every input, the
initial state included, against the torch kernel in fp32. The criterion is docs/testing.md's: fla's
bf16 error at most twice the torch kernel's own error fed the same bf16 inputs, plus a small floor.
KDA (a log-decay per key channel) likewise, against Kimi Linear's torch rule, Mamba2's SSD scan as
fla's GLA against NemotronH's torch scan, and MiniMax's lightning attention as fla's simple GLA
against our torch kernel. The convolution likewise, and ours in bf16 against Transformers' stock convolution in bf16. Skipped
without CUDA and without flash-linear-attention (or its usable backend on this GPU).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from hf_blockdiag_cp.kernels import MixerDims, RunTable, choose_mixer_kernel
from hf_blockdiag_cp.kernels.mixers.delta_rule import FLA_VERIFIED, fla_delta_rule, torch_delta_rule
from hf_blockdiag_cp.kernels.mixers.fla import fla_backend_reason
from hf_blockdiag_cp.kernels.mixers.kda import FLA_KDA_VERIFIED, fla_kda
from hf_blockdiag_cp.kernels.mixers.lightning import FLA_LIGHTNING_VERIFIED, fla_lightning_attention, torch_lightning_attention
from hf_blockdiag_cp.kernels.mixers.short_conv import FLA_CONV_VERIFIED, fla_short_conv, torch_short_conv
from hf_blockdiag_cp.kernels.mixers.ssd import FLA_SSD_VERIFIED, fla_ssd_scan, torch_ssd_scan
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

HK, HV, DK, DV = 4, 8, 128, 128
RUNS = [1, 63, 64, 65, 700, 3, 1500, 5]
PADDING = 6
FLOOR = 2e-3  # bf16 has 8 bits of mantissa: relative errors of ~4e-3 are one rounding


@pytest.fixture(scope="module", autouse=True)
def _fla():
    reason = fla_backend_reason(torch.cuda.current_device())
    if reason is not None:
        pytest.skip(reason)


def _rule():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)


def _kda_rule():
    """Kimi Linear's torch rule (unwrapped: with fla installed, Transformers may route the call to fla)."""
    from transformers.models.kimi_linear import modeling_kimi_linear

    return inspect.unwrap(modeling_kimi_linear.chunk_kimi_delta_attention)


def _table() -> RunTable:
    lengths = RUNS + [PADDING]
    bounds = torch.tensor([0] + lengths).cumsum(0)
    return RunTable.build(MixerRuns(bounds, torch.tensor([True] * len(RUNS) + [False])), "cuda")


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _delta_rule_inputs(rows: int, runs: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k = (torch.randn(rows, HK, DK, generator=g, device="cuda") for _ in range(2))
    v = torch.randn(rows, HV, DV, generator=g, device="cuda")
    decay = F.logsigmoid(torch.randn(rows, HV, generator=g, device="cuda") + 2)  # mostly slow decays, some fast
    beta = torch.randn(rows, HV, generator=g, device="cuda").sigmoid()
    state = torch.randn(runs, HV, DK, DV, generator=g, device="cuda") * 0.1
    return q, k, v, decay, beta, state


def _kda_inputs(rows: int, runs: int):
    """Kimi Linear's shapes: as many key as value heads, a log-decay per key channel."""
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k = (torch.randn(rows, HV, DK, generator=g, device="cuda") for _ in range(2))
    v = torch.randn(rows, HV, DV, generator=g, device="cuda")
    decay = F.logsigmoid(torch.randn(rows, HV, DK, generator=g, device="cuda") + 3)  # mostly slow, some fast channels
    beta = torch.randn(rows, HV, generator=g, device="cuda").sigmoid()
    state = torch.randn(runs, HV, DK, DV, generator=g, device="cuda") * 0.1
    return q, k, v, decay, beta, state


def _delta_rule_run(fn, inputs, dtype, table, probes, states: bool, rule):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    q, k, v, decay, beta, state = leaves
    out, final = fn(q.to(dtype), k.to(dtype), v.to(dtype), decay, beta.to(dtype), table, state if states else None, states, rule)
    loss = (out.float() * probes[0]).sum() + ((final.float() * probes[1]).sum() if states else 0)
    loss.backward()
    return [out, final] + [t.grad for t in leaves]


def _check_against_torch(name, fla_fn, torch_fn, rule, inputs, table, states: bool) -> None:
    """fla in bf16 within twice the torch kernel's own bf16 error (+ FLOOR) of the torch kernel in fp32,
    for the outputs, the final states and the gradient of every input; padding rows zero."""
    runs = table.runs.lengths.numel()
    g = torch.Generator(device="cuda").manual_seed(1)
    probes = (torch.randn(table.num_rows, HV, DV, generator=g, device="cuda"),
              torch.randn(runs, HV, DK, DV, generator=g, device="cuda"))
    reference = _delta_rule_run(torch_fn, inputs, torch.float32, table, probes, states, rule)
    torch_bf16 = _delta_rule_run(torch_fn, inputs, torch.bfloat16, table, probes, states, rule)
    fla_bf16 = _delta_rule_run(fla_fn, inputs, torch.bfloat16, table, probes, states, rule)
    _compare(f"{name} states={states}", ["out", "final", "dq", "dk", "dv", "dg", "dbeta", "dstate"],
             reference, torch_bf16, fla_bf16, table, per_run=("final", "dstate"))


def _compare(label, parts, reference, torch_bf16, fla_bf16, table, per_run=(), per_row=()) -> None:
    """Each part of fla's bf16 run within 2x the torch kernel's bf16 error (+ FLOOR) of the fp32 reference,
    `per_run` parts over document runs only (padding runs' states are not used), `per_row` parts over
    document rows only; padding rows of fla's output zero."""
    documents, doc_rows = table.runs.is_document.cuda(), table.runs.row_is_document.cuda()
    failures = []
    for part, ref, base, fla in zip(parts, reference, torch_bf16, fla_bf16):
        if ref is None:  # no states: no final state, no state gradient
            continue
        if part in per_run or part in per_row:
            keep = documents if part in per_run else doc_rows
            ref, base, fla = ref[keep], base[keep], fla[keep]
        fla_err, base_err = _rel(fla, ref), _rel(base, ref)
        print(f"{label} {part}: fla bf16 {fla_err:.2e}, torch bf16 {base_err:.2e}")
        if fla_err > 2 * base_err + FLOOR:
            failures.append(f"{part}: fla {fla_err:.2e} against torch {base_err:.2e}")
    assert failures == []
    assert torch.equal(fla_bf16[0][-PADDING:].float(), torch.zeros_like(fla_bf16[0][-PADDING:].float()))


@pytest.mark.parametrize("states", [False, True], ids=["no-states", "states"])
def test_fla_delta_rule_matches_fp32(states):
    """Without states (one rank, head-parallel) and with them (state passing), each checked on
    its own: `FLA_VERIFIED` holds the two apart."""
    table = _table()
    inputs = _delta_rule_inputs(table.num_rows, table.runs.lengths.numel())
    _check_against_torch("delta rule", fla_delta_rule, torch_delta_rule, _rule(), inputs, table, states)


@pytest.mark.parametrize("states", [False, True], ids=["no-states", "states"])
def test_fla_kda_matches_fp32(states):
    """fla's chunk_kda against Kimi Linear's torch rule, without and with states (`FLA_KDA_VERIFIED`)."""
    table = _table()
    inputs = _kda_inputs(table.num_rows, table.runs.lengths.numel())
    _check_against_torch("kda", fla_kda, torch_delta_rule, _kda_rule(), inputs, table, states)


SSD_HEADS, SSD_P, SSD_G, SSD_N = 8, 64, 2, 128  # NemotronH's head dim and state size


def _ssd_run(fn, inputs, dtype, table, probes):
    from transformers.models.nemotron_h import modeling_nemotron_h

    scan = inspect.unwrap(modeling_nemotron_h.mamba2_chunk_scan)
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    x, dt, A, B, C, D = leaves
    out, final = fn(x.to(dtype), dt, A, B.to(dtype), C.to(dtype), D.to(dtype), table, None, True, scan, 256)
    ((out.float() * probes[0]).sum() + (final.float() * probes[1]).sum()).backward()
    return [out, final] + [t.grad for t in leaves]


def test_fla_gla_as_the_ssd_scan_matches_fp32():
    """Mamba2's scan through fla's chunk_gla (`kernels.mixers.ssd.fla_ssd_scan`) against the family's torch
    scan in fp32: output, final states and the gradient of every input (`FLA_SSD_VERIFIED`)."""
    table = _table()
    rows, runs = table.num_rows, table.runs.lengths.numel()
    g = torch.Generator(device="cuda").manual_seed(4)
    inputs = (torch.randn(rows, SSD_HEADS, SSD_P, generator=g, device="cuda"),
              F.softplus(torch.randn(rows, SSD_HEADS, generator=g, device="cuda") - 2),  # dt as the layer gives it
              -torch.rand(SSD_HEADS, generator=g, device="cuda") * 4 - 0.5,  # A = -exp(A_log)
              torch.randn(rows, SSD_G, SSD_N, generator=g, device="cuda") * SSD_N ** -0.5,
              torch.randn(rows, SSD_G, SSD_N, generator=g, device="cuda") * SSD_N ** -0.5,
              torch.randn(SSD_HEADS, generator=g, device="cuda"))
    probes = (torch.randn(rows, SSD_HEADS, SSD_P, generator=g, device="cuda"),
              torch.randn(runs, SSD_HEADS, SSD_P, SSD_N, generator=g, device="cuda"))
    reference = _ssd_run(torch_ssd_scan, inputs, torch.float32, table, probes)
    torch_bf16 = _ssd_run(torch_ssd_scan, inputs, torch.bfloat16, table, probes)
    fla_bf16 = _ssd_run(fla_ssd_scan, inputs, torch.bfloat16, table, probes)
    _compare("ssd", ["out", "final", "dx", "ddt", "dA", "dB", "dC", "dD"], reference, torch_bf16, fla_bf16, table,
             per_run=("final",), per_row=("out", "dx", "ddt", "dB", "dC"))


def _lightning_run(fn, inputs, dtype, table, probes, states: bool):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs[:3]] + [inputs[3], inputs[4].clone().requires_grad_(True)]
    q, k, v, slope, state = leaves
    out, final = fn(q.to(dtype), k.to(dtype), v.to(dtype), slope, table, state if states else None, states, 256)
    ((out.float() * probes[0]).sum() + ((final.float() * probes[1]).sum() if states else 0)).backward()
    return [out, final, q.grad, k.grad, v.grad, state.grad]


@pytest.mark.parametrize("states", [False, True], ids=["no-states", "states"])
def test_fla_simple_gla_as_lightning_attention_matches_fp32(states):
    """MiniMax's lightning attention (a constant decay per head) through fla's chunk_simple_gla against the
    torch kernel in fp32, without and with states (`FLA_LIGHTNING_VERIFIED`)."""
    table = _table()
    rows, runs = table.num_rows, table.runs.lengths.numel()
    g = torch.Generator(device="cuda").manual_seed(5)
    scale = DK ** -0.5  # MiniMax's q, k come out of an activation of a projection: unit-order entries
    inputs = (torch.randn(rows, HV, DK, generator=g, device="cuda") * scale, torch.randn(rows, HV, DK, generator=g, device="cuda"),
              torch.randn(rows, HV, DV, generator=g, device="cuda"),
              torch.rand(HV, generator=g, device="cuda") * 0.1,  # slopes: decays 0.90 to 1 per row
              torch.randn(runs, HV, DK, DV, generator=g, device="cuda") * 0.1)
    probes = (torch.randn(rows, HV, DV, generator=g, device="cuda"), torch.randn(runs, HV, DK, DV, generator=g, device="cuda"))
    results = [_lightning_run(fn, inputs, dtype, table, probes, states) for fn, dtype in
               ((torch_lightning_attention, torch.float32), (torch_lightning_attention, torch.bfloat16),
                (fla_lightning_attention, torch.bfloat16))]
    _compare(f"lightning states={states}", ["out", "final", "dq", "dk", "dv", "dstate"], *results, table,
             per_run=("final", "dstate"))


def _conv_run(fn, x, weight, bias, dtype, table, probe):
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
    out = fn(leaves[0].to(dtype), leaves[1].to(dtype), leaves[2].to(dtype), "silu", table)
    (out.float() * probe).sum().backward()
    return [out] + [t.grad for t in leaves]


def test_fla_short_conv_matches_fp32_and_ours_matches_the_stock_convolution():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    table = _table()
    g = torch.Generator(device="cuda").manual_seed(2)
    channels = 2 * HK * DK + HV * DV
    x = torch.randn(table.num_rows, channels, generator=g, device="cuda")
    weight, bias = torch.randn(channels, 4, generator=g, device="cuda") * 0.5, torch.randn(channels, generator=g, device="cuda")
    probe = torch.randn(table.num_rows, channels, generator=g, device="cuda")
    reference = _conv_run(torch_short_conv, x, weight, bias, torch.float32, table, probe)
    torch_bf16 = _conv_run(torch_short_conv, x, weight, bias, torch.bfloat16, table, probe)
    fla_bf16 = _conv_run(fla_short_conv, x, weight, bias, torch.bfloat16, table, probe)
    documents = table.runs.row_is_document.cuda()
    for name, ref, base, fla in zip(["out", "dx", "dweight", "dbias"], reference, torch_bf16, fla_bf16):
        if name in ("out", "dx"):
            ref, base, fla = ref[documents], base[documents], fla[documents]
        fla_err, base_err = _rel(fla, ref), _rel(base, ref)
        print(f"conv {name}: fla bf16 {fla_err:.2e}, torch bf16 {base_err:.2e}")
        assert fla_err <= 2 * base_err + FLOOR, f"{name}: fla {fla_err:.2e} against torch {base_err:.2e}"
    # Ours in bf16 against Transformers' own convolution in bf16 on each run alone: the same rounding.
    stock_fn = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)
    bounds = table.runs.boundaries.tolist()
    xb, wb, bb = x.bfloat16(), weight.bfloat16(), bias.bfloat16()
    stock = torch.cat([stock_fn(xb[a:z].T[None], wb, bb, activation="silu")[0].T for a, z in zip(bounds[:-1], bounds[1:])])
    ours_err, stock_err = _rel(torch_bf16[0][documents], reference[0][documents]), _rel(stock[documents], reference[0][documents])
    print(f"conv out: ours bf16 {ours_err:.2e}, stock bf16 {stock_err:.2e}")
    assert ours_err <= 1.5 * stock_err + 1e-4


def test_auto_takes_fla_exactly_where_it_was_verified():
    major = torch.cuda.get_device_capability()[0]
    for dims in (MixerDims(DK, DV), MixerDims(DK, DV, states=True), MixerDims(48, 48)):
        verified = (major, torch.bfloat16, (dims.key_dim, dims.value_dim), dims.states) in FLA_VERIFIED
        chosen = choose_mixer_kernel("gated_delta_rule", "auto", torch.device("cuda"), torch.bfloat16, dims).name
        assert chosen == ("fla" if verified else "torch"), dims
    chosen = choose_mixer_kernel("short_conv", "auto", torch.device("cuda"), torch.bfloat16, MixerDims()).name
    assert chosen == ("fla" if (major, torch.bfloat16) in FLA_CONV_VERIFIED else "torch")
    for dims in (MixerDims(DK, DV), MixerDims(DK, DV, states=True)):
        verified = (major, torch.bfloat16, (dims.key_dim, dims.value_dim), dims.states) in FLA_LIGHTNING_VERIFIED
        chosen = choose_mixer_kernel("lightning_attention", "auto", torch.device("cuda"), torch.bfloat16, dims).name
        assert chosen == ("fla" if verified else "torch"), dims
    dims = MixerDims(SSD_N, SSD_P)
    chosen = choose_mixer_kernel("ssd_scan", "auto", torch.device("cuda"), torch.bfloat16, dims).name
    assert chosen == ("fla" if (major, torch.bfloat16, (SSD_N, SSD_P)) in FLA_SSD_VERIFIED else "torch")
    for dims in (MixerDims(DK, DV), MixerDims(DK, DV, states=True)):
        verified = (major, torch.bfloat16, (dims.key_dim, dims.value_dim), dims.states) in FLA_KDA_VERIFIED
        chosen = choose_mixer_kernel("kda", "auto", torch.device("cuda"), torch.bfloat16, dims).name
        assert chosen == ("fla" if verified else "torch"), dims

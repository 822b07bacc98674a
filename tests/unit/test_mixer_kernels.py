"""Mixer kernels on one process (kernels/mixers/: delta_rule.py, short_conv.py, buckets.py, registry.py).

The torch kernels against Transformers' own functions run on each run alone (float64 inputs; the
delta rule computes in float32 whatever its inputs, hence its tolerances): the batched
delta rule with initial and final states, the linearity in the initial state that state passing
relies on, and the convolution; the bucket plan's size bounds (linear in the runs); and the choice:
fla refused where it was not verified, with the reason.
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen3_5

from hf_blockdiag_cp.kernels import MixerDims, RunTable, choose_mixer_kernel
from hf_blockdiag_cp.kernels.mixers.buckets import CHUNK, plan_buckets
from hf_blockdiag_cp.kernels.mixers.delta_rule import torch_delta_rule
from hf_blockdiag_cp.kernels.mixers.short_conv import torch_short_conv
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns

RULE = inspect.unwrap(qwen3_5.torch_chunk_gated_delta_rule)
HK, HV, DK, DV = 2, 4, 8, 6


def _table(lengths, documents=None) -> RunTable:
    bounds = torch.tensor([0] + lengths).cumsum(0)
    is_doc = torch.tensor(documents if documents is not None else [True] * len(lengths))
    return RunTable.build(MixerRuns(bounds, is_doc), "cpu")


def _inputs(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(rows, HK, DK, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(rows, HV, DV, generator=g, dtype=torch.float64)
    decay = -torch.rand(rows, HV, generator=g, dtype=torch.float64)
    beta = torch.rand(rows, HV, generator=g, dtype=torch.float64)
    return q, k, v, decay, beta


def _per_run(table, q, k, v, decay, beta, initial):
    """Transformers' rule on each document run alone (batch of one); padding runs give zeros. Each key
    head serves HV // HK consecutive value heads, repeated here as the stock layer does before 5.25's
    rule does it itself."""
    q, k = q.repeat_interleave(HV // HK, dim=1), k.repeat_interleave(HV // HK, dim=1)
    outs, finals = [], []
    bounds = table.runs.boundaries.tolist()
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        if not table.runs.is_document[i]:
            outs.append(torch.zeros(b - a, HV, DV, dtype=v.dtype))
            finals.append(torch.zeros(HV, DK, DV))
            continue
        state = None if initial is None else initial[i : i + 1]
        o, f = RULE(q[None, a:b], k[None, a:b], v[None, a:b], g=decay[None, a:b], beta=beta[None, a:b],
                    initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o[0])
        finals.append(f[0])
    return torch.cat(outs), torch.stack(finals)


RUNS = st.lists(st.tuples(st.integers(1, 150), st.booleans()), min_size=1, max_size=8)


@settings(max_examples=25, deadline=None)
@given(runs=RUNS, seed=st.integers(0, 1000), with_state=st.booleans())
def test_torch_delta_rule_equals_each_run_alone(runs, seed, with_state):
    lengths = [n for n, _ in runs]
    table = _table(lengths, [d for _, d in runs])
    q, k, v, decay, beta = _inputs(sum(lengths), seed)
    initial = torch.randn(len(lengths), HV, DK, DV, dtype=torch.float64) if with_state else None
    out, final = torch_delta_rule(q, k, v, decay, beta, table, initial, True, RULE)
    ref_out, ref_final = _per_run(table, q, k, v, decay, beta, initial)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    is_doc = table.runs.is_document
    torch.testing.assert_close(final[is_doc].double(), ref_final[is_doc].double(), rtol=1e-5, atol=1e-5)


def test_outputs_and_final_state_are_affine_in_the_initial_state():
    """What state passing composes: with values zero and the identity as initial state, the final state is
    the transition P and the output the coefficients C, so that for any S: final(S) = P·S + final(0) and
    out(S) = out(0) + C·S (float64, runs over several 64-token chunks)."""
    lengths = [150, 70]
    table = _table(lengths)
    q, k, v, decay, beta = _inputs(sum(lengths), 7)
    state = torch.randn(2, HV, DK, DV, dtype=torch.float64)
    out_s, final_s = torch_delta_rule(q, k, v, decay, beta, table, state, True, RULE)
    out_0, final_0 = torch_delta_rule(q, k, v, decay, beta, table, None, True, RULE)
    eye = torch.eye(DK, dtype=torch.float64).expand(2, HV, DK, DK)
    coeff, transition = torch_delta_rule(q, k, v.new_zeros(sum(lengths), HV, DK), decay, beta, table, eye, True, RULE)
    torch.testing.assert_close(final_s.double(), transition.double() @ state + final_0.double(), rtol=1e-4, atol=1e-4)
    row_state = torch.repeat_interleave(state, torch.tensor(lengths), dim=0)
    predicted = out_0 + torch.einsum("thk,thkv->thv", coeff, row_state)
    torch.testing.assert_close(out_s, predicted, rtol=1e-4, atol=1e-4)
    assert (out_s - out_0).abs().max() > 0.1  # the initial state matters


@settings(max_examples=25, deadline=None)
@given(runs=RUNS, seed=st.integers(0, 1000), kernel=st.integers(1, 5), bias=st.booleans())
def test_torch_short_conv_equals_the_stock_convolution_on_each_run(runs, seed, kernel, bias):
    lengths = [n for n, _ in runs]
    table = _table(lengths, [d for _, d in runs])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(lengths), 5, generator=g, dtype=torch.float64)
    weight = torch.randn(5, kernel, generator=g, dtype=torch.float64)
    b = torch.randn(5, generator=g, dtype=torch.float64) if bias else None
    out = torch_short_conv(x, weight, b, "silu", table)
    bounds = table.runs.boundaries.tolist()
    ref = torch.cat([qwen3_5.causal_conv1d_fn(x[a:z].T[None], weight, b, activation="silu")[0].T
                     for a, z in zip(bounds[:-1], bounds[1:])])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 5000), min_size=1, max_size=600))
def test_buckets_grow_linearly_with_the_runs(lengths):
    """The batched torch rule runs one call per bucket, at most log2 of the longest run in chunks plus one,
    whatever the number of runs; its padded rows are at most twice the rows plus one chunk per run."""
    plan = plan_buckets(_table(lengths))
    longest = -(-max(lengths) // CHUNK)
    assert len(plan.widths) <= longest.bit_length() + 1
    assert sum(w * n for w, n in zip(plan.widths, plan.counts)) <= 2 * sum(lengths) + CHUNK * len(lengths)
    assert sorted(int(i) for ids in plan.run_ids for i in ids) == list(range(len(lengths)))


def test_fla_is_refused_where_not_verified_and_auto_takes_torch():
    dims = MixerDims(128, 128)
    for op in ("gated_delta_rule", "short_conv"):
        assert choose_mixer_kernel(op, "auto", torch.device("cpu"), torch.float32, dims).name == "torch"
        with pytest.raises(ValueError, match=r"mixer_backend='fla' cannot run .*(CUDA|not installed)"):
            choose_mixer_kernel(op, "fla", torch.device("cpu"), torch.bfloat16, dims)
    with pytest.raises(ValueError, match="has no gated_delta_rule kernel"):
        choose_mixer_kernel("gated_delta_rule", "causal_conv1d", torch.device("cpu"), torch.float32, dims)


def test_fla_records_name_what_was_verified(monkeypatch):
    """On a GPU fla can run on (simulated: compute capability 9), each fla record runs exactly the calls in
    its verified set and otherwise says which it has, with states and head dims kept apart."""
    from hf_blockdiag_cp.kernels.mixers import delta_rule, fla, kda, lightning, short_conv, ssd

    monkeypatch.setattr(fla, "fla_device", lambda device: (None, 9))
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert delta_rule.fla_check(cuda, bf16, MixerDims(128, 128, states=True)) is None  # verified on the H200
    reason = delta_rule.fla_check(cuda, bf16, MixerDims(64, 64, states=True))
    assert "head dims 64x64 with initial and final states" in reason and "head dims 128x128 with initial" in reason
    assert short_conv.fla_conv_check(cuda, bf16, MixerDims()) is None
    assert "compute capability 9.x, float32 (verified: compute capability 9.x, bfloat16)" in short_conv.fla_conv_check(
        cuda, torch.float32, MixerDims())
    for states in (False, True):
        assert kda.fla_kda_check(cuda, bf16, MixerDims(128, 128, states=states)) is None
    assert "head dims 64x64" in kda.fla_kda_check(cuda, bf16, MixerDims(64, 64))
    assert ssd.fla_ssd_check(cuda, bf16, MixerDims(128, 64)) is None  # NemotronH's state and head dim
    assert ssd.fla_ssd_check(cuda, bf16, MixerDims(64, 64)).endswith(
        "head dims 64x64 (verified: compute capability 9.x, bfloat16, head dims 128x64)")
    for states in (False, True):
        assert lightning.fla_lightning_check(cuda, bf16, MixerDims(128, 128, states=states)) is None
    assert "head dims 64x64 with initial and final states" in lightning.fla_lightning_check(
        cuda, bf16, MixerDims(64, 64, states=True))


def test_padding_runs_give_zero_outputs():
    table = _table([5, 3, 4], [True, False, True])
    q, k, v, decay, beta = _inputs(12, 1)
    out, _ = torch_delta_rule(q, k, v, decay, beta, table, None, False, RULE)
    assert torch.equal(out[5:8], torch.zeros_like(out[5:8])) and out[:5].abs().sum() > 0
    x = torch.randn(12, 3, dtype=torch.float64)
    assert F.silu(torch.zeros(1)).item() == 0.0 and torch_short_conv(x, torch.ones(3, 2, dtype=torch.float64), None, None, table)[5].abs().sum() > 0


def test_a_varlen_kernel_run_over_padding_keeps_the_contract_through_only_documents():
    """fla runs a padding run like a document; `RunTable.only_documents` must bring its outputs and
    final states to the torch kernel's (zero on padding runs), or a loss on final states sends
    gradients into padding rows (the key-gradient error docs/models.md records)."""
    lengths, documents = [5, 3, 4], [True, False, True]
    q, k, v, decay, beta = _inputs(12, 2)
    state = torch.randn(3, HV, DK, DV, dtype=torch.float64)
    as_documents = torch_delta_rule(q, k, v, decay, beta, _table(lengths), state, True, RULE)
    assert as_documents[1][1].abs().sum() > 0  # the padding run's state, as a varlen kernel leaves it
    padded = _table(lengths, documents)
    out, final = padded.only_documents(*as_documents)
    expected_out, expected_final = torch_delta_rule(q, k, v, decay, beta, padded, state, True, RULE)
    torch.testing.assert_close(out, expected_out)
    torch.testing.assert_close(final, expected_final.to(final.dtype))
    assert torch.equal(final[1], torch.zeros_like(final[1]))


def test_auto_on_the_cpu_takes_torch_without_a_warning(caplog):
    """On the CPU torch is every mixer's only kernel: nothing to warn about (on a GPU, see
    gpu/test_mixer_fallback_gpu.py)."""
    import logging

    from hf_blockdiag_cp.mixers.context import MixerContext

    context = MixerContext.from_runs(MixerRuns(torch.tensor([0, 5, 12]), torch.tensor([True, True])))
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        names = [context.kernel(op, torch.zeros(12, 4), MixerDims(24, 40)).name
                 for op in ("gated_delta_rule", "ssd_scan", "short_conv")]
    assert names == ["torch"] * 3
    assert not [r for r in caplog.records if "torch" in r.getMessage()]


def test_first_fla_choice_says_autotune_takes_time(monkeypatch, caplog):
    """fla autotunes for minutes at a new shape with nothing printed: the first choice of an fla kernel
    says so once, at INFO (a simulated GPU where fla is verified)."""
    from hf_blockdiag_cp.comm.notice import forget
    from hf_blockdiag_cp.kernels.mixers import fla
    from hf_blockdiag_cp.mixers import MixerContext
    from hf_blockdiag_cp.planning.mixer_plan import MixerRuns

    monkeypatch.setattr(fla, "fla_device", lambda device: (None, 9))
    forget(("fla autotune",))
    context = MixerContext.from_runs(MixerRuns.documents(torch.tensor([0, 8]), 8))
    x = torch.empty(8, 4, device="meta", dtype=torch.bfloat16)
    with caplog.at_level("INFO", logger="hf_blockdiag_cp"):
        assert context.kernel("gated_delta_rule", x, MixerDims(128, 128)).name == "fla"
        assert context.kernel("short_conv", x, MixerDims()).name == "fla"
    notes = [r for r in caplog.records if "autotune" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO" and "minutes" in notes[0].getMessage()
    forget(("fla autotune",))

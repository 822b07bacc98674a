"""benchmarks/scaling_model.py (docs/scaling.md) on synthetic inputs: with free communication and free
linear layers the predicted per-GPU efficiency is the planner's load-balance bound, the all-reduce
term is the ring closed form, and the validation flags a prediction more than 10 % off."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scaling_model as sm  # noqa: E402

from hf_blockdiag_cp.planning import layout_cost, plan_layout  # noqa: E402

CFG = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
LENGTHS = (3000, 17, 900, 4000, 64, 5, 2200, 1000, 6000, 1200, 46)  # 18,432 = 64 * 288 tokens: no padding up to G = 32


def synthetic(bw=math.inf, latency=0.0, r_lin=math.inf, overlap=0.0, layout="balanced"):
    net = sm.Network({("allgather", "fwd"): bw, ("allgather", "bwd"): bw}, inter_gbps=bw,
                     latency_ms={"intra": latency, "inter": latency})
    rates = sm.KernelRates({"k": [(1024, 100.0), (65536, 300.0)]})
    return sm.Setup(rates, net, r_lin, kernel="k", layout=layout, overlap=overlap)


@pytest.mark.parametrize("G", [2, 4, 8, 16])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_free_communication_gives_the_load_balance_bound(G, layout):
    st = synthetic(overlap=1.0, layout=layout)
    S = sum(LENGTHS)
    eff = sm.step_ms(CFG, S, 1, st, LENGTHS)["total"] / (G * sm.step_ms(CFG, S, G, st, LENGTHS)["total"])
    assert eff == pytest.approx(1 / layout_cost(plan_layout(list(LENGTHS), G, layout)).imbalance, rel=1e-9)


def test_exposed_exchange_adds_bytes_over_bandwidth():
    """f = 0: each layer adds 2 forward (checkpoint recompute) + 1 backward all-gather of (G-1)/G of the pack's K/V."""
    G, bw = 4, 10.0
    S = sum(LENGTHS)
    free, slow = sm.step_ms(CFG, S, G, synthetic(), LENGTHS), sm.step_ms(CFG, S, G, synthetic(bw=bw), LENGTHS)
    local = plan_layout(list(LENGTHS), G, "balanced").local_len
    row = CFG["num_key_value_heads"] * 2 * CFG["head_dim"] * 2
    per_call = (G - 1) * local * row / (bw * 1e9) * 1e3
    sizes = sm.model_sizes(CFG)
    ar = 2 * (G - 1) / G * sizes["total"] * 2 / (bw * 1e9) * 1e3
    assert slow["kv"] == pytest.approx(CFG["num_hidden_layers"] * 3 * per_call)
    assert slow["total"] - free["total"] == pytest.approx(slow["kv"] + ar)
    hidden = sm.step_ms(CFG, S, G, synthetic(bw=bw, overlap=1.0), LENGTHS)
    assert hidden["kv_exposed"] == pytest.approx(max(0.0, slow["kv"] - slow["attention"]))


def test_allreduce_closed_form_and_inter_node_rate():
    net = sm.Network({("allgather", "fwd"): 100.0, ("allgather", "bwd"): 40.0}, inter_gbps=25.0,
                     latency_ms={"intra": 0.001, "inter": 0.002})
    assert net.allreduce_ms(1e9, 1) == 0.0
    assert net.allreduce_ms(1e9, 4, n_tensors=3) == pytest.approx(3 * 6 * 0.001 + 1.5 * 1e9 / 100e9 * 1e3)
    assert net.allreduce_ms(1e9, 16) == pytest.approx(30 * 0.002 + 2 * 15 / 16 * 1e9 / 25e9 * 1e3)  # past one node
    assert net.collective_ms(1e9, 8, direction="bwd") == pytest.approx(7 * 0.001 + 1e9 / 40e9 * 1e3)


def test_kernel_rate_interpolates_in_log_length_and_clamps():
    rates = sm.KernelRates({"k": [(1024, 100.0), (4096, 300.0)]})
    assert rates.tflops("k", 2048) == pytest.approx(200.0)
    assert rates.tflops("k", 16) == 100.0 and rates.tflops("k", 1 << 20) == 300.0


def _results(step_g2_factor: float, st: sm.Setup, r_lin: float) -> dict:
    S = sum(LENGTHS)
    t1 = sm.step_ms(CFG, S, 1, sm.Setup(st.rates, st.net, r_lin, kernel="k", layout="contiguous"))["total"] / 1e3
    t2 = sm.step_ms(CFG, S, 2, sm.Setup(st.rates, st.net, r_lin, kernel="k", layout="contiguous"))["total"] / 1e3
    rows = [dict(model="m", G=1, tokens=S, status="ok", step_s=t1, tokens_per_s_per_gpu=S / t1, kernel="k"),
            dict(model="m", G=2, tokens=S, status="ok", step_s=t2 * step_g2_factor, kernel="k", extra_key=1,
                 tokens_per_s_per_gpu=S / 2 / (t2 * step_g2_factor))]
    return {"env": {"G": 2}, "parts": {"e2e": {"rows": rows}}}


@pytest.mark.parametrize("factor, status", [(1.05, "PASS"), (0.95, "PASS"), (1.2, "FAIL"), (0.85, "FAIL")])
def test_validation_flags_errors_over_ten_percent(monkeypatch, factor, status):
    monkeypatch.setattr(sm, "pack_lengths", lambda S, seed=0: LENGTHS)
    st = synthetic(bw=50.0, latency=0.005)
    res = _results(factor, st, r_lin=30.0)
    r_lin = sm.calibrate_linear_rate(res, st.rates, st.net, "k", configs={"m": CFG})
    assert r_lin["m"] == pytest.approx(30.0)  # the G = 1 row gives back the rate it was made with
    rows = sm.validate(res, st.rates, st.net, r_lin, "k", configs={"m": CFG})
    step = next(v for v in rows if v["quantity"] == "step_s")
    assert step["rel_err_pct"] == pytest.approx(100 * (1 / factor - 1))
    assert step["status"] == status
    assert {v["status"] for v in rows} == {status}


@pytest.mark.parametrize("argv, layout", [([], "contiguous"), (["--e2e-layout", "balanced"], "balanced")])
def test_validation_uses_the_runs_e2e_layout(monkeypatch, argv, layout):
    """e2e rows do not record their layout: validation takes multigpu.py's --e2e-layout from the run's argv."""
    skewed = (12000, 1000, 1000, 1000, 1000, 1000, 1000, 432)  # the pack's size, contiguous far from balanced at G = 2
    assert sum(skewed) == sum(LENGTHS)
    monkeypatch.setattr(sm, "pack_lengths", lambda S, seed=0: skewed)
    st = synthetic(bw=50.0, latency=0.005)
    res = _results(1.0, st, r_lin=30.0)
    res["env"]["argv"] = ["benchmarks/multigpu.py", "--parts", "e2e", *argv]
    rows = sm.validate(res, st.rates, st.net, {"m": 30.0}, "k", configs={"m": CFG})
    step = next(v for v in rows if v["quantity"] == "step_s")
    S = sum(LENGTHS)
    steps = {lay: sm.step_ms(CFG, S, 2, sm.Setup(st.rates, st.net, 30.0, kernel="k", layout=lay))["total"] / 1e3
             for lay in ("contiguous", "balanced")}
    assert steps["contiguous"] > 1.02 * steps["balanced"]  # distinguishable at the rel=1e-3 below
    assert step["predicted"] == pytest.approx(steps[layout], rel=1e-3)

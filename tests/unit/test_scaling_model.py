"""The scaling model of `bench scaling` (docs/scaling.md) on synthetic inputs: with free
communication and free linear layers the predicted per-GPU efficiency is the planner's
load-balance bound, the all-reduce term is the ring closed form, the validation flags a prediction
more than 10 % off, and the CLI recovers the rates a run was generated with."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from hf_blockdiag_cp.bench.__main__ import main as bench_main
from hf_blockdiag_cp.bench.scaling_fit import calibrate_linear_rate, validate
from hf_blockdiag_cp.bench.scaling_model import KernelRates, Network, Setup, kv_exchange_ms, model_sizes, pack_cost, step_ms
from hf_blockdiag_cp.bench.setups import E2E_CONFIGS, attention_setups
from hf_blockdiag_cp.planning import key_local_work, kv_row_bytes, layout_cost, overlap_work, plan_layout, rank_work

CFG = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)
LENGTHS = (3000, 17, 900, 4000, 64, 5, 2200, 1000, 6000, 1200, 46)  # 18,432 = 64 * 288 tokens: no padding up to G = 32


def synthetic(bw=math.inf, latency=0.0, r_lin=math.inf, overlap=0.0, layout="balanced", lengths=LENGTHS):
    net = Network({("allgather", "fwd"): bw, ("allgather", "bwd"): bw}, inter_gbps=bw,
                  latency_ms={"intra": latency, "inter": latency})
    rates = KernelRates({("k", CFG["head_dim"]): [(1024, 100.0), (65536, 300.0)]})
    return Setup(rates, net, r_lin, kernel="k", layout=layout, overlap=overlap, packs=lambda S: lengths)


@pytest.mark.parametrize("G", [2, 4, 8, 16])
@pytest.mark.parametrize("layout", ["contiguous", "balanced"])
def test_free_communication_gives_the_load_balance_bound(G, layout):
    st = synthetic(overlap=1.0, layout=layout)
    S = sum(LENGTHS)
    eff = step_ms(CFG, S, 1, st)["total"] / (G * step_ms(CFG, S, G, st)["total"])
    assert eff == pytest.approx(1 / layout_cost(plan_layout(list(LENGTHS), G, layout)).imbalance, rel=1e-9)


def test_exposed_exchange_adds_bytes_over_bandwidth():
    """f = 0: each layer adds 2 forward (checkpoint recompute) + 1 backward all-gather of (G-1)/G of the pack's K/V."""
    G, bw = 4, 10.0
    S = sum(LENGTHS)
    free, slow = step_ms(CFG, S, G, synthetic()), step_ms(CFG, S, G, synthetic(bw=bw))
    local = plan_layout(list(LENGTHS), G, "balanced").local_len
    row = CFG["num_key_value_heads"] * 2 * CFG["head_dim"] * 2
    per_call = (G - 1) * local * row / (bw * 1e9) * 1e3
    sizes = model_sizes(CFG)
    ar = 2 * (G - 1) / G * sizes["total"] * 2 / (bw * 1e9) * 1e3
    assert slow["kv"] == pytest.approx(CFG["num_hidden_layers"] * 3 * per_call)
    assert slow["total"] - free["total"] == pytest.approx(slow["kv"] + ar)
    hidden = step_ms(CFG, S, G, synthetic(bw=bw, overlap=1.0))
    assert hidden["kv_exposed"] == pytest.approx(max(0.0, slow["kv"] - slow["attention"]))


@pytest.mark.parametrize("bw", [10.0, 1000.0])  # the exchange longer, then shorter than the local attention
def test_planned_overlap_hides_the_exchange_under_the_local_attention(bw):
    """overlap_plan "planned": hidden = min(T_kv, T_attn x the busiest rank's local work share), the
    share taken from the planner's overlap split of the same layout (`overlap_work`); "keys": from its
    work over keys it holds (`key_local_work`)."""
    G, S = 4, sum(LENGTHS)
    lay = plan_layout(list(LENGTHS), G, "balanced")
    work = rank_work(lay)
    busiest = int(work.argmax())
    share = int(overlap_work(lay)[busiest]) / int(work[busiest])
    assert 0.0 < share < 1.0  # this pack has documents on both sides of a shard boundary
    plain = step_ms(CFG, S, G, synthetic(bw=bw))
    planned = step_ms(CFG, S, G, replace(synthetic(bw=bw), overlap_plan="planned"))
    hidden = min(plain["kv"], share * plain["attention"])
    assert planned["kv_exposed"] == pytest.approx(plain["kv"] - hidden)
    assert planned["total"] == pytest.approx(plain["total"] - hidden)
    # The split by keys: the same with the busiest rank's share of work over keys it holds.
    key_share = int(key_local_work(lay)[busiest]) / int(work[busiest])
    assert share < key_share < 1.0
    by_keys = step_ms(CFG, S, G, replace(synthetic(bw=bw), overlap_plan="keys"))
    assert by_keys["kv_exposed"] == pytest.approx(plain["kv"] - min(plain["kv"], key_share * plain["attention"]))


def test_allreduce_closed_form_and_inter_node_rate():
    net = Network({("allgather", "fwd"): 100.0, ("allgather", "bwd"): 40.0}, inter_gbps=25.0,
                  latency_ms={"intra": 0.001, "inter": 0.002})
    assert net.allreduce_ms(1e9, 1) == 0.0
    assert net.allreduce_ms(1e9, 4, n_tensors=3) == pytest.approx(3 * 6 * 0.001 + 1.5 * 1e9 / 100e9 * 1e3)
    assert net.allreduce_ms(1e9, 16) == pytest.approx(30 * 0.002 + 2 * 15 / 16 * 1e9 / 25e9 * 1e3)  # past one node
    assert net.collective_ms(1e9, 8, direction="bwd") == pytest.approx(7 * 0.001 + 1e9 / 40e9 * 1e3)


def test_kernel_rate_interpolates_in_log_length_and_clamps():
    rates = KernelRates({("k", 128): [(1024, 100.0), (4096, 300.0)]})
    assert rates.tflops("k", 2048, 128) == pytest.approx(200.0)
    assert rates.tflops("k", 16, 128) == 100.0 and rates.tflops("k", 1 << 20, 128) == 300.0
    with pytest.raises(ValueError, match="no measured rate for kernel 'fa4'"):
        rates.tflops("fa4", 2048, 128)
    with pytest.raises(ValueError, match="a pack length measured twice"):
        KernelRates({("k", 128): [(1024, 100.0), (1024, 110.0)]})


def test_kernel_rates_are_per_head_dim(tmp_path):
    """Each head dim takes its own measured rates, else the nearest measured head dim's (the larger on a
    tie); the JSONs of `bench kernels` give the head dim of their rows, and one without it is refused."""
    for head_dim, top in ((64, 150.0), (128, 300.0)):
        rows = [{"method": "ours/k", "seq_len": 1024, "tflops": top / 3}, {"method": "ours/k", "seq_len": 4096, "tflops": top},
                {"method": "sdpa one causal doc (ceiling)", "seq_len": 1024, "tflops": 999.0}]
        (tmp_path / f"k{head_dim}.json").write_text(json.dumps({"args": {"head_dim": head_dim}, "rows": rows}))
    rates = KernelRates.from_json([tmp_path / "k64.json", tmp_path / "k128.json"])
    assert sorted(rates.points) == [("k", 64), ("k", 128)]
    assert rates.tflops("k", 4096, 64) == 150.0 and rates.tflops("k", 4096, 128) == 300.0
    assert [rates.measured_head_dim("k", d) for d in (16, 64, 80, 96, 128, 256)] == [64, 64, 64, 128, 128, 128]
    faster = replace(synthetic(), rates=rates)
    half = step_ms(dict(CFG, head_dim=64), 8192, 1, faster)["attention"]
    assert step_ms(dict(CFG, head_dim=128), 8192, 1, faster)["attention"] == pytest.approx(half)  # 2x the FLOPs at 2x the rate
    (tmp_path / "bare.json").write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match="no args.head_dim"):
        KernelRates.from_json(tmp_path / "bare.json")


def _e2e_row(model, G, S, step_s, **extra):
    return dict(model=model, G=G, tokens=S, status="ok", step_s=step_s, tokens_per_s_per_gpu=S / G / step_s, **extra)


def _results(step_g2_factor: float, st: Setup) -> dict:
    """A run's e2e rows as the model predicts them, with the G = 2 step scaled by `step_g2_factor`."""
    S = sum(LENGTHS)
    t1 = step_ms(CFG, S, 1, replace(st, layout="contiguous"))["total"] / 1e3
    t2 = step_ms(CFG, S, 2, replace(st, layout="contiguous"))["total"] / 1e3
    rows = [_e2e_row("m", 1, S, t1, kernel="k"), _e2e_row("m", 2, S, t2 * step_g2_factor, kernel="k", extra_key=1)]
    return {"env": {"G": 2}, "parts": {"e2e": {"rows": rows}}}


@pytest.mark.parametrize("factor, status", [(1.05, "PASS"), (0.95, "PASS"), (1.2, "FAIL"), (0.85, "FAIL")])
def test_validation_flags_errors_over_ten_percent(factor, status):
    st = synthetic(bw=50.0, latency=0.005, r_lin=30.0)
    res = _results(factor, st)
    r_lin = calibrate_linear_rate(res, st, configs={"m": CFG})
    assert r_lin["m"] == pytest.approx(30.0)  # the G = 1 row gives back the rate it was made with
    rows = validate(res, st, r_lin, configs={"m": CFG})
    step = next(v for v in rows if v["quantity"] == "step_s")
    assert step["rel_err_pct"] == pytest.approx(100 * (1 / factor - 1))
    assert step["status"] == status
    assert {v["status"] for v in rows} == {status}


@pytest.mark.parametrize("argv, layout", [([], "contiguous"), (["--e2e-layout", "balanced"], "balanced")])
def test_validation_uses_the_runs_e2e_layout(argv, layout):
    """e2e rows do not record their layout: validation takes multigpu.py's --e2e-layout from the run's argv."""
    skewed = (12000, 1000, 1000, 1000, 1000, 1000, 1000, 432)  # the pack's size, contiguous far from balanced at G = 2
    assert sum(skewed) == sum(LENGTHS)
    st = synthetic(bw=50.0, latency=0.005, r_lin=30.0, lengths=skewed)
    res = _results(1.0, st)
    res["env"]["argv"] = ["benchmarks/multigpu.py", "--parts", "e2e", *argv]
    rows = validate(res, st, {"m": 30.0}, configs={"m": CFG})
    step = next(v for v in rows if v["quantity"] == "step_s")
    S = sum(LENGTHS)
    steps = {lay: step_ms(CFG, S, 2, replace(st, layout=lay))["total"] / 1e3 for lay in ("contiguous", "balanced")}
    assert steps["contiguous"] > 1.02 * steps["balanced"]  # distinguishable at the rel=1e-3 below
    assert step["predicted"] == pytest.approx(steps[layout], rel=1e-3)


def _overlap_rows(G: int, net: Network) -> list[dict]:
    """Exchange-alone times of the tiny magi pack, as the network `net` would give them."""
    rows = []
    for s in attention_setups(G, ["magi"], magi_packs=1, tiny=True):
        for layout in ("contiguous", "balanced"):
            cost = pack_cost(tuple(s["lengths"]), G, layout)
            row_b = kv_row_bytes(s["kv_heads"], s["head_dim"], s["head_dim"], 2)
            comm = {d: net.collective_ms(cost.rows[("allgather", d)] * row_b, G, "allgather", d) for d in ("fwd", "bwd")}
            rows.append({"setup": "magi", "pack": s["pack"], "exchange": "allgather", "layout": layout,
                         "heads": f"{s['heads']}/{s['kv_heads']}x{s['head_dim']}",
                         "comm_fwd_ms": comm["fwd"], "comm_bwd_ms": comm["bwd"]})
    return rows


def test_cli_recovers_the_rates_a_run_was_made_with(tmp_path):
    """`bench scaling` on a run generated by the model itself (known collective rates and R_lin, the
    benchmark's own tiny packs, an e2e row with the exchange overlapped): every validation row within
    0.1 %, exit status 0, all outputs written, the planned overlap among the predictions."""
    net = Network({("allgather", "fwd"): 40.0, ("allgather", "bwd"): 20.0})
    rates = {"dense": [(1024, 0.5), (8192, 2.0)]}
    cfg, S = E2E_CONFIGS["tiny"], 8192
    st = Setup(KernelRates({("dense", cfg["head_dim"]): rates["dense"]}), net, 0.25, kernel="dense", layout="balanced")
    e2e = [_e2e_row("tiny", g, n, step_ms(cfg, n, g, st)["total"] / 1e3) for g, n in ((1, S // 2), (1, S), (2, S))]
    overlapped = _e2e_row("tiny", 2, S, step_ms(cfg, S, 2, replace(st, overlap_plan="planned"))["total"] / 1e3)
    e2e.append({**overlapped, "overlap": True})  # a run with CPConfig(overlap=True): validated as built
    run = {"env": {"G": 2, "argv": ["benchmarks/multigpu.py", "--e2e-layout", "balanced"]},
           "args": {"tiny": True, "setups": ["magi"], "magi_packs": 1},
           "parts": {"overlap": {"rows": _overlap_rows(2, net)}, "e2e": {"rows": e2e}}}
    kernels = {"args": {"head_dim": cfg["head_dim"]},
               "rows": [{"method": f"ours/{k}", "seq_len": s, "tflops": t} for k, pts in rates.items() for s, t in pts]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "kernels.json").write_text(json.dumps(kernels))
    out = tmp_path / "out"
    bench_main(["scaling", "--multigpu", str(tmp_path / "run.json"), "--kernels", str(tmp_path / "kernels.json"),
                "--kernel", "dense", "--models", "tiny", "--cp-sizes", "2", "4", "--tokens", "8192", "16384", "--out", str(out)])
    result = json.loads((out / "scaling_model.json").read_text())
    assert result["network_gbps"] == pytest.approx({"allgather/fwd": 40.0, "allgather/bwd": 20.0})
    assert result["r_lin_tflops"] == pytest.approx({"tiny": 0.25})
    assert result["kernel_rates"] == [{"model": "tiny", "kernel": "dense", "head_dim": cfg["head_dim"],
                                       "rates_head_dim": cfg["head_dim"], "substituted": False}]
    assert len(result["validation"]) == 8 and result["validation_ok"]
    assert all(abs(v["rel_err_pct"]) < 0.1 for v in result["validation"]), result["validation"]
    assert [(p["tokens"], p["G"]) for p in result["predictions"]] == [(8192, 2), (8192, 4), (16384, 2), (16384, 4)]
    for p in result["predictions"]:  # hiding under the local attention is between none and all of it
        assert p["step_s_f0"] >= p["step_s_fplanned"] >= p["step_s_fkeys"] >= p["step_s_f1"], p
    assert (out / "scaling_model.md").exists() and (out / "scaling_model.png").exists()
    # the same rates filed under another head dim: they stand in for the model's, and the report says so
    (tmp_path / "kernels.json").write_text(json.dumps({**kernels, "args": {"head_dim": 2 * cfg["head_dim"]}}))
    bench_main(["scaling", "--multigpu", str(tmp_path / "run.json"), "--kernels", str(tmp_path / "kernels.json"),
                "--kernel", "dense", "--models", "tiny", "--validate-only", "--out", str(out)])
    result = json.loads((out / "scaling_model.json").read_text())
    assert result["validation_ok"] and [r["substituted"] for r in result["kernel_rates"]] == [True]
    assert "Not calibrated at the model's head dim" in (out / "scaling_model.md").read_text()


def test_exchange_time_is_zero_on_one_rank():
    st = synthetic(bw=1.0, latency=1.0)
    assert kv_exchange_ms(CFG, 1, pack_cost(LENGTHS, 1, "contiguous"), st) == 0.0


def test_overlaps_argument_names_what_it_takes():
    import argparse

    from hf_blockdiag_cp.bench.scaling import overlap_value

    assert [overlap_value(t) for t in ("0", "0.5", "planned", "keys")] == [0.0, 0.5, "planned", "keys"]
    for bad in ("bogus", "1.5", "nan"):
        with pytest.raises(argparse.ArgumentTypeError, match=f"a fraction in \\[0, 1\\], 'planned' or 'keys'; got '{bad}'"):
            overlap_value(bad)

"""CPU smoke tests of `python -m hf_blockdiag_cp.bench kernels|model|ranks`: the scripts run end to end
at tiny sizes and write what the GPU runs are read from (rows per method, ratios, the fit search).
The numbers themselves mean nothing on a CPU; the GPU figures and their commands are in docs/performance.md."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from transformers import LlamaConfig

from hf_blockdiag_cp.bench.__main__ import main as bench_main
from hf_blockdiag_cp.bench.model_hybrid import padded_batches


def test_bench_kernels_cpu_smoke(tmp_path):
    bench_main(["kernels", "--device", "cpu", "--backends", "dense", "--seq-lens", "256", "--heads", "4", "--kv-heads",
                "2", "--head-dim", "16", "--mean-doc-len", "64", "--dtype", "float32", "--reps", "2", "--profile", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "kernels.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ours/dense", "dense-mask sdpa", "sdpa one causal doc (ceiling)"]
    assert all(r["ms"] > 0 for r in rows) and rows[0]["vs_dense"] > 0
    assert (tmp_path / "kernels.png").exists()
    assert "Self CPU" in (tmp_path / "profile_256_ours_dense.txt").read_text()


def test_bench_model_cpu_smoke(tmp_path):
    config = tmp_path / "config"
    LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=2048).save_pretrained(config)
    bench_main(["model", "--device", "cpu", "--model", str(config), "--methods", "blockdiag_cp/dense", "hf_sdpa",
                "--seq-lens", "128", "--block-steps", "2", "--fit-methods", "blockdiag_cp/dense", "--fit-lens", "256",
                "--mean-doc-len", "32", "--dtype", "float32", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "model.json").read_text())
    assert [(r["method"], r["seq_len"]) for r in result["rows"]] == [("blockdiag_cp/dense", 128), ("hf_sdpa", 128)]
    ours, sdpa = result["rows"]
    assert ours["timed_steps"] == 2 and sdpa["timed_steps"] == 1  # hf_sdpa: one block by default
    assert ours["tokens_per_s"] > 0 and ours["first_s"] > 0
    assert result["largest_fitting"] == {"blockdiag_cp/dense": 256}


def test_bench_model_reports_each_block_as_it_ends(tmp_path):
    """A run cut short keeps what it measured: `report` gets every method's row right after its block,
    the methods not yet run without a time."""
    from hf_blockdiag_cp.bench.model import add_arguments, run

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--tiny", "--device", "cpu", "--layers", "2", "--methods", "blockdiag_cp/dense", "hf_sdpa",
                         "--seq-lens", "128", "--mean-doc-len", "32", "--dtype", "float32", "--out", str(tmp_path)])
    args.block_steps, args.rounds = 2, 1
    reports = []
    run(args, report=lambda result: reports.append([r.get("tokens_per_s") for r in result["rows"]]))
    assert reports[0][0] > 0 and reports[0][1] is None  # ours measured, hf_sdpa not yet
    assert all(rate > 0 for rate in reports[-1])


def test_bench_model_compiled_cpu_smoke(tmp_path):
    """`--compile layers` (activation checkpointing on, the default): with `--eager-baselines` ours is
    compiled and the baseline not; without it the baseline is compiled too; in both runs nothing
    compiles after each method's first step. The second run keeps dynamo's cache of the first, where
    ours compiled: it compiles the baseline only (compiling ours again would test nothing new)."""
    torch.compiler.reset()  # count these runs' compilations, not cache hits of an earlier test's
    for eager_baselines in (True, False):
        out = tmp_path / f"eager_baselines_{eager_baselines}"
        bench_main(["model", "--tiny", "--device", "cpu", "--layers", "2", "--methods", "blockdiag_cp/dense", "hf_sdpa",
                    "--seq-lens", "128", "--block-steps", "2", "--mean-doc-len", "32", "--dtype", "float32",
                    "--compile", "layers", "--compile-backend", "aot_eager", "--out", str(out)]
                   + ["--eager-baselines"] * eager_baselines)
        result = json.loads((out / "model.json").read_text())
        assert result["args"]["compile"] == "layers" and result["args"]["eager_baselines"] == eager_baselines
        ours, baseline = result["rows"]
        if eager_baselines:
            assert ours["graphs_compiled"] > 0 and baseline["graphs_compiled"] == 0, (ours, baseline)
        else:
            assert baseline["graphs_compiled"] > 0, baseline
        assert ours["graphs_compiled_later"] == 0 and baseline["graphs_compiled_later"] == 0, (ours, baseline)
        assert ours["tokens_per_s"] > 0 and baseline["tokens_per_s"] > 0


def test_eager_baselines_needs_compile():
    with pytest.raises(SystemExit, match="--eager-baselines: expected --compile"):
        bench_main(["model", "--tiny", "--device", "cpu", "--eager-baselines"])


@pytest.mark.parametrize("arch,layers,patch", [("qwen3_5", "4", "gated_delta_packed"), ("nemotron_h", "8", "mamba2_packed"),
                                               ("lfm2", "3", "short_conv_packed")])
def test_bench_model_hybrid_cpu_smoke(tmp_path, arch, layers, patch):
    """`--arch qwen3_5`, `nemotron_h` and `lfm2`: ours on the patched copy, the stock baselines (packed, and the
    documents unpacked and padded) on the unpatched model, ratios of ours over each baseline."""
    methods = ["blockdiag_cp/dense", "hf_sdpa", "hf_padded"]
    bench_main(["model", "--arch", arch, "--tiny", "--device", "cpu", "--layers", layers, "--seq-lens", "256",
                "--methods", *methods, "--mean-doc-len", "64", "--dtype", "float32", "--block-steps", "2",
                "--out", str(tmp_path)])
    result = json.loads((tmp_path / "model.json").read_text())
    rows = result["rows"]
    assert [(r["method"], r["seq_len"]) for r in rows] == [(m, 256) for m in methods]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and r["timed_steps"] == 1 for r in rows)
    assert [r["patches"] for r in rows] == [[patch], [], []]  # the baselines ran the stock model
    padded = rows[2]
    assert padded["padded_tokens"] >= 256 and padded["padded_batches"] >= 1
    assert [(r["ours"], r["baseline"]) for r in result["ratios"]] == [(methods[0], "hf_sdpa"), (methods[0], "hf_padded")]
    assert result["args"]["rounds"] == 1  # the hybrid's default


def test_padded_batches_hold_every_document_once():
    """`hf_padded`'s batches: each document once, right-padded, within the token budget, losses weighted to the pack's mean."""
    lengths = [5, 1, 9, 3, 2]
    ids = torch.arange(1, 21)[None]
    batches, weights, padded = padded_batches(lengths, ids, budget=12)
    docs = sorted(tuple(row[mask.bool()].tolist()) for b in batches for row, mask in zip(b["input_ids"], b["attention_mask"]))
    starts = [0, 5, 6, 15, 18]
    assert docs == sorted(tuple(range(s + 1, s + n + 1)) for s, n in zip(starts, lengths))
    assert all(b["input_ids"].numel() <= 12 or b["input_ids"].shape[0] == 1 for b in batches)
    assert all(torch.equal(b["labels"] == -100, b["attention_mask"] == 0) for b in batches)
    assert math.isclose(sum(weights), 1.0) and padded == sum(b["input_ids"].numel() for b in batches)
    (one,), _, _ = padded_batches(lengths, ids, budget=0)
    assert one["input_ids"].shape == (5, 9)


def test_bench_ranks_cpu_smoke(tmp_path):
    """Both key buffers (all-gather: every row; a2a: the needed rows) run, and the calibration fits."""
    for exchange in ("allgather", "a2a"):
        out = tmp_path / exchange
        bench_main(["ranks", "--device", "cpu", "--backend", "dense", "--seq-len", "512", "--cp-sizes", "2", "3",
                    "--scenarios", "lognormal4k", "one_doc", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                    "--dtype", "float32", "--reps", "1", "--calls", "1", "--exchange", exchange, "--calibrate",
                    "--out", str(out)])
        rows = json.loads((out / "ranks.json").read_text())["rows"]
        assert [(r["scenario"], r["G"], r["strategy"]) for r in rows] == [
            (s, g, strategy) for s in ("lognormal4k", "one_doc") for g in (2, 3) for strategy in ("contiguous", "balanced")]
        assert all(r["exchange"] == exchange and len(r["rank_ms"]) == r["G"] and r["max_over_ideal"] > 0 for r in rows)
        fit = json.loads((out / "kernel_cost_dense.json").read_text())
        assert fit["cost"]["ms_per_tile"] > 0 and len(fit["samples"]) == 1 + 1 + 2 * (2 + 3) * 2


def test_bench_ranks_times_the_splits_next_to_the_plain_call(tmp_path):
    """`--overlaps`: each rank's split attention and its local part, one row per split mode after each
    plain row; the calibration keeps to the plain rows."""
    bench_main(["ranks", "--device", "cpu", "--backend", "dense", "--seq-len", "512", "--cp-sizes", "2",
                "--scenarios", "one_doc", "lognormal4k", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
                "--dtype", "float32", "--reps", "1", "--calls", "1", "--overlaps", "queries", "keys", "--calibrate",
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "ranks.json").read_text())["rows"]
    assert [(r["scenario"], r["strategy"], r.get("overlap")) for r in rows] == [
        (s, strategy, mode) for s in ("one_doc", "lognormal4k") for strategy in ("contiguous", "balanced")
        for mode in (None, "queries", "keys")]
    for r in rows:  # times: no order between two of them asserted; the row describes its busiest rank
        if r.get("overlap"):
            assert r["over_plain"] > 0 and len(r["rank_local_ms"]) == 2, r
            busiest = r["rank_ms"].index(round(r["max_rank_ms"], 4))
            assert round(r["busiest_local_ms"], 4) == r["rank_local_ms"][busiest], r
            assert math.isclose(r["busiest_local_share"], r["busiest_local_ms"] / r["max_rank_ms"]), r
        if r.get("overlap") == "keys":  # split by keys, every rank's queries attend over its own keys first
            assert all(ms > 0 for ms in r["rank_local_ms"]), r
    # One document over two contiguous ranks: rank 1's every query continues it, so split by queries it
    # has no local part; split by keys every query attends over its own keys first.
    one_doc = {r["overlap"]: r for r in rows if r["scenario"] == "one_doc" and r["strategy"] == "contiguous" and r.get("overlap")}
    assert one_doc["queries"]["rank_local_ms"][1] == 0 and one_doc["keys"]["rank_local_ms"][1] > 0
    assert len(json.loads((tmp_path / "kernel_cost_dense.json").read_text())["samples"]) == 2 + 2 * 2 * 2
    assert "busiest_local_share" in (tmp_path / "ranks.md").read_text()


def test_bench_model_memory_features_on_ours_only(tmp_path):
    """`--tiled-mlp` and `--offload-checkpoints` act on the model ours runs on, not on the baseline's."""
    bench_main(["model", "--tiny", "--device", "cpu", "--layers", "2", "--seq-lens", "128", "--methods",
                "blockdiag_cp/dense", "hf_sdpa", "--mean-doc-len", "32", "--dtype", "float32", "--block-steps", "2",
                "--rounds", "1", "--tiled-mlp", "32", "--offload-checkpoints", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert all(math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 for r in rows)
    from hf_blockdiag_cp.bench.model_hybrid import build_models
    from hf_blockdiag_cp.compat.transformers import checkpoint_function
    from hf_blockdiag_cp.integrations.memory import CheckpointOffload

    args = argparse.Namespace(**json.loads((tmp_path / "model.json").read_text())["args"])
    models = build_models(args)
    assert isinstance(checkpoint_function(models.ours.model.layers[0]), CheckpointOffload)
    assert not isinstance(checkpoint_function(models.stock.model.layers[0]), CheckpointOffload)
    assert "_bdcp_stock_forward" in vars(models.ours.model.layers[0].mlp)
    assert "_bdcp_stock_forward" not in vars(models.stock.model.layers[0].mlp)

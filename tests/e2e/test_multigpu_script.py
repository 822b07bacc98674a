"""CPU smoke test of benchmarks/multigpu.py: two gloo ranks under torchrun, tiny sizes, one row per part.

Checks the JSON the script writes: attention and overlap rows of one exchange (also overlapped, split
by queries and by keys) on one layout with positive times, the e2e part's steps, and the summary
over runs (`--summarize` starts no process group: its `main` runs in the test's process). Every
exchange × layout × overlap runs through the same row functions; their exactness on several ranks
is tested in tests/multiprocess/test_cp_parity_matrix.py, tests/multiprocess/test_overlap.py and
tests/gpu/test_nccl_parity.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.launch import Run
from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "multigpu.py"
# `torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py ...`: a run of the shared launch.
RUN = Run("multigpu", SCRIPT, ("--device", "cpu", "--tiny", "--parts", "attention,overlap,e2e", "--setups", "magi",
                               "--exchanges", "a2a", "--layouts", "balanced", "--e2e-tokens", "512", "--e2e-grad-sync",
                               "ddp", "--e2e-overlap", "--out", "out"))


@pytest.mark.launched(RUN)
def test_multigpu_script_cpu_smoke(launch, tmp_path):
    """All three parts in one torchrun run: attention and overlap on the a2a exchange (the one with a
    plan) and the balanced layout, one pack; the e2e part with `--e2e-grad-sync ddp` (the README's
    recipe: DDP over the CP ranks) and the exchange overlapped with attention runs its steps at G = 2
    (in processes of its own, as on GPUs) and records both."""
    run = launch.result(RUN)
    run.assert_ok("torchrun --nproc-per-node 2 benchmarks/multigpu.py")
    out = run.cwd / "out"
    result = json.loads((out / "multigpu_G2.json").read_text())
    assert (out / "multigpu_G2.md").exists() and (out / "raw" / "rank0.log").exists() and (out / "raw" / "rank1.log").exists()
    assert result["env"]["G"] == 2
    parts = result["parts"]
    assert set(parts) == {"attention", "overlap", "e2e"}
    for name, part in parts.items():
        assert part["ok"], (name, part.get("error"))
    e2e = parts["e2e"]["rows"]
    assert [r["tokens"] for r in e2e] == [512]
    for r in e2e:
        assert r["G"] == 2 and r["grad_sync"] == "ddp" and r["layout"] == "contiguous" and r["status"] == "ok", r
        assert r["overlap"] == "queries" and r["step_s"] > 0 and r["tokens_per_s"] > 0, r

    attention = parts["attention"]["rows"]
    modes = [("a2a", False), ("a2a", "queries"), ("a2a", "keys")]  # dense returns its log-sum-exp: split by keys too
    assert [(r["setup"], r["exchange"], r["overlap"], r["layout"]) for r in attention] == [
        ("magi", x, o, "balanced") for x, o in modes]
    for r in attention:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_tflops_gpu"] > 0, r
        assert r["single_fwd_ms"] > 0 and r["fwdbwd_pct_ideal"] > 0, r

    overlap = parts["overlap"]["rows"]
    assert [(r["setup"], r["exchange"], r["overlap"], r["layout"]) for r in overlap] == [
        ("magi", x, o, "balanced") for x, o in modes]
    for r in overlap:
        for key in ("comm_fwd_ms", "attn_fwd_ms", "total_fwd_ms", "comm_bwd_ms", "attn_bwd_ms", "total_bwd_ms"):
            assert r[key] > 0, (key, r)
    assert "part | ok | s | headline" in run.logs[0]  # the short table is printed last

    summary = tmp_path / "summary"  # `python benchmarks/multigpu.py --summarize`: no process group, so in this process
    load_script(SCRIPT, "multigpu_script").main(["--summarize", str(out), "--out", str(summary)])
    text = (summary / "scaling.md").read_text()
    assert text.count("| magi |") == 3  # a setup of one pack: its row per exchange mode is its total
    assert text.count("| a2a |") == 1 and text.count("a2a+overlap |") == 1 and text.count("a2a+overlap_keys |") == 1
    assert text.count("| tiny | 512 | 2 | ok |") == 1  # the e2e row

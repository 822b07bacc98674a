"""CPU smoke test of benchmarks/multigpu.py: two gloo ranks under torchrun, tiny sizes.

Checks the JSON the script writes: every parity row passes (dense kernel, fp32, <= 1e-4 against
the stock eager model run per document), attention and overlap rows have positive times.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "multigpu.py"


def run_script(out: Path, nproc: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node nproc benchmarks/multigpu.py --device cpu --tiny ARGS --out out`, which must exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), str(SCRIPT),
        "--device", "cpu", "--tiny", *args, "--out", str(out),
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_multigpu_script_cpu_smoke(tmp_path):
    out = tmp_path / "out"
    proc = run_script(out, 2, "--parts", "parity,attention,overlap")
    result = json.loads((out / "multigpu_G2.json").read_text())
    assert (out / "multigpu_G2.md").exists() and (out / "raw" / "rank0.log").exists() and (out / "raw" / "rank1.log").exists()
    assert result["env"]["G"] == 2
    parts = result["parts"]
    assert set(parts) == {"parity", "attention", "overlap"}
    for name, part in parts.items():
        assert part["ok"], (name, part.get("error"))

    parity = parts["parity"]["rows"]
    # 3 packs (straddle, all-padding rank, document spanning all ranks) x 3 exchanges x 2 layouts
    assert len(parity) == 18
    assert {r["pack"] for r in parity} == {"straddle", "padding_rank", "span_all"}
    assert any(r["padding_ranks"] >= 1 for r in parity if r["pack"] == "padding_rank")
    for r in parity:
        assert r["kernel"] == "dense" and r["dtype"] == "float32"
        assert r["status"] == "pass", r
        assert r["loss_err"] <= 1e-4 and r["grad_err_max_param"] <= 1e-4, r

    attention = [r for r in parts["attention"]["rows"] if r["pack"] != "ALL"]
    assert {r["setup"] for r in attention} == {"magi", "ringflash"}
    assert {(r["exchange"], r["layout"]) for r in attention} == {
        (x, lay) for x in ("allgather", "halo", "a2a") for lay in ("contiguous", "balanced")
    }
    for r in attention:
        assert r["fwd_ms"] > 0 and r["bwd_ms"] > 0 and r["fwdbwd_tflops_gpu"] > 0, r
        assert r["single_fwd_ms"] > 0 and r["fwdbwd_pct_ideal"] > 0, r

    overlap = parts["overlap"]["rows"]
    assert overlap
    for r in overlap:
        for key in ("comm_fwd_ms", "attn_fwd_ms", "total_fwd_ms", "comm_bwd_ms", "attn_bwd_ms", "total_bwd_ms"):
            assert r[key] > 0, (key, r)
    assert "part | ok | s | headline" in proc.stdout  # the short table is printed last


def test_multigpu_script_e2e_with_ddp_cpu_smoke(tmp_path):
    """The e2e part with `--e2e-grad-sync ddp` (the README's recipe: DDP over the CP ranks) runs its
    steps at G = 2 on gloo and records how gradients were synchronised."""
    out = tmp_path / "out"
    run_script(out, 2, "--parts", "e2e", "--e2e-grad-sync", "ddp")
    rows = json.loads((out / "multigpu_G2.json").read_text())["parts"]["e2e"]["rows"]
    assert [r["tokens"] for r in rows] == [256, 512, 1024]
    for r in rows:
        assert r["G"] == 2 and r["grad_sync"] == "ddp" and r["status"] == "ok", r
        assert r["step_s"] > 0 and r["tokens_per_s_per_gpu"] > 0, r


def test_multigpu_script_parity_at_four_ranks(tmp_path):
    """Issue 17's script at G = 4 (gloo, CPU, dense kernel, fp32): every kernel x exchange x layout
    row of the parity part matches the stock model run per document (<= 1e-4), including the pack
    with an all-padding rank and the document over all ranks."""
    out = tmp_path / "out"
    run_script(out, 4, "--parts", "parity", timeout=240)
    result = json.loads((out / "multigpu_G4.json").read_text())
    assert result["env"]["G"] == 4
    parity = result["parts"]["parity"]["rows"]
    assert len(parity) == 18 and {r["pack"] for r in parity} == {"straddle", "padding_rank", "span_all"}
    assert any(r["padding_ranks"] >= 1 for r in parity if r["pack"] == "padding_rank")
    for r in parity:
        assert r["status"] == "pass" and r["loss_err"] <= 1e-4 and r["grad_err_max_param"] <= 1e-4, r

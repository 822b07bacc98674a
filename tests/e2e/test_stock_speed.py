"""`benchmarks/stock_speed.py --tiny` (training steps where packing saves nothing) runs every task and
both length mixes end to end, and compares like with like: ours and TRL's row of a (task, mix) train
the same real tokens, TRL's batch computes no padding in the equal mix and some in the log-normal one,
and the first step's loss of the two sides agrees (same data, same initial weights, each loss as its
trainer computes it: TRL's fused LM head and ours' pack)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.scripts import ROOT, run_in_process


def test_stock_speed_rows_train_the_same_tokens_to_the_same_loss(monkeypatch, capsys, tmp_path):
    """`python benchmarks/stock_speed.py --tiny --models llama --seq-lens 32 --methods ours trl --steps 1`,
    its `__main__` run in the test's process (one process, CPU)."""
    threads = torch.get_num_threads()  # --tiny runs on one thread; the process keeps its own afterwards
    try:
        status, out, err = run_in_process(
            monkeypatch, capsys, ROOT / "benchmarks" / "stock_speed.py",
            ["--tiny", "--models", "llama", "--seq-lens", "32", "--methods", "ours", "trl", "--steps", "1",
             "--out", str(tmp_path)], {})
    finally:
        torch.set_num_threads(threads)
    assert status in (None, 0), err[-2000:]
    result = json.loads((tmp_path / "stock_speed.json").read_text())
    rows = {(r["task"], r["mix"], r["method"]): r for r in result["rows"]}
    assert sorted(rows) == sorted((t, m, meth) for t in ("sft", "dpo", "reward", "grpo")
                                  for m in ("equal", "lognormal") for meth in ("ours", "trl"))
    assert all(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in rows.values()), result["rows"]
    for task in ("sft", "dpo", "reward", "grpo"):
        for mix in ("equal", "lognormal"):
            ours, trl = rows[task, mix, "ours"], rows[task, mix, "trl"]
            assert ours["S"] == trl["S"] == ours["computed"], (task, mix)
            assert (trl["computed"] == trl["S"]) == (mix == "equal"), (task, mix, trl["computed"], trl["S"])
            assert ours["loss"] == pytest.approx(trl["loss"], rel=1e-4, abs=1e-6), (task, mix)
    assert all(r["ours_over_trl"] > 0 for r in result["ratios"]) and len(result["ratios"]) == 8

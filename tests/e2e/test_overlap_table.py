"""`benchmarks/overlap_table.py` (the planner table of docs/kernels.md, "Overlap") runs end to end
and its shares keep the orderings that hold by definition: a rank's query-split share is at most
its share by keys (a query whose keys are all local counts every pair), the smallest share over
the ranks is at most the busiest rank's, and every share is a percentage."""

from __future__ import annotations

import subprocess
import sys

from helpers.scripts import ROOT, script_env


def test_overlap_table_runs_and_its_shares_are_ordered(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overlap_table.py"), "--packs", "1", "--out",
                          str(tmp_path)], cwd=ROOT, env=script_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in (tmp_path / "overlap_table.md").read_text().splitlines() if line.startswith("| (")]
    assert len(rows) == 16, rows  # 4 scenarios x G = 2, 4, 8, 16
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for busiest, smallest, whole, by_keys in (cells[2:6], cells[6:10]):
            busiest, smallest, whole, by_keys = (int(c) for c in (busiest, smallest, whole, by_keys))
            assert all(0 <= v <= 100 for v in (busiest, smallest, whole, by_keys)), line
            assert smallest <= busiest <= by_keys, line

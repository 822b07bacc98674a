"""`benchmarks/overlap_table.py` (the planner table of docs/kernels.md, "Overlap") runs end to end
and its shares keep the orderings that hold by definition: a rank's query-split share is at most
its share by keys (a query whose keys are all local counts every pair), the smallest share over
the ranks is at most the busiest rank's, and every share is a percentage."""

from __future__ import annotations

from helpers.scripts import ROOT, run_in_process


def test_overlap_table_runs_and_its_shares_are_ordered(monkeypatch, capsys, tmp_path):
    """`python benchmarks/overlap_table.py --packs 1 --out DIR`, its `__main__` run in the test's
    process (the planner alone: no process group, no interpreter to start)."""
    status, out, err = run_in_process(monkeypatch, capsys, ROOT / "benchmarks" / "overlap_table.py",
                                      ["--packs", "1", "--out", str(tmp_path)], {})
    assert status in (None, 0), err[-2000:]
    rows = [line for line in (tmp_path / "overlap_table.md").read_text().splitlines() if line.startswith("| (")]
    assert len(rows) == 16, rows  # 4 scenarios x G = 2, 4, 8, 16
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        for busiest, smallest, whole, by_keys in (cells[2:6], cells[6:10]):
            busiest, smallest, whole, by_keys = (int(c) for c in (busiest, smallest, whole, by_keys))
            assert all(0 <= v <= 100 for v in (busiest, smallest, whole, by_keys)), line
            assert smallest <= busiest <= by_keys, line

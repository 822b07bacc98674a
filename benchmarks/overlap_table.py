"""Planner table: how much of each rank's attention can run while its K/V exchange is in flight
under `CPConfig(overlap=True)`, for the 128k-token packs of layout_table.py at G = 2, 4, 8, 16.

Prints a markdown table and writes it to OUT/overlap_table.md (`--out`, default bench_out). Every
number comes from the planner (`plan_layout`, `rank_work`, `overlap_work`); nothing runs a kernel.
Per pack, layout and G, the local share of a rank is its block-causal work whose keys are all on
the rank (its local part, `planning.plan_overlap`) over all of its work. Columns, mean over the
packs of a scenario:
  busiest   the local share of the rank with the most work (what the step waits for)
  min       the smallest local share over the ranks
  all       the pack's local work over its whole work
  by keys   the busiest rank's share of work whose key it holds (`key_local_work`): what the split
            by keys (CPConfig(overlap="keys")) runs during the exchange
The exchange hides completely on a rank when its local part takes at least as long as the exchange.
Run: python benchmarks/overlap_table.py [--packs 16] [--out bench_out]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from hf_blockdiag_cp.planning import key_local_work, overlap_work, plan_layout, rank_work
from layout_table import CP_SIZES, scenarios, write_table

LAYOUTS = ("contiguous", "balanced")


def shares(lengths: list[int], g: int, layout: str) -> tuple[float, float, float, float]:
    """(busiest rank's local share, smallest local share, the pack's local share, the busiest rank's
    share by keys) of one layout."""
    lay = plan_layout(lengths, g, layout)
    work, local, by_keys = rank_work(lay).double(), overlap_work(lay).double(), key_local_work(lay).double()
    share = torch.where(work > 0, local / work.clamp(min=1), torch.ones_like(work))
    busiest = int(work.argmax())
    return (float(share[busiest]), float(share.min()), float(local.sum() / work.sum()),
            float(by_keys[busiest] / work[busiest].clamp(min=1)))


def row(name: str, packs: list[list[int]], g: int) -> str:
    cells = []
    for layout in LAYOUTS:
        per_pack = [shares(lengths, g, layout) for lengths in packs]
        cells += [f"{100 * statistics.fmean(p[i] for p in per_pack):.0f}" for i in range(4)]
    return f"| {name} | {g} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=16, help="random packs per scenario")
    parser.add_argument("--out", default="bench_out", help="writes overlap_table.md here")
    args = parser.parse_args()
    cases, path = scenarios(args.packs)
    lines = [
        f"Local share of attention work under overlap (%), 128k-token packs, {args.packs} random packs per scenario "
        f"(mean). Histogram: {path.name}.",
        "",
        "| pack | G | contiguous: busiest | min | all | by keys | balanced: busiest | min | all | by keys |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, packs in cases.items():
        for g in CP_SIZES:
            lines.append(row(name, packs, g))
            print(lines[-1], flush=True)
    print(write_table(lines, Path(args.out) / "overlap_table.md"))


if __name__ == "__main__":
    main()

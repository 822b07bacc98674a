"""Planner table: contiguous vs balanced layouts of 128k-token packs at G = 2, 4, 8, 16.

Prints a markdown table and writes it to OUT/layout_table.md (`--out`, default bench_out). Every number comes
from the planner (`plan_layout`, `layout_cost`); nothing runs a kernel. Columns:
  work max/mean  per-rank block-causal attention work, max over ranks / mean (1.00 = perfect)
  cost max/ideal the balanced layout's objective: predicted kernel cost (default KernelCost, the
                 varlen calibration) of the dearest rank over the whole pack's cost / G
  tokens/rank    real (non-padding) rows per rank, min-max (every rank holds L = S_pad/G rows)
  allgather MB   K/V bytes one rank receives per layer in the all-gather exchange
  a2a MB         K/V bytes the busiest rank receives per layer in an exact all-to-all-v of the
                 rows it needs (8 kv heads x (128 + 128) dims x bf16 = 4 KiB per row)
  split docs     documents whose tokens sit on more than one rank
Packs: (a) log-normal lengths, mean 4096, sigma 1; (b) one 131072-token document;
(c) one 65536-token document first, then log-normal short ones (mean 512, sigma 1, <= 4096);
(d) lengths drawn from the 13.4M-document histogram in doc_length_distribution.csv (bucket by
count, uniform within the bucket, capped at a quarter of the pack). Random packs: the mean over
PACKS packs, and the worst balanced one. The last document of a random pack is cut to fill it.

  halo valid     share of packs whose layout a left-halo exchange can serve
  ms             planner CPU time per step (thread time, best of 20): plan_layout from document
                 ids (segmentation included) and the balancing step alone
Run: python benchmarks/layout_table.py [--packs 16] [--out bench_out]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

import torch

from hf_blockdiag_cp.planning import layout_cost
from hf_blockdiag_cp.planning.balance import balanced_slot_positions
from hf_blockdiag_cp.bench.common import histogram_buckets
from hf_blockdiag_cp.bench.setups import HIST_CSV
from hf_blockdiag_cp.planning import document_ids_from_lengths, plan_layout

PACK = 131072
CP_SIZES = (2, 4, 8, 16)
MB = 1024 * 1024


def fill_pack(draw, rng, pack: int = PACK, first: list[int] | None = None) -> list[int]:
    """Lengths drawn by `draw(rng)` until the pack is full; the last one is cut to fit."""
    lengths, total = list(first or []), sum(first or [])
    while total < pack:
        n = min(max(int(draw(rng)), 1), pack - total)
        lengths.append(n)
        total += n
    return lengths


def lognormal(mean: float, sigma: float, cap: int):
    mu = np.log(mean) - sigma**2 / 2
    return lambda rng: min(rng.lognormal(mu, sigma), cap)


def histogram_sampler(cap: int):
    buckets, counts = histogram_buckets(HIST_CSV)
    p = np.asarray(counts, dtype=float) / sum(counts)

    def draw(rng):
        b = rng.choice(len(p), p=p)
        return min(rng.integers(buckets[b][0], buckets[b][1] + 1), cap)

    return draw, HIST_CSV


def scenarios(packs: int):
    hist, path = histogram_sampler(PACK // 4)
    return {
        "(a) log-normal, mean 4k": [fill_pack(lognormal(4096, 1.0, PACK), np.random.default_rng(s)) for s in range(packs)],
        "(b) one 128k document": [[PACK]],
        "(c) one 64k + short docs": [
            fill_pack(lognormal(512, 1.0, 4096), np.random.default_rng(100 + s), first=[PACK // 2]) for s in range(packs)
        ],
        "(d) real distribution": [fill_pack(hist, np.random.default_rng(200 + s)) for s in range(packs)],
    }, path


def cpu_ms(fn, repeat: int = 20) -> float:
    """Best-of-`repeat` CPU time of this thread (robust to other processes on a shared host)."""
    times = []
    for _ in range(repeat):
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0)
    return 1000 * min(times)


def planner_ms(lengths: list[int], g: int, strategy: str, repeat: int = 20) -> float:
    """`plan_layout` from document ids (what the shard step calls), CPU ms."""
    ids = document_ids_from_lengths(lengths)
    return cpu_ms(lambda: plan_layout(ids, g, strategy), repeat)


def balancer_ms(lengths: list[int], g: int, repeat: int = 20) -> float:
    """The balancing step alone (`balanced_slot_positions` on the segment boundaries), CPU ms."""
    boundaries = plan_layout(lengths, g).segments.boundaries
    return cpu_ms(lambda: balanced_slot_positions(boundaries, g), repeat)


def row(name: str, packs: list[list[int]], g: int) -> str:
    stats = {"contiguous": [], "balanced": []}
    for lengths in packs:
        for strategy in stats:
            stats[strategy].append(layout_cost(plan_layout(lengths, g, strategy)))
    c, b = stats["contiguous"], stats["balanced"]

    def mean(costs, f):
        return statistics.fmean(f(x) for x in costs)

    imb_b = [x.imbalance for x in b]
    tokens = f"{min(min(x.tokens) for x in b)}-{max(max(x.tokens) for x in b)}"
    ms = statistics.median(planner_ms(lengths, g, "balanced") for lengths in packs[:4])
    ms_c = statistics.median(planner_ms(lengths, g, "contiguous") for lengths in packs[:4])
    ms_b = statistics.median(balancer_ms(lengths, g) for lengths in packs[:4])
    docs = statistics.fmean(len(lengths) for lengths in packs)
    halo = f"{mean(c, lambda x: 'halo' in x.exchange_bytes):.0%} / {mean(b, lambda x: 'halo' in x.exchange_bytes):.0%}"
    return (
        f"| {name} | {g} | {docs:.0f} | {mean(c, lambda x: x.imbalance):.3f} | {statistics.fmean(imb_b):.3f} "
        f"| {max(imb_b):.3f} | {mean(c, lambda x: x.over_ideal):.3f} | {mean(b, lambda x: x.over_ideal):.3f} "
        f"| {max(x.over_ideal for x in b):.3f} | {tokens} | {c[0].exchange_bytes['allgather'][0] / MB:.0f} "
        f"| {mean(c, lambda x: max(x.exchange_bytes['a2a'])) / MB:.0f} "
        f"| {mean(b, lambda x: max(x.exchange_bytes['a2a'])) / MB:.0f} "
        f"| {mean(c, lambda x: x.split_documents):.1f} | {mean(b, lambda x: x.split_documents):.1f} | {halo} "
        f"| {ms_c:.2f} | {ms:.2f} | {ms_b:.2f} |"
    )


def scaling(g: int, repeat: int = 20) -> list[str]:
    """Planner CPU time against the number of documents."""
    lines = [
        "| G | pack tokens | documents | plan_layout contiguous ms | plan_layout balanced ms | balancing step ms "
        "| balancing step ms per 1000 docs |",
        "|---|---|---|---|---|---|---|",
    ]
    hist, _ = histogram_sampler(PACK // 4)
    cases = [
        (PACK, fill_pack(hist, np.random.default_rng(7))),
        (PACK, fill_pack(lognormal(32, 0.5, 256), np.random.default_rng(8))),
        (8 * PACK, fill_pack(hist, np.random.default_rng(9), pack=8 * PACK)),
        (8 * PACK, fill_pack(lognormal(64, 0.5, 512), np.random.default_rng(10), pack=8 * PACK)),
    ]
    for tokens, lengths in cases:
        c = planner_ms(lengths, g, "contiguous", repeat)
        b = planner_ms(lengths, g, "balanced", repeat)
        step = balancer_ms(lengths, g, repeat)
        lines.append(f"| {g} | {tokens} | {len(lengths)} | {c:.2f} | {b:.2f} | {step:.2f} | {1000 * step / len(lengths):.2f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=16, help="random packs per scenario")
    parser.add_argument("--out", default="bench_out", help="writes layout_table.md here")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the shard step plans on the host, beside the training loop
    cases, path = scenarios(args.packs)
    lines = [
        f"Planner table: 128k-token packs, {args.packs} random packs per scenario (mean; 'worst' = worst balanced pack). "
        f"K/V: 8 kv heads x (128+128) x bf16 per row, per layer, forward. Histogram: {path.name}.",
        "",
        "| pack | G | docs | work max/mean contiguous | balanced | balanced worst "
        "| predicted cost max/ideal contiguous | balanced | balanced worst | tokens/rank (balanced) "
        "| allgather MB/rank | a2a MB max rank, contiguous | a2a balanced | split docs contiguous | split balanced "
        "| halo valid contiguous / balanced | plan_layout ms contiguous | plan_layout ms balanced | balancing step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, packs in cases.items():
        for g in CP_SIZES:
            lines.append(row(name, packs, g))
            print(lines[-1], flush=True)
    lines += ["", "Planner CPU time against documents (best of 20, one thread, this host):", ""] + scaling(8) + scaling(16)[2:]
    print(write_table(lines, Path(args.out) / "layout_table.md"))


def write_table(lines: list[str], out: Path) -> str:
    """Write the table's `lines` to `out` (creating its folder); return the text and where it went."""
    text = "\n".join(lines) + "\n"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return f"{text}\nwrote {out}"


if __name__ == "__main__":
    main()

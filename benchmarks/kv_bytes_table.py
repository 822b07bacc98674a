"""Exchange bytes per rank and layer: allgather vs halo vs a2a vs heads, on realistic packs and one
long document (planning only).

Every number comes from the exchange planner (`plan_layout`, `plan_exchange`,
`choose_exchange`); nothing runs a kernel or a collective. The gloo tests check that the real
exchanges move exactly the planned bytes (tests/multiprocess/test_exchange_bytes.py).

Model: 32 query / 8 kv heads, head dim 128, bf16, so one exchanged row (K and V of one token,
all kv heads) is 8 x (128 + 128) x 2 B = 4 KiB. Bytes are what one rank *receives* in the
forward of one attention layer; the backward's reverse exchange receives as much in total (for
allgather, exactly as much per rank).

Packs: document lengths drawn i.i.d. from the 13.4M-document histogram in
hf_blockdiag_cp/bench/data/doc_length_distribution.csv (MagiAttention's method: a bucket with probability
proportional to its count, then a length uniform within the bucket, capped at a quarter of the
pack), appended until the pack of S tokens is full; the last document is cut to fit. PACKS
packs per S (seeds 0..PACKS-1), the same packs for every G, contiguous layout (the default).
A second kind of pack is one document of S tokens. Columns (mean over packs): allgather MB; a2a
MB as mean / max over ranks; heads MB: the head-parallel exchange (q, k, v in and the outputs,
`layer_bytes` with the 32 query heads; the same on every rank and for every pack) and its ratio to
the all-gather; halo: the share of packs where it is valid (no needed document over more than two
ranks) and its max-rank MB over those packs (it moves the same rows as a2a); auto: what
`kv_exchange="auto"` picks (never heads).

Run: python benchmarks/kv_bytes_table.py [--packs 16] [--out bench_out]   (writes OUT/kv_bytes.md)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from pathlib import Path

import numpy as np

from hf_blockdiag_cp.planning import AttentionShape, choose_exchange, get_exchange, kv_row_bytes, plan_exchange
from hf_blockdiag_cp.bench.common import histogram_buckets
from hf_blockdiag_cp.bench.setups import HIST_CSV
from hf_blockdiag_cp.planning import document_ids_from_lengths, plan_layout

SEQ_LENS = {"128k": 131072, "512k": 524288, "1M": 1048576}
CP_SIZES = (2, 4, 8, 16)
ROW_BYTES = kv_row_bytes(kv_heads=8, head_dim_k=128, head_dim_v=128, bytes_per_element=2)
SHAPE = AttentionShape(heads=32, kv_heads=8, head_dim_k=128, head_dim_v=128, bytes_per_element=2)
MB = 1024 * 1024


def load_histogram(path: Path = HIST_CSV):
    """(low, high, probability) arrays of the length buckets."""
    buckets, counts = histogram_buckets(path)
    p = np.asarray(counts, dtype=float)
    return np.asarray([b[0] for b in buckets]), np.asarray([b[1] for b in buckets]), p / p.sum()


def sample_pack(seq_len: int, seed: int, histogram) -> list[int]:
    lows, highs, p = histogram
    rng = np.random.default_rng(seed)
    cap = seq_len // 4
    lengths, total = [], 0
    while total < seq_len:
        b = rng.choice(len(p), p=p)
        n = min(int(rng.integers(lows[b], highs[b] + 1)), cap, seq_len - total)
        lengths.append(n)
        total += n
    return lengths


def measure(lengths: list[int], cp_size: int) -> dict:
    layout = plan_layout(document_ids_from_lengths(lengths), cp_size)
    plan = plan_exchange(layout)
    a2a = [get_exchange("a2a").rows_per_layer(plan, r)[0] * ROW_BYTES for r in range(cp_size)]
    return {
        "allgather": get_exchange("allgather").rows_per_layer(plan, 0)[0] * ROW_BYTES,
        "a2a_mean": statistics.mean(a2a),
        "a2a_max": max(a2a),
        "heads": max(get_exchange("heads").layer_bytes(plan, r, SHAPE).forward for r in range(cp_size)),
        "halo_valid": get_exchange("halo").reason(plan) is None,
        "auto": choose_exchange("auto", plan),
    }


def table(packs: int) -> str:
    histogram = load_histogram()
    lines = [
        "| pack | S | G | docs/pack | allgather MB | a2a MB mean / max | a2a / allgather (max) | heads MB | heads / allgather "
        "| halo valid | halo MB max | auto picks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("real", "one doc"):
        for name, seq_len in SEQ_LENS.items():
            if kind == "real":
                pack_lengths = [sample_pack(seq_len, seed, histogram) for seed in range(packs)]
            else:
                pack_lengths = [[seq_len]]
            n = len(pack_lengths)
            docs = statistics.mean(len(p) for p in pack_lengths)
            for g in CP_SIZES:
                rows = [measure(p, g) for p in pack_lengths]
                ag = statistics.mean(r["allgather"] for r in rows)
                mean = statistics.mean(r["a2a_mean"] for r in rows)
                mx = statistics.mean(r["a2a_max"] for r in rows)
                heads = statistics.mean(r["heads"] for r in rows)
                halo = [r["a2a_max"] for r in rows if r["halo_valid"]]
                halo_mb = f"{statistics.mean(halo) / MB:.0f}" if halo else "—"
                picks = ", ".join(f"{k} {v}/{n}" for k, v in Counter(r["auto"] for r in rows).most_common())
                lines.append(
                    f"| {kind} | {name} | {g} | {docs:.0f} | {ag / MB:.0f} | {mean / MB:.0f} / {mx / MB:.0f} | {mx / ag:.2f} | "
                    f"{heads / MB:.0f} | {heads / ag:.2f} | {len(halo)}/{n} | {halo_mb} | {picks} |"
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--packs", type=int, default=16, help="packs sampled per sequence length")
    parser.add_argument("--out", default="bench_out", help="writes kv_bytes.md here")
    args = parser.parse_args()
    start = time.perf_counter()
    body = table(args.packs)
    header = (
        f"Per-layer bytes one rank receives in the forward (MB = 2^20 B), 32 query / 8 kv heads x dim 128, bf16 "
        f"({ROW_BYTES} B of K/V per token); real: {args.packs} packs per S from doc_length_distribution.csv; one doc: "
        "one document of S tokens; contiguous layout. "
        "Produced by `python benchmarks/kv_bytes_table.py`."
    )
    text = f"{header}\n\n{body}\n"
    print(text)
    print(f"(planning time {time.perf_counter() - start:.1f} s)")
    out = Path(args.out) / "kv_bytes.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    main()

"""`bench ranks`: how evenly a layout spreads attention work over G ranks, on one GPU.

For each CP size and layout strategy, every rank's local work (its queries against the
keys it needs, fwd+bwd, the exchange's output simulated by the full K/V in slot order) runs
in turn on the one GPU. The step time under CP is set by the slowest rank, so we report
max-rank time over the ideal (single-GPU time / G), next to the planner's predicted
per-rank work (allowed query-key pairs).
"""

from __future__ import annotations

import argparse

import torch

from ..planning import layout_strategies, plan_layout
from ..attention import local_attention
from ..step import CPStep, build_step
from .common import document_ids_for, environment, lognormal_lengths, markdown_table, time_cuda, write_json


def scenario_lengths(name: str, seq_len: int, seed: int) -> list[int]:
    if name == "lognormal4k":
        return lognormal_lengths(seq_len, mean=4096, seed=seed)
    if name == "one_doc":
        return [seq_len]
    if name == "half_doc_plus_short":
        return [seq_len // 2] + lognormal_lengths(seq_len - seq_len // 2, mean=512, seed=seed)
    raise ValueError(f"unknown scenario {name!r}")


def predicted_pairs(step: CPStep) -> int:
    """Allowed query-key pairs of one rank: per query run, q·(k−q) + q(q+1)/2 (bottom-right causal)."""
    rp = step.rank_plan
    q = (rp.cu_seqlens_q[1:] - rp.cu_seqlens_q[:-1]).long()
    k = (rp.cu_seqlens_k[1:] - rp.cu_seqlens_k[:-1]).long()
    return int((q * (k - q) + q * (q + 1) // 2).sum())


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    strategies = [s for s in args.strategies if s in layout_strategies()]
    rows = []
    for scenario in args.scenarios:
        lengths = scenario_lengths(scenario, args.seq_len, args.seed)
        doc_ids = document_ids_for(lengths)
        g = torch.Generator(device=device).manual_seed(args.seed)
        base = plan_layout(doc_ids, 1)
        s_pad = base.padded_seq_len

        def rand(h):
            return torch.randn(s_pad, h, args.head_dim, device=device, dtype=dtype, generator=g)

        q_all, k_all, v_all = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads)

        def rank_time(layout, rank: int):
            step = build_step(layout, rank, None, device, args.backend, "allgather")
            slots = layout.slot_positions.to(device)
            q = q_all[slots[rank]].detach().requires_grad_()
            k = k_all[slots.reshape(-1)].detach().requires_grad_()
            v = v_all[slots.reshape(-1)].detach().requires_grad_()

            def fwd_bwd():
                out = local_attention(step, q, k, v, scale=None, sliding_window=None)
                out.backward(torch.ones_like(out))

            return time_cuda(fwd_bwd, warmup=args.warmup, reps=args.reps).median_ms, predicted_pairs(step)

        single_ms, _ = rank_time(plan_layout(doc_ids, 1), 0)
        for cp_size in args.cp_sizes:
            for strategy in strategies:
                layout = plan_layout(doc_ids, cp_size, strategy)
                times, pairs = zip(*(rank_time(layout, r) for r in range(cp_size)))
                ideal = single_ms / cp_size
                rows.append({
                    "scenario": scenario, "G": cp_size, "strategy": strategy, "single_ms": single_ms,
                    "max_rank_ms": max(times), "ideal_ms": ideal, "max_over_ideal": max(times) / ideal,
                    "predicted_max_over_mean": max(pairs) / (sum(pairs) / cp_size),
                    "rank_ms": [round(t, 3) for t in times],
                })
                print(rows[-1], flush=True)
    return rows


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(2.2 * len(rows), 3), sharey=True, squeeze=False)
    for ax, r in zip(axes[0], rows):
        ax.bar(range(r["G"]), r["rank_ms"], color="tab:blue")
        ax.axhline(r["ideal_ms"], color="tab:red", linestyle="--", linewidth=1)
        ax.set_title(f"{r['scenario']}\nG={r['G']} {r['strategy']}", fontsize=6)
        ax.set_xlabel("rank", fontsize=6)
        ax.tick_params(labelsize=6)
    axes[0][0].set_ylabel("ms (fwd+bwd); dashed = ideal")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--strategies", nargs="+", default=["contiguous", "balanced"])
    p.add_argument("--scenarios", nargs="+", default=["lognormal4k", "one_doc", "half_doc_plus_short"])
    p.add_argument("--backend", default="varlen")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests of the script")
    p.add_argument("--out", default="bench_out")


def main(args) -> None:
    rows = run(args)
    table = markdown_table(rows, ["scenario", "G", "strategy", "single_ms", "max_rank_ms", "ideal_ms", "max_over_ideal",
                                  "predicted_max_over_mean"])
    print(table)
    write_json(f"{args.out}/ranks.json", {"env": environment(), "args": vars(args), "rows": rows})
    with open(f"{args.out}/ranks.md", "w") as f:
        f.write(table + "\n")
    plot(rows, f"{args.out}/ranks.png")

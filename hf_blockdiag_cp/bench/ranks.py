"""`bench ranks`: how evenly a layout spreads attention work over G ranks, on one GPU.

For each CP size and layout strategy, every rank's local work (its queries against the
keys it needs, fwd+bwd, on the key buffer `--exchange` hands the kernel: all G·L rows in slot
order for the all-gather, the needed rows for halo / a2a) runs on the one GPU, the ranks and
the single-GPU call taking turns (`time_queued`: calls queued back to back, as in a model).
The step time under CP is set by the slowest rank, so we report
max-rank time over the ideal (single-GPU time / G), next to the planner's predictions: per-rank
work (allowed query-key pairs) and cost (`KernelCost`: the kernel's calibrated constants, or
`--cost-file`). Every rank's features (runs, tiles, q/k tiles, pairs) are kept beside its ms.

`--calibrate` fits the KernelCost constants to those per-rank timings by least squares and writes
`<out>/kernel_cost_<kernel>.json` (docs/layouts.md, "Calibration").

`--overlaps queries keys` also runs every rank's attention split as `CPConfig(overlap=...)` splits
it (`attention.split_attention`: its local part on the rank's own rows, its remote part on the
exchange's rows, no exchange in between) and its local part alone: what the split costs in kernel
time against the plain call of the same run (`over_plain`), and how long the busiest rank's local
part runs (the time an exchange can hide under).
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import torch

from ..kernels import calibrated_cost, canonical_kernel_name
from ..planning import (
    DEFAULT_KERNEL_COST,
    KernelCost,
    exchange_names,
    get_exchange,
    layout_cost,
    layout_strategies,
    plan_exchange,
    plan_layout,
    rank_features,
)
from ..attention import local_attention, split_attention
from ..config import OVERLAP_SPLITS
from ..step import CPStep, build_step
from .common import document_ids_for, environment, lognormal_lengths, markdown_table, time_queued, write_json


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


def kernel_cost_for(args) -> KernelCost:
    """`--cost-file` (a kernel_cost_<kernel>.json or a bare KernelCost object), else the kernel's calibrated cost."""
    if args.cost_file:
        with open(args.cost_file) as f:
            values = json.load(f)
        return KernelCost.from_dict(values.get("cost", values))
    return calibrated_cost(canonical_kernel_name(args.backend)) or DEFAULT_KERNEL_COST


# rank feature -> the KernelCost field that weighs it (plus the constant per_call)
FEATURES = {"tiles": "per_tile", "runs": "per_run", "q_tiles": "per_q_tile", "k_tiles": "per_k_tile"}


def fit_kernel_cost(samples: list[dict], base: KernelCost) -> tuple[KernelCost, float, float]:
    """Least squares (relative error) of ms = c0 + sum_f c_f x_f over per-rank samples, coefficients >= 0
    (the best subset of features whose plain fit is non-negative). Returns the KernelCost in units of
    one tile (per_tile = 1, ms_per_tile = c_tiles), its max relative error, and the base's."""
    x = np.array([[1.0] + [s["features"][f] for f in FEATURES] for s in samples])
    ms = np.array([s["ms"] for s in samples])
    a, y = x / ms[:, None], np.ones(len(ms))
    best = None
    for n in range(1, 6):
        for cols in itertools.combinations(range(5), n):
            if 1 not in cols:  # tiles: the unit
                continue
            c, *_ = np.linalg.lstsq(a[:, cols], y, rcond=None)
            if (c < 0).any():
                continue
            err = float(np.abs(a[:, cols] @ c - 1).max())
            if best is None or err < best[0] - 1e-12:
                best = (err, cols, c)
    err, cols, c = best
    coef = np.zeros(5)
    coef[list(cols)] = c
    unit = coef[1]
    fitted = KernelCost(
        tile_q=base.tile_q, tile_k=base.tile_k, per_tile=1.0, per_run=float(coef[2] / unit),
        per_q_tile=float(coef[3] / unit), per_k_tile=float(coef[4] / unit), per_call=float(coef[0] / unit),
        ms_per_tile=float(unit), source="",
    )
    base_pred = np.array([base.ms_per_tile * (base.per_call + sum(getattr(base, field) * s["features"][f]
                                                                   for f, field in FEATURES.items())) for s in samples])
    return fitted, err, float(np.abs(base_pred / ms - 1).max())


def rank_call(args, device, rows: tuple, layout, rank: int, exchange_plan, overlap=False):
    """Rank `rank`'s fwd+bwd on the key buffer its exchange hands the kernel (all G·L rows in slot
    order for the all-gather, the needed rows in pack order otherwise), and its allowed pairs;
    with `overlap`, its split attention and, third, its local part alone (None without one).
    `rows`: q, k, v of every pack position."""
    q_all, k_all, v_all = rows
    step = build_step(layout, rank, None, device, args.backend, args.exchange, exchange_plan, overlap=overlap)
    keys = step.plan.row_positions  # the rows the exchange returns, in its order
    own = layout.slot_positions[rank].to(device)
    q = q_all[own].detach().requires_grad_()
    k, v = (t[keys].detach().requires_grad_() for t in (k_all, v_all))
    k_own, v_own = (t[own].detach().requires_grad_() for t in (k_all, v_all))

    def fwd_bwd():
        if step.overlap is None:
            out = local_attention(step, q, k, v, scale=None, sliding_window=None)
        else:
            out = split_attention(step, q, k_own, v_own, lambda local: (k, v, local), scale=None,
                                  sliding_window=None)
        out.backward(torch.ones_like(out))

    local_part = None if step.overlap is None else step.overlap.local

    def local_only():
        out = local_attention(step, local_part.take(q), k_own, v_own, scale=None, sliding_window=None,
                              part=local_part, return_lse=step.overlap.by_keys)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    return fwd_bwd, predicted_pairs(step), None if local_part is None else local_only


def run(args) -> list[dict]:
    device = torch.device(args.device)
    kernel_cost = kernel_cost_for(args)
    dtype = getattr(torch, args.dtype)
    strategies = [s for s in args.strategies if s in layout_strategies()]
    rows = []
    for scenario in args.scenarios:
        lengths = scenario_lengths(scenario, args.seq_len, args.seed)
        doc_ids = document_ids_for(lengths)
        g = torch.Generator(device=device).manual_seed(args.seed)
        # Rows for the longest padded pack of any CP size (a layout pads to a multiple of its G).
        s_pad = max(plan_layout(doc_ids, size).padded_seq_len for size in (1, *args.cp_sizes))

        def rand(h):
            return torch.randn(s_pad, h, args.head_dim, device=device, dtype=dtype, generator=g)

        rows_all = (rand(args.heads), rand(args.kv_heads), rand(args.kv_heads))  # q, k, v of every position
        single = plan_layout(doc_ids, 1)
        needs_plan = get_exchange(args.exchange).needs_plan
        single_fn, _, _ = rank_call(args, device, rows_all, single, 0, plan_exchange(single) if needs_plan else None)
        single_ms = None
        for cp_size in args.cp_sizes:
            for strategy in strategies:
                layout = plan_layout(doc_ids, cp_size, strategy, kernel_cost=kernel_cost)
                exchange_plan = plan_exchange(layout) if needs_plan else None
                calls, pairs, _ = zip(*(rank_call(args, device, rows_all, layout, r, exchange_plan) for r in range(cp_size)))
                # The single-GPU call takes turns with the ranks: clock drift hits numerator and denominator alike.
                fns = {"single": single_fn, **{r: fn for r, fn in enumerate(calls)}}
                for mode in args.overlaps:
                    split_calls = [rank_call(args, device, rows_all, layout, r, exchange_plan, mode) for r in range(cp_size)]
                    fns.update({(mode, r): fn for r, (fn, _, _) in enumerate(split_calls)})
                    fns.update({(mode, r, "local"): fn for r, (_, _, fn) in enumerate(split_calls) if fn is not None})
                for fn in fns.values():
                    fn()  # compile / warm
                timed = time_queued(fns, calls=args.calls, rounds=args.reps)
                times = [timed[r] for r in range(cp_size)]
                if single_ms is None:
                    single_ms = timed["single"]
                    rows.append({"scenario": scenario, "G": 1, "strategy": "single", "single_ms": single_ms,
                                 "rank_ms": [round(single_ms, 4)], "rank_features": rank_features(single, kernel_cost)})
                ideal = timed["single"] / cp_size
                predicted = layout_cost(layout, args.kv_heads, args.head_dim, args.head_dim, kernel_cost=kernel_cost)
                rows.append({
                    "scenario": scenario, "G": cp_size, "strategy": strategy, "exchange": args.exchange,
                    "single_ms": timed["single"], "max_rank_ms": max(times), "ideal_ms": ideal,
                    "max_over_ideal": max(times) / ideal,
                    # mean over ideal: what splitting costs every rank (not imbalance); max/mean is the imbalance
                    "mean_over_ideal": sum(times) / cp_size / ideal,
                    "predicted_max_over_mean": max(pairs) / (sum(pairs) / cp_size),
                    "predicted_cost_over_ideal": predicted.over_ideal,
                    "rank_ms": [round(t, 4) for t in times],
                    "rank_features": rank_features(layout, kernel_cost),
                })
                print(rows[-1], flush=True)
                rows += [split_row(rows[-1], mode, timed, cp_size) for mode in args.overlaps]
                del calls, fns
    return rows


def split_row(plain: dict, mode: str, timed: dict, cp_size: int) -> dict:
    """The row of one split mode next to its plain row (same layout, same run): the busiest rank's
    split time over the plain busiest rank's, and its local part's share of its split time."""
    times = [timed[(mode, r)] for r in range(cp_size)]
    local = [timed.get((mode, r, "local"), 0.0) for r in range(cp_size)]
    busiest = max(range(cp_size), key=times.__getitem__)
    row = {"scenario": plain["scenario"], "G": cp_size, "strategy": plain["strategy"], "exchange": plain["exchange"],
           "overlap": mode, "max_rank_ms": times[busiest], "ideal_ms": plain["ideal_ms"],
           "max_over_ideal": times[busiest] / plain["ideal_ms"], "over_plain": times[busiest] / plain["max_rank_ms"],
           "busiest_local_ms": local[busiest], "busiest_local_share": local[busiest] / times[busiest],
           "rank_ms": [round(t, 4) for t in times], "rank_local_ms": [round(t, 4) for t in local]}
    print(row, flush=True)
    return row


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
    p.add_argument("--reps", type=int, default=3, help="rate measurements per rank (median), the ranks taking turns")
    p.add_argument("--calls", type=int, default=4, help="calls queued back to back per rate measurement")
    p.add_argument("--exchange", default="allgather",
                   choices=[n for n in exchange_names() if not get_exchange(n).head_parallel],
                   help="the exchange whose key buffer each rank's kernel sees: allgather (all G·L rows) "
                        "or a needed-only one (halo, a2a: the rank's needed rows); head-parallel ones see the whole pack")
    p.add_argument("--overlaps", nargs="*", default=[], choices=OVERLAP_SPLITS,
                   help="also time every rank's attention split as CPConfig(overlap=...) splits it, and its local part")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests of the script")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--cost-file", default=None,
                   help="KernelCost JSON (e.g. a kernel_cost_<kernel>.json) for the balanced layout and the predictions; "
                        "default: the kernel's constants in hf_blockdiag_cp/kernels/calibration.json")
    p.add_argument("--calibrate-from", nargs="+", default=None, metavar="KERNEL_COST_JSON",
                   help="fit the constants to the pooled samples of earlier --calibrate runs (their kernel_cost_<kernel>.json) "
                        "and write <out>/kernel_cost_<kernel>.json; nothing runs on the GPU")
    p.add_argument("--calibrate", action="store_true",
                   help="also fit the KernelCost constants to every rank's ms and write <out>/kernel_cost_<kernel>.json")


def main(args) -> None:
    if args.calibrate_from:  # a fit of earlier runs' samples, pooled: no GPU needed
        samples, env = samples_from(args.calibrate_from, canonical_kernel_name(args.backend))
        calibrate(samples, args, env, f"-from ({len(args.calibrate_from)} runs pooled)")
        return
    rows = run(args)
    if args.calibrate:
        calibrate(rank_samples(rows), args)
    rows = [r for r in rows if r["strategy"] != "single"]
    table = markdown_table([r for r in rows if "overlap" not in r], [
        "scenario", "G", "strategy", "exchange", "single_ms", "max_rank_ms", "ideal_ms", "max_over_ideal",
        "mean_over_ideal", "predicted_max_over_mean", "predicted_cost_over_ideal"])
    if args.overlaps:
        table += "\n\n" + markdown_table([r for r in rows if "overlap" in r], [
            "scenario", "G", "strategy", "exchange", "overlap", "max_rank_ms", "max_over_ideal", "over_plain",
            "busiest_local_ms", "busiest_local_share"])
    print(table)
    write_json(f"{args.out}/ranks.json", {"env": environment(), "args": vars(args), "rows": rows})
    with open(f"{args.out}/ranks.md", "w") as f:
        f.write(table + "\n")
    plot([r for r in rows if "overlap" not in r], f"{args.out}/ranks.png")


def calibrate(samples: list[dict], args, env: dict | None = None, what: str = "") -> KernelCost:
    """Fit the KernelCost constants to every rank's time and write them with the fit quality. `env`: the
    machine the samples were timed on (default: this one); `source` names it, its versions and date."""
    kernel = canonical_kernel_name(args.backend)
    env = env or environment()
    base = kernel_cost_for(args)
    fitted, err, base_err = fit_kernel_cost(samples, base)
    fitted = KernelCost(**{**fitted.to_dict(), "source": f"bench ranks --calibrate{what}, {kernel}, {len(samples)} rank timings, "
                                                          f"max relative error {err:.3f}; {env.get('device', 'no GPU')}, "
                                                          f"torch {env.get('torch')}, {env.get('date', 'undated')}"})
    out = {"kernel": kernel, "cost": fitted.to_dict(), "max_relative_error": err,
           "previous_cost": base.to_dict(), "previous_max_relative_error": base_err,
           "features": ["per_call", *FEATURES.values()],
           "samples": samples, "env": env, "fitted_with": environment(), "args": vars(args)}
    write_json(f"{args.out}/kernel_cost_{kernel}.json", out)
    print(f"kernel cost for {kernel}: {fitted}\nmax relative error {err:.3f} (previous constants: {base_err:.3f})", flush=True)
    return fitted


def rank_samples(rows: list[dict]) -> list[dict]:
    """One calibration sample per rank timing: its ms and its features."""
    return [{"ms": ms, "features": f, "scenario": r["scenario"], "G": r["G"], "strategy": r["strategy"]}
            for r in rows if "overlap" not in r for ms, f in zip(r["rank_ms"], r["rank_features"])]


def samples_from(paths: list[str], kernel: str) -> tuple[list[dict], dict]:
    """The samples of earlier `--calibrate` runs (their kernel_cost_<kernel>.json files), pooled, and the
    environment of the first run (the machine they were timed on)."""
    samples, envs = [], []
    for path in paths:
        with open(path) as f:
            values = json.load(f)
        if values.get("kernel") != kernel:
            raise ValueError(f"--calibrate-from: {path} holds samples of kernel {values.get('kernel')!r}, not {kernel!r}")
        samples += values["samples"]
        envs.append(values.get("env") or {})
    return samples, envs[0]

#!/usr/bin/env python
"""Multi-GPU benchmark of block-diagonal CP: one process per GPU under torchrun, NCCL between them.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    torchrun --standalone --nproc-per-node G benchmarks/multigpu.py --out DIR [--parts attention,overlap,e2e]
    # CPU smoke run (gloo, tiny sizes):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py --device cpu --tiny --out DIR
    # one summary over several runs (no process group):
    python benchmarks/multigpu.py --summarize RUN_DIRS... --out DIR

Parts (docs/multigpu.md says what every column means; exactness is tested, tests/gpu/test_nccl_parity.py):
  attention  attention-only fwd / bwd (exchange + local kernel), time = max over ranks of per-rank CUDA-event
             times; FLOPs = block-causal area (bwd = 2.5x fwd); % of the 1/G ideal (rank 0 alone on the
             whole pack / G). Setups (hf_blockdiag_cp.bench.setups): "magi" and "ringflash".
  overlap    per layer: exchange alone, local attention alone (one kernel call), both as the model runs them
             (in order, and overlapped where the exchange can: column `overlap`, "queries" or "keys");
             exposed communication = total - attention alone.
  e2e        fwd+bwd of the 1.2B and an 8B-class Llama config on packed batches (multigpu_e2e.py).

Rank 0 writes DIR/multigpu_G{G}.json and .md after every part; every rank logs to DIR/raw/rank{r}.log.
Each part runs under try/except with an all-reduced failure flag, so one failing part does not hang the rest.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from hf_blockdiag_cp.attention import blockdiag_attention, local_attention
from hf_blockdiag_cp.bench import setups as bench_setups
from hf_blockdiag_cp.bench.common import causal_pairs, document_ids_for
from hf_blockdiag_cp.comm import exchange_kv
from hf_blockdiag_cp.config import OVERLAP_SPLITS
from hf_blockdiag_cp.kernels import get_kernel, unsupported_reason
from hf_blockdiag_cp.planning import choose_exchange, exchange_names, get_exchange, plan_exchange, plan_layout
from hf_blockdiag_cp.step import CPStep, build_step
from multigpu_e2e import e2e_child, part_e2e
from multigpu_lib import Ctx, environment, run_part, short_table, summarize, time_body, write_results

PARTS = ("attention", "overlap", "e2e")


# --------------------------------------------------------------------------- attention setups


def attention_setups(ctx: Ctx, args) -> list[dict]:
    return bench_setups.attention_setups(ctx.world, args.setups, args.tokens_per_rank, args.magi_packs, args.tiny)


def _dtype(ctx, args):
    return getattr(torch, args.dtype or ("bfloat16" if ctx.cuda else "float32"))


def _attn_kernels(ctx, args):
    return args.attn_kernels or (["varlen"] if ctx.cuda else ["dense"])


def make_step(ctx: Ctx, lengths, G: int, rank: int, group, kernel: str, exchange: str, layout: str,
              overlap: bool | str = False) -> CPStep:
    """The step of `rank` as the shard step builds it (the exchange as `exchange` resolves, the kernel's per-step
    preparation done, the attention split with `overlap`: `CPConfig.overlap`), without a batch."""
    lay = plan_layout(document_ids_for(lengths), G, layout)
    needs_plan = G > 1 and (exchange == "auto" or get_exchange(exchange).needs_plan)
    xplan = plan_exchange(lay) if needs_plan else None
    taken = choose_exchange(exchange, xplan) if G > 1 else "allgather"
    step = build_step(lay, rank, group, ctx.device, kernel, taken, xplan, overlap=overlap)
    prepare = get_kernel(kernel).prepare
    if prepare is not None:
        for target in step.kernel_targets:
            prepare(target)
    return step


def exchange_modes(args, kernel: str) -> list[tuple[str, bool | str]]:
    """(exchange, overlap) pairs to time: every `--exchanges` entry in order, then (unless `--no-overlap`)
    each one that can overlap attention (`CPConfig.overlap`) once more split by queries, and once
    more split by keys where `kernel` returns its log-sum-exp."""
    modes = [(x, False) for x in args.exchanges]
    if args.overlap:
        able = [x for x in args.exchanges if x != "auto" and get_exchange(x).begin is not None]
        splits = OVERLAP_SPLITS if get_kernel(kernel).returns_lse else ("queries",)
        modes += [(x, split) for split in splits for x in able]
    return modes


def qkv(ctx, step: CPStep, s: dict, dtype, seed: int):
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    L = step.local_len

    def rnd(*shape):
        return torch.randn(*shape, device=ctx.device, dtype=dtype, generator=g)

    q = rnd(1, s["heads"], L, s["head_dim"]).requires_grad_()
    k = rnd(1, s["kv_heads"], L, s["head_dim"]).requires_grad_()
    v = rnd(1, s["kv_heads"], L, s["head_dim"]).requires_grad_()
    dout = rnd(1, L, s["heads"], s["head_dim"])
    return q, k, v, dout


def fwd_bwd_body(step, q, k, v, dout):
    def body(mark):
        mark()
        out = blockdiag_attention(step, q, k, v, scale=None, sliding_window=None)
        mark()
        out.backward(dout)
        mark()
        q.grad = k.grad = v.grad = None

    return body


# --------------------------------------------------------------------------- attention scaling


def part_attention(ctx: Ctx, args) -> dict:
    """Every pack of the setups x kernel x exchange x layout (`_attention_row`), then one row per
    setup over all its packs (`_attention_totals`)."""
    G, dtype = ctx.world, _dtype(ctx, args)
    deadline = time.time() + args.attention_budget_s
    rows = []
    for s in attention_setups(ctx, args):
        for kernel in _attn_kernels(ctx, args):
            reason = unsupported_reason(kernel, ctx.device, dtype, s["head_dim"], s["head_dim"])
            if reason:
                rows.append({**_srow(s), "kernel": kernel, "note": reason})
                continue
            single = _single_ideal(ctx, args, s, kernel, dtype)
            for exchange, overlap in exchange_modes(args, kernel):
                for layout in args.layouts:
                    if ctx.out_of_time(deadline):
                        rows.append({**_srow(s), "kernel": kernel, "exchange": exchange, "overlap": overlap,
                                     "layout": layout, "note": "skipped: attention time budget"})
                        continue
                    rows.append(_attention_row(ctx, args, s, kernel, exchange, layout, dtype, single, overlap))
                    ctx.save_partial(rows, ATTENTION_COLUMNS)
                    ctx.log("attention", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
                    if ctx.cuda:
                        torch.cuda.empty_cache()
    rows += _attention_totals(rows, G)
    return {"rows": rows, "columns": ATTENTION_COLUMNS}


def _timing(args) -> tuple[int, int]:
    return (2, 1) if args.tiny else (args.reps, args.warmup)


def _single_ideal(ctx: Ctx, args, s: dict, kernel: str, dtype) -> list[float]:
    """Rank 0 alone on the whole pack (fwd ms, bwd ms), the same on every rank; zeros without it."""
    single = [0.0, 0.0]
    if ctx.rank == 0 and ctx.world > 1 and not args.no_single:
        try:
            step1 = make_step(ctx, s["lengths"], 1, 0, None, kernel, "allgather", "contiguous")
            single = time_body(ctx, fwd_bwd_body(step1, *qkv(ctx, step1, s, dtype, 0)), *_timing(args), collective=False)
            del step1
        except Exception as exc:  # noqa: BLE001 - OOM at G = 1 is expected for big packs; peers wait below
            ctx.log(f"single-GPU ideal failed for {s['setup']}/{s['pack']}/{kernel}: {type(exc).__name__}: {exc}")
            single = [float("nan")] * 2
        if ctx.cuda:
            torch.cuda.empty_cache()
    return ctx.reduce(single, "sum")  # only rank 0 contributes


def _attention_row(ctx: Ctx, args, s: dict, kernel: str, exchange: str, layout: str, dtype, single, overlap=False) -> dict:
    """Forward and backward of exchange + local kernel, max over ranks; TFLOP/s per GPU and % of the 1/G ideal."""
    G = ctx.world
    step = make_step(ctx, s["lengths"], G, ctx.rank, ctx.group, kernel, exchange, layout, overlap)
    fwd, bwd = time_body(ctx, fwd_bwd_body(step, *qkv(ctx, step, s, dtype, 1 + ctx.rank)), *_timing(args))
    per_gpu = 4.0 * s["heads"] * s["head_dim"] * causal_pairs(s["lengths"]) / G
    row = {**_srow(s), "kernel": kernel, "exchange": exchange, "exchange_taken": step.kv_exchange, "overlap": overlap,
           "layout": layout, "fwd_ms": fwd, "bwd_ms": bwd,
           "fwd_tflops_gpu": per_gpu / (fwd * 1e-3) / 1e12, "bwd_tflops_gpu": 2.5 * per_gpu / (bwd * 1e-3) / 1e12,
           "fwdbwd_tflops_gpu": 3.5 * per_gpu / ((fwd + bwd) * 1e-3) / 1e12}
    if G > 1 and single[0] > 0:
        row.update(single_fwd_ms=single[0], single_bwd_ms=single[1],
                   fwd_pct_ideal=100 * single[0] / G / fwd, bwd_pct_ideal=100 * single[1] / G / bwd,
                   fwdbwd_pct_ideal=100 * (single[0] + single[1]) / G / (fwd + bwd))
    return row


ATTENTION_COLUMNS = ["setup", "pack", "docs", "tokens", "heads", "kernel", "exchange", "exchange_taken", "overlap", "layout", "fwd_ms",
                     "bwd_ms", "fwd_tflops_gpu", "bwd_tflops_gpu", "fwdbwd_tflops_gpu", "fwd_pct_ideal", "bwd_pct_ideal",
                     "fwdbwd_pct_ideal", "note"]


def _srow(s):
    return {"setup": s["setup"], "pack": s["pack"], "docs": len(s["lengths"]), "tokens": sum(s["lengths"]),
            "heads": f"{s['heads']}/{s['kv_heads']}x{s['head_dim']}", "_pairs": causal_pairs(s["lengths"]),
            "_hd": s["heads"] * s["head_dim"]}


def _attention_totals(rows, G):
    """One row per (setup, kernel, exchange, overlap, layout) over all its packs: summed FLOPs over summed times."""
    out, groups = [], {}
    for r in rows:
        if "fwd_ms" in r:
            groups.setdefault((r["setup"], r["kernel"], r["exchange"], r.get("overlap", False), r["layout"]), []).append(r)
    for (setup, kernel, exchange, overlap, layout), rs in groups.items():
        if len(rs) < 2:
            continue
        flops = sum(4.0 * r["_hd"] * r["_pairs"] for r in rs) / G
        fwd, bwd = sum(r["fwd_ms"] for r in rs), sum(r["bwd_ms"] for r in rs)
        row = {"setup": setup, "pack": "ALL", "docs": sum(r["docs"] for r in rs), "tokens": sum(r["tokens"] for r in rs),
               "kernel": kernel, "exchange": exchange, "overlap": overlap, "layout": layout, "fwd_ms": fwd, "bwd_ms": bwd,
               "fwd_tflops_gpu": flops / (fwd * 1e-3) / 1e12, "bwd_tflops_gpu": 2.5 * flops / (bwd * 1e-3) / 1e12,
               "fwdbwd_tflops_gpu": 3.5 * flops / ((fwd + bwd) * 1e-3) / 1e12}
        if all("single_fwd_ms" in r for r in rs):
            sf, sb = sum(r["single_fwd_ms"] for r in rs), sum(r["single_bwd_ms"] for r in rs)
            row.update(fwd_pct_ideal=100 * sf / G / fwd, bwd_pct_ideal=100 * sb / G / bwd,
                       fwdbwd_pct_ideal=100 * (sf + sb) / G / (fwd + bwd))
        out.append(row)
    return out


# --------------------------------------------------------------------------- overlap


OVERLAP_COLUMNS = ["setup", "pack", "kernel", "exchange", "exchange_taken", "overlap", "layout", "comm_fwd_ms", "attn_fwd_ms",
                   "total_fwd_ms", "exposed_fwd_ms", "comm_bwd_ms", "attn_bwd_ms", "total_bwd_ms", "exposed_bwd_ms",
                   "exposed_pct_of_attn", "exposed_pct_of_total", "note"]


def part_overlap(ctx: Ctx, args) -> dict:
    """One pack of each setup (magi/hist0, ringflash/cu3) x kernel x exchange x layout: `_overlap_row`."""
    dtype = _dtype(ctx, args)
    deadline = time.time() + args.overlap_budget_s
    rows = []
    for s in [s for s in attention_setups(ctx, args) if s["pack"] in ("hist0", "cu3")]:
        for kernel in _attn_kernels(ctx, args):
            if unsupported_reason(kernel, ctx.device, dtype, s["head_dim"], s["head_dim"]):
                continue
            for exchange, overlap in exchange_modes(args, kernel):
                for layout in args.layouts:
                    if ctx.out_of_time(deadline):
                        rows.append({**_srow(s), "kernel": kernel, "exchange": exchange, "overlap": overlap,
                                     "layout": layout, "note": "skipped: overlap time budget"})
                        continue
                    rows.append(_overlap_row(ctx, args, s, kernel, exchange, layout, dtype, overlap))
                    ctx.log("overlap", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
                    if ctx.cuda:
                        torch.cuda.empty_cache()
    return {"rows": rows, "columns": OVERLAP_COLUMNS}


def _overlap_row(ctx: Ctx, args, s: dict, kernel: str, exchange: str, layout: str, dtype, overlap=False) -> dict:
    """Per layer, max over ranks: the exchange alone, the local attention alone on already exchanged
    K/V (one kernel call), and both as the model runs them (with `overlap`: what the rank holds
    attended during the exchange); exposed communication = total - attention alone."""
    G = ctx.world
    reps, warmup = _timing(args)
    step = make_step(ctx, s["lengths"], G, ctx.rank, ctx.group, kernel, exchange, layout)
    model_step = make_step(ctx, s["lengths"], G, ctx.rank, ctx.group, kernel, exchange, layout, overlap) if overlap else step
    q, k, v, dout = qkv(ctx, step, s, dtype, 1 + ctx.rank)
    kt, vt = k[0].transpose(0, 1), v[0].transpose(0, 1)

    def comm(mark):
        mark()
        ek, ev = exchange_kv(step.kv_exchange, kt, vt, step.group, G, routes=step.kv_routes)
        mark()
        torch.autograd.backward([ek, ev], [torch.ones_like(ek), torch.ones_like(ev)])
        mark()
        k.grad = v.grad = None

    with torch.no_grad():
        ek, ev = exchange_kv(step.kv_exchange, kt, vt, step.group, G, routes=step.kv_routes)
    ek, ev = ek.clone().requires_grad_(), ev.clone().requires_grad_()
    ql = q[0].transpose(0, 1)

    def attn(mark):
        mark()
        out = local_attention(step, ql, ek, ev, scale=None, sliding_window=None)
        mark()
        out.backward(dout[0])
        mark()
        q.grad = ek.grad = ev.grad = None

    c = time_body(ctx, comm, reps, warmup)
    a = time_body(ctx, attn, reps, warmup)
    t = time_body(ctx, fwd_bwd_body(model_step, q, k, v, dout), reps, warmup)
    exposed = (t[0] + t[1]) - (a[0] + a[1])
    return {**_srow(s), "kernel": kernel, "exchange": exchange, "exchange_taken": step.kv_exchange, "overlap": overlap,
            "layout": layout,
            "comm_fwd_ms": c[0], "comm_bwd_ms": c[1], "attn_fwd_ms": a[0], "attn_bwd_ms": a[1],
            "total_fwd_ms": t[0], "total_bwd_ms": t[1], "exposed_fwd_ms": t[0] - a[0], "exposed_bwd_ms": t[1] - a[1],
            "exposed_pct_of_attn": 100 * exposed / (a[0] + a[1]), "exposed_pct_of_total": 100 * exposed / (t[0] + t[1])}


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="attention,overlap,e2e")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--dtype", default=None, help="attention/overlap dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--attn-kernels", type=lambda s: s.split(","), default=None, help="attention/overlap kernels (default varlen on CUDA)")
    p.add_argument("--exchanges", type=lambda s: s.split(","),
                   default=[n for n in exchange_names() if not get_exchange(n).head_parallel],
                   help="exchanges to time (default: every registered K/V exchange; a head-parallel one such as "
                        "heads times in the attention part only)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="attention and overlap parts: skip the rows that run an exchange overlapped with attention")
    p.add_argument("--e2e-overlap", nargs="?", const="queries", default=False, choices=OVERLAP_SPLITS,
                   help="e2e: CPConfig(overlap=...), split by queries (a bare --e2e-overlap) or by keys")
    p.add_argument("--layouts", type=lambda s: s.split(","), default=["contiguous", "balanced"])
    p.add_argument("--setups", type=lambda s: s.split(","), default=["magi", "ringflash"])
    p.add_argument("--tokens-per-rank", type=int, default=8192)
    p.add_argument("--magi-packs", type=int, default=3)
    p.add_argument("--no-single", action="store_true", help="skip the single-GPU ideal measurement")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--attention-budget-s", type=float, default=300)
    p.add_argument("--overlap-budget-s", type=float, default=150)
    p.add_argument("--e2e-models", type=lambda s: s.split(","), default=["1.2b", "8b"])
    p.add_argument("--e2e-tokens", type=int, nargs="+", default=None,
                   help="e2e pack sizes (default 65536 131072 262144 524288 1048576; with --tiny 256 512 1024)")
    p.add_argument("--e2e-max-tokens", type=int, default=0, help="keep doubling past the list up to this size (until OOM)")
    p.add_argument("--e2e-single", action="store_true", help="also run G = 1 on rank 0's GPU for the per-GPU comparison")
    p.add_argument("--e2e-single-tokens", type=int, nargs="*", default=None, help="G = 1 pack sizes (default: --e2e-tokens)")
    p.add_argument("--e2e-budget-s", type=float, default=480)
    p.add_argument("--e2e-child-timeout-s", type=float, default=300)
    p.add_argument("--steps", type=int, default=2, help="e2e measured steps after one warm-up step")
    p.add_argument("--e2e-kernel", default="auto", help="e2e attention kernel (CPConfig.attn_backend)")
    p.add_argument("--e2e-layout", default="contiguous", help="e2e layout strategy")
    p.add_argument("--e2e-fused-ce", action="store_true", help="e2e loss: Liger's fused linear cross-entropy")
    p.add_argument("--e2e-grad-sync", choices=["allreduce", "ddp"], default="allreduce",
                   help="e2e gradient sync over the CP group at G > 1: one all-reduce per parameter after backward "
                        "(exposed; what the scaling model's T_ar models) or DDP (bucketed, overlapped with backward)")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--timeout-s", type=float, default=300, help="process-group timeout (NCCL watchdog)")
    p.add_argument("--e2e-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--summarize", nargs="+", default=None, metavar="PATH",
                   help="no run: combine the multigpu_G*.json under these paths into DIR/scaling.md and scaling.png")
    args = p.parse_args(argv)
    if args.tiny and args.magi_packs == 3:
        args.magi_packs = 1
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.e2e_child:
        e2e_child(args)
        return
    if args.summarize:
        print(summarize(args.summarize, args.out))
        return
    parts = [x for x in args.parts.split(",") if x]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; choose from {', '.join(PARTS)}")
    ctx = Ctx(args)
    results = {"env": environment(ctx), "args": vars(args), "parts": {}}
    ctx.log("env", results["env"])
    fns = {"attention": part_attention, "overlap": part_overlap, "e2e": part_e2e}
    for name in parts:
        run_part(ctx, name, fns[name], results)
        write_results(ctx, results)
    if ctx.rank == 0:
        print(write_results(ctx, results))
        print("\n" + short_table(results), flush=True)
    ctx.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

#!/usr/bin/env python
"""Multi-GPU validation and scaling of block-diagonal CP, one script, one process per rank.

    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
    torchrun --standalone --nproc-per-node G benchmarks/multigpu.py --out DIR [--parts parity,attention,e2e,overlap]
    # CPU smoke run (gloo, tiny sizes):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/multigpu.py --device cpu --tiny --out DIR

Parts (see docs/multigpu.md for what every column means):
  parity     loss and gradients of a tiny Llama model under CP (every kernel x exchange x layout the device
             has, activation checkpointing) vs the stock eager model run on each document alone; bf16 on CUDA
             (error <= 1.5x the stock bf16 model's, loss <= 1e-2), fp32 on CPU (<= 1e-4).
  attention  attention-only fwd / bwd (exchange + local kernel), time = max over ranks of per-rank CUDA-event
             times; FLOPs = block-causal area (bwd = 2.5x fwd); % of the 1/G ideal (rank 0 alone on the
             whole pack / G). Setups: "magi" (8K tokens/GPU, 64/8 heads, histogram lengths capped at S/4) and
             "ringflash" (ring-flash-attn's varlen benchmark: 8192 tokens/rank, 32/8 heads, its 4 packs).
  e2e        fwd+bwd of the 1.2B and an 8B-class Llama config on packed batches, tokens/s per GPU, peak memory,
             largest pack that trains (doubling until OOM). Each (model, size) runs in a child process group so
             an OOM on one rank cannot leave the others inside a collective; the OOM flag is all-reduced.
  overlap    per layer: exchange alone, local attention alone (one kernel call), both pipelined in each of
             --overlap-chunks KV-head groups; exposed communication = total - attention alone, in % of attention.

Rank 0 writes DIR/multigpu_G{G}.json and .md after every part; every rank logs to DIR/raw/rank{r}.log.
Each part runs under try/except with an all-reduced failure flag, so one failing part does not hang the rest.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.bench.common import causal_pairs, document_ids_for, histogram_lengths, markdown_table
from hf_blockdiag_cp.bench import setups as bench_setups
from hf_blockdiag_cp.bench.setups import E2E_CONFIGS, HIST_CSV
from hf_blockdiag_cp.bench.reference import (
    build_models,
    make_docs,
    make_pack,
    mean_over_group,
    reference_loss_and_grads,
    rel_err,
)
from hf_blockdiag_cp.comm import exchange_kv
from hf_blockdiag_cp.planning import choose_exchange, plan_exchange
from hf_blockdiag_cp.kernels import unsupported_reason
from hf_blockdiag_cp.planning import plan_layout
from hf_blockdiag_cp.attention import blockdiag_attention, local_attention
from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy, fused_cross_entropy_unavailable
from hf_blockdiag_cp.kernels import choose_kernel
from hf_blockdiag_cp.step import CPStep, build_step

PARTS = ("parity", "attention", "e2e", "overlap")
PARITY_MODEL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


# --------------------------------------------------------------------------- process context


class Ctx:
    def __init__(self, args):
        self.args = args
        self.cuda = args.device == "cuda"
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if self.cuda:
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        backend = "nccl" if self.cuda else "gloo"
        timeout = datetime.timedelta(seconds=args.timeout_s)
        kw = {"device_id": self.device} if self.cuda else {}
        dist.init_process_group(backend, timeout=timeout, **kw)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.group = dist.group.WORLD
        self.out = Path(args.out)
        (self.out / "raw").mkdir(parents=True, exist_ok=True)
        self.logf = open(self.out / "raw" / f"rank{self.rank}.log", "a")
        self.start = self.part_start = time.time()
        self.current = None  # (part name, results) while a part runs

    def save_partial(self, rows: list, columns: list) -> None:
        """Rank 0 rewrites the outputs with the rows so far, so a run killed mid-part keeps them."""
        if self.rank == 0 and self.current is not None:
            name, results = self.current
            results["parts"][name] = {"ok": None, "error": "incomplete (run still in progress or killed)",
                                      "seconds": round(time.time() - self.part_start, 1), "rows": list(rows), "columns": columns}
            write_results(self, results)

    def log(self, *parts, all_ranks=False):
        msg = " ".join(str(p) for p in parts)
        stamp = f"[{time.time() - self.start:7.1f}s r{self.rank}] "
        self.logf.write(stamp + msg + "\n")
        self.logf.flush()
        if self.rank == 0 or all_ranks:
            print(stamp + msg, flush=True)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def reduce(self, values, op="max") -> list[float]:
        """All-reduce a list of floats (MAX or SUM); every rank gets the same answer."""
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        return bool(self.reduce([1.0 if flag else 0.0])[0])

    def barrier(self):
        self.sync()
        self.reduce([0.0])
        self.sync()

    def out_of_time(self, deadline: float) -> bool:
        return self.any(time.time() > deadline)


class Marks:
    """Time points on the compute stream (CUDA events) or the host clock (CPU)."""

    def __init__(self, cuda: bool):
        self.cuda, self.points = cuda, []

    def __call__(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.points.append(e)
        else:
            self.points.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.points, self.points[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.points, self.points[1:])]


def time_body(ctx: Ctx, body, reps: int, warmup: int, collective: bool = True) -> list[float]:
    """Median per-interval times of `body(mark)`; with `collective`, ranks start each rep together and the
    result is the MAX over ranks (the step waits for the slowest rank)."""
    samples = []
    for i in range(warmup + reps):
        if collective:
            ctx.barrier()
        else:
            ctx.sync()
        marks = Marks(ctx.cuda)
        body(marks)
        ms = marks.intervals_ms()
        if i >= warmup:
            samples.append(ms)
    med = [statistics.median(col) for col in zip(*samples)]
    return ctx.reduce(med) if collective else med


def run_part(ctx: Ctx, name: str, fn, results: dict):
    ctx.log(f"== part {name}")
    t0 = ctx.part_start = time.time()
    ctx.current = (name, results)
    error = None
    try:
        out = fn(ctx, ctx.args)
    except Exception as exc:  # noqa: BLE001 - one part's failure must not stop the others
        error = f"{type(exc).__name__}: {exc}"
        ctx.log(f"part {name} failed: {error}\n{traceback.format_exc()}", all_ranks=True)
        out = None
    failed = ctx.any(error is not None)  # if this hangs, a peer is stuck inside a collective of this part
    results["parts"][name] = {
        "ok": not failed, "error": error or ("failed on another rank" if failed else None),
        "seconds": round(time.time() - t0, 1), **(out or {}),
    }
    ctx.current = None
    if ctx.cuda:
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- part 1: parity


def _parity_packs(G: int, args) -> list[tuple[str, list, dict]]:
    packs = []
    for name in ("straddle", "padding_rank", "span_all"):
        docs, batch = make_pack(name, G)
        packs.append((name, docs, batch))
    if not args.tiny:
        lengths = histogram_lengths(HIST_CSV, args.parity_tokens_per_rank * G, seed=3)
        docs = make_docs(lengths, seed=3)
        ids = torch.cat(docs)[None]
        packs.append((f"histogram_{len(lengths)}docs", docs, {
            "input_ids": ids, "labels": ids.clone(),
            "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        }))
    return packs


PARITY_COLUMNS = ["pack", "kernel", "exchange", "layout", "exchange_taken", "dtype", "padding_ranks", "loss_err", "grad_err",
                  "grad_err_max_param", "stock_grad_err", "status", "note"]


def part_parity(ctx: Ctx, args) -> dict:
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype = getattr(torch, args.parity_dtype or ("bfloat16" if ctx.cuda else "float32"))
    kernels = args.kernels or (["varlen", "dense", "flex"] if ctx.cuda else ["dense"])  # flex compiles: last
    deadline = time.time() + args.parity_budget_s
    G, dev = ctx.world, ctx.device
    rows = []

    def flat(grads, names):
        return torch.cat([grads[n].float().reshape(-1).cpu() for n in names])

    for pack_name, docs, batch in _parity_packs(G, args):
        ref32, model = build_models("llama", **PARITY_MODEL)
        ref32 = ref32.to(dev)
        docs_dev = [d.to(dev) for d in docs]
        loss32, grads32 = reference_loss_and_grads(ref32, docs_dev)  # every rank, the full pack, one doc at a time
        names = list(grads32)
        stock = None
        if dtype != torch.float32:
            stock16 = copy.deepcopy(ref32).to(dtype)
            loss_s, grads_s = reference_loss_and_grads(stock16, docs_dev)
            stock = (rel_err(flat(grads_s, names), flat(grads32, names)), rel_err(loss_s.float().cpu(), loss32.cpu()))
            del stock16
        model = model.to(dev, dtype)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        batch_dev = {k: v.to(dev) for k, v in batch.items()}
        for kernel in kernels:
            for exchange in args.exchanges:
                for layout in args.layouts:
                    row = {"pack": pack_name, "kernel": kernel, "exchange": exchange, "layout": layout,
                           "dtype": str(dtype).replace("torch.", ""), "G": G}
                    reason = unsupported_reason(kernel, dev, dtype, PARITY_MODEL["head_dim"], PARITY_MODEL["head_dim"])
                    if reason is None and ctx.out_of_time(deadline):
                        reason = "skipped: parity time budget"
                    if reason is not None:  # same on every rank: skipped symmetrically
                        row.update(status="skip", note=reason)
                        rows.append(row)
                        continue
                    err = None
                    try:
                        model.zero_grad(set_to_none=True)
                        train_ctx, local, lay = bdcp.make_cp_blockdiag_batch_and_ctx(
                            ctx.group, None, batch_dev, config=bdcp.CPConfig(kernel, exchange, layout=layout)
                        )
                        with train_ctx() as step:
                            loss = model(**local).loss
                            loss.backward()
                        real = lay.real_tokens_per_rank()
                        loss_m = mean_over_group(loss, ctx.group, G)
                        grads = {n: mean_over_group(p.grad if p.grad is not None else torch.zeros_like(p), ctx.group, G)
                                 for n, p in model.named_parameters()}
                        grad_err = rel_err(flat(grads, names), flat(grads32, names))
                        grad_err_max = max(rel_err(grads[n].cpu(), grads32[n].cpu()) for n in names)
                        loss_err = rel_err(loss_m.cpu(), loss32.cpu())
                        row.update(exchange_taken=step.kv_exchange, loss_err=loss_err, grad_err=grad_err,
                                   grad_err_max_param=grad_err_max,
                                   padding_ranks=sum(1 for r in (real or []) if r == 0),
                                   exchange_mb=step.exchange_bytes.total_bytes / 2**20)
                        if stock is None:
                            ok = loss_err <= args.fp32_tol and grad_err_max <= args.fp32_tol
                            row["criterion"] = f"loss, every grad <= {args.fp32_tol:g}"
                        else:
                            row.update(stock_grad_err=stock[0], stock_loss_err=stock[1])
                            ok = grad_err <= 1.5 * stock[0] and loss_err <= 1e-2
                            row["criterion"] = "grad <= 1.5x stock bf16, loss <= 1e-2"
                        row["status"] = "pass" if ok else "FAIL"
                    except Exception as exc:  # noqa: BLE001
                        err = f"{type(exc).__name__}: {exc}"
                        ctx.log("parity", row, err, traceback.format_exc(), all_ranks=True)
                    if ctx.any(err is not None):
                        row.update(status="ERROR", note=err or "failed on another rank")
                    elif ctx.any(row.get("status") != "pass"):  # the reduced numbers agree; belt and braces
                        row["status"] = "FAIL"
                    rows.append(row)
                    ctx.save_partial(rows, PARITY_COLUMNS)
                    ctx.log("parity", {k: row.get(k) for k in ("pack", "kernel", "exchange", "layout", "status", "grad_err", "loss_err")})
        del model, ref32
    cols = PARITY_COLUMNS
    n_pass = sum(r.get("status") == "pass" for r in rows)
    n_fail = sum(r.get("status") in ("FAIL", "ERROR") for r in rows)
    return {"rows": rows, "columns": cols, "summary": f"{n_pass} pass, {n_fail} fail/error, "
            f"{sum(r.get('status') == 'skip' for r in rows)} skipped"}


# --------------------------------------------------------------------------- attention setups


def attention_setups(ctx: Ctx, args) -> list[dict]:
    return bench_setups.attention_setups(ctx.world, args.setups, args.tokens_per_rank, args.magi_packs, args.tiny)


def _dtype(ctx, args):
    return getattr(torch, args.dtype or ("bfloat16" if ctx.cuda else "float32"))


def _attn_kernels(ctx, args):
    return args.attn_kernels or (["varlen"] if ctx.cuda else ["dense"])


def make_step(ctx: Ctx, lengths, G: int, rank: int, group, kernel: str, exchange: str, layout: str, kv_chunks: int = 1) -> CPStep:
    lay = plan_layout(document_ids_for(lengths), G, layout)
    xplan = plan_exchange(lay) if (G > 1 and exchange != "allgather") else None
    taken = choose_exchange(exchange, xplan) if xplan is not None else "allgather"
    step = build_step(lay, rank, group, ctx.device, kernel, taken, xplan, kv_chunks)
    if kernel == "flex" and ctx.cuda:
        from hf_blockdiag_cp.kernels.flex import block_mask

        block_mask(step, None)
    return step


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


# --------------------------------------------------------------------------- part 2: attention scaling


def part_attention(ctx: Ctx, args) -> dict:
    G, dtype = ctx.world, _dtype(ctx, args)
    deadline = time.time() + args.attention_budget_s
    reps, warmup = (2, 1) if args.tiny else (args.reps, args.warmup)
    rows, single_cache = [], {}
    for s in attention_setups(ctx, args):
        fwd_flops = 4.0 * s["heads"] * s["head_dim"] * causal_pairs(s["lengths"])
        for kernel in _attn_kernels(ctx, args):
            reason = unsupported_reason(kernel, ctx.device, dtype, s["head_dim"], s["head_dim"])
            if reason:
                rows.append({**_srow(s), "kernel": kernel, "note": reason})
                continue
            key = (s["setup"], s["pack"], kernel)
            if key not in single_cache:  # the 1/G ideal: rank 0 alone runs the whole pack
                single = [0.0, 0.0]
                if ctx.rank == 0 and G > 1 and not args.no_single:
                    try:
                        step1 = make_step(ctx, s["lengths"], 1, 0, None, kernel, "allgather", "contiguous")
                        single = time_body(ctx, fwd_bwd_body(step1, *qkv(ctx, step1, s, dtype, 0)), reps, warmup, collective=False)
                        del step1
                    except Exception as exc:  # noqa: BLE001 - OOM at G = 1 is expected for big packs; peers wait below
                        ctx.log(f"single-GPU ideal failed for {key}: {type(exc).__name__}: {exc}")
                        single = [float("nan")] * 2
                    if ctx.cuda:
                        torch.cuda.empty_cache()
                single_cache[key] = ctx.reduce(single, "sum")  # only rank 0 contributes
            single = single_cache[key]
            for exchange in args.exchanges:
                for layout in args.layouts:
                    if ctx.out_of_time(deadline):
                        rows.append({**_srow(s), "kernel": kernel, "exchange": exchange, "layout": layout,
                                     "note": "skipped: attention time budget"})
                        continue
                    step = make_step(ctx, s["lengths"], G, ctx.rank, ctx.group, kernel, exchange, layout, args.kv_chunks)
                    fwd, bwd = time_body(ctx, fwd_bwd_body(step, *qkv(ctx, step, s, dtype, 1 + ctx.rank)), reps, warmup)
                    per_gpu = fwd_flops / G
                    row = {**_srow(s), "kernel": kernel, "exchange": exchange, "exchange_taken": step.kv_exchange,
                           "layout": layout, "kv_chunks": args.kv_chunks, "fwd_ms": fwd, "bwd_ms": bwd,
                           "fwd_tflops_gpu": per_gpu / (fwd * 1e-3) / 1e12, "bwd_tflops_gpu": 2.5 * per_gpu / (bwd * 1e-3) / 1e12,
                           "fwdbwd_tflops_gpu": 3.5 * per_gpu / ((fwd + bwd) * 1e-3) / 1e12}
                    if G > 1 and single[0] > 0:
                        row.update(single_fwd_ms=single[0], single_bwd_ms=single[1],
                                   fwd_pct_ideal=100 * single[0] / G / fwd, bwd_pct_ideal=100 * single[1] / G / bwd,
                                   fwdbwd_pct_ideal=100 * (single[0] + single[1]) / G / (fwd + bwd))
                    rows.append(row)
                    ctx.save_partial(rows, ATTENTION_COLUMNS)
                    ctx.log("attention", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})
                    del step
                    if ctx.cuda:
                        torch.cuda.empty_cache()
    rows += _attention_totals(rows, G)
    return {"rows": rows, "columns": ATTENTION_COLUMNS}


ATTENTION_COLUMNS = ["setup", "pack", "docs", "tokens", "heads", "kernel", "exchange", "exchange_taken", "layout", "kv_chunks", "fwd_ms",
                     "bwd_ms", "fwd_tflops_gpu", "bwd_tflops_gpu", "fwdbwd_tflops_gpu", "fwd_pct_ideal", "bwd_pct_ideal",
                     "fwdbwd_pct_ideal", "note"]


def _srow(s):
    return {"setup": s["setup"], "pack": s["pack"], "docs": len(s["lengths"]), "tokens": sum(s["lengths"]),
            "heads": f"{s['heads']}/{s['kv_heads']}x{s['head_dim']}", "_pairs": causal_pairs(s["lengths"]),
            "_hd": s["heads"] * s["head_dim"]}


def _attention_totals(rows, G):
    """One row per (setup, kernel, exchange, layout) over all its packs: summed FLOPs over summed times."""
    out, groups = [], {}
    for r in rows:
        if "fwd_ms" in r:
            groups.setdefault((r["setup"], r["kernel"], r["exchange"], r["layout"]), []).append(r)
    for (setup, kernel, exchange, layout), rs in groups.items():
        if len(rs) < 2:
            continue
        flops = sum(4.0 * r["_hd"] * r["_pairs"] for r in rs) / G
        fwd, bwd = sum(r["fwd_ms"] for r in rs), sum(r["bwd_ms"] for r in rs)
        row = {"setup": setup, "pack": "ALL", "docs": sum(r["docs"] for r in rs), "tokens": sum(r["tokens"] for r in rs),
               "kernel": kernel, "exchange": exchange, "layout": layout, "fwd_ms": fwd, "bwd_ms": bwd,
               "fwd_tflops_gpu": flops / (fwd * 1e-3) / 1e12, "bwd_tflops_gpu": 2.5 * flops / (bwd * 1e-3) / 1e12,
               "fwdbwd_tflops_gpu": 3.5 * flops / ((fwd + bwd) * 1e-3) / 1e12}
        if all("single_fwd_ms" in r for r in rs):
            sf, sb = sum(r["single_fwd_ms"] for r in rs), sum(r["single_bwd_ms"] for r in rs)
            row.update(fwd_pct_ideal=100 * sf / G / fwd, bwd_pct_ideal=100 * sb / G / bwd,
                       fwdbwd_pct_ideal=100 * (sf + sb) / G / (fwd + bwd))
        out.append(row)
    return out


# --------------------------------------------------------------------------- part 4: overlap


def part_overlap(ctx: Ctx, args) -> dict:
    G, dtype = ctx.world, _dtype(ctx, args)
    reps, warmup = (2, 1) if args.tiny else (args.reps, args.warmup)
    deadline = time.time() + args.overlap_budget_s
    rows = []
    setups = [s for s in attention_setups(ctx, args) if s["pack"] in ("hist0", "cu3")]
    for s in setups:
        for kernel in _attn_kernels(ctx, args):
            if unsupported_reason(kernel, ctx.device, dtype, s["head_dim"], s["head_dim"]):
                continue
            for exchange in args.exchanges:
                for layout in args.layouts:
                    if ctx.out_of_time(deadline):
                        rows.append({**_srow(s), "kernel": kernel, "exchange": exchange, "layout": layout,
                                     "note": "skipped: overlap time budget"})
                        continue
                    step = make_step(ctx, s["lengths"], G, ctx.rank, ctx.group, kernel, exchange, layout)
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
                    for chunks in args.overlap_chunks:  # the same step, pipelined in `chunks` KV-head groups
                        step.kv_chunks = chunks
                        t = time_body(ctx, fwd_bwd_body(step, q, k, v, dout), reps, warmup)
                        row = {**_srow(s), "kernel": kernel, "exchange": exchange, "exchange_taken": step.kv_exchange,
                               "layout": layout, "kv_chunks": chunks, "comm_fwd_ms": c[0], "comm_bwd_ms": c[1],
                               "attn_fwd_ms": a[0], "attn_bwd_ms": a[1], "total_fwd_ms": t[0], "total_bwd_ms": t[1],
                               "exposed_fwd_ms": t[0] - a[0], "exposed_bwd_ms": t[1] - a[1],
                               "exposed_pct_of_attn": 100 * ((t[0] + t[1]) - (a[0] + a[1])) / (a[0] + a[1]),
                               "exposed_pct_of_total": 100 * ((t[0] + t[1]) - (a[0] + a[1])) / (t[0] + t[1])}
                        rows.append(row)
                        ctx.log("overlap", {k2: (round(v2, 3) if isinstance(v2, float) else v2) for k2, v2 in row.items()})
                    del step, q, k, v, ek, ev
                    if ctx.cuda:
                        torch.cuda.empty_cache()
    cols = ["setup", "pack", "kernel", "exchange", "exchange_taken", "layout", "kv_chunks", "comm_fwd_ms", "attn_fwd_ms",
            "total_fwd_ms", "exposed_fwd_ms", "comm_bwd_ms", "attn_bwd_ms", "total_bwd_ms", "exposed_bwd_ms",
            "exposed_pct_of_attn", "exposed_pct_of_total", "note"]
    return {"rows": rows, "columns": cols}


# --------------------------------------------------------------------------- part 3: end to end


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _e2e_sizes(args) -> list[int]:
    sizes = sorted(args.e2e_tokens)
    while args.e2e_max_tokens and sizes[-1] * 2 <= args.e2e_max_tokens:
        sizes.append(sizes[-1] * 2)
    return sizes


def part_e2e(ctx: Ctx, args) -> dict:
    rows = []
    deadline = time.time() + args.e2e_budget_s
    models = ["tiny"] if args.tiny else args.e2e_models
    sizes = [256, 512, 1024] if args.tiny else _e2e_sizes(args)
    runs = [(m, ctx.world) for m in models]
    if ctx.world > 1 and args.e2e_single:
        runs += [(m, 1) for m in models]  # G = 1 on rank 0's GPU, for the per-GPU comparison
    largest = {}
    if ctx.rank == 0:  # results of an earlier run in the same directory would be read as this run's
        for stale in list((ctx.out / "raw").glob("e2e_*.json")) + list((ctx.out / "raw").glob("e2e_*.done")):
            stale.unlink(missing_ok=True)
    ctx.barrier()
    single_sizes = sorted(args.e2e_single_tokens) if args.e2e_single_tokens else sizes
    for model, G in runs:
        for S in (single_sizes if G == 1 and ctx.world > 1 and not args.tiny else sizes):
            if ctx.out_of_time(deadline):
                rows.append({"model": model, "G": G, "tokens": S, "status": "skipped: e2e time budget"})
                break
            port = int(ctx.reduce([_free_port() if ctx.rank == 0 else 0])[0])
            tag = f"e2e_{model}_G{G}_S{S}"
            res = {}
            if ctx.rank < G:
                try:
                    res = _launch_child(ctx, args, dict(model=model, tokens=S, G=G, port=port, tag=tag))
                except Exception as exc:  # noqa: BLE001 - never skip the agreement below
                    res = {"error": f"launching the child failed: {type(exc).__name__}: {exc}"}
            # Wait on the file system, not inside a collective: a child may outlast the NCCL timeout of this group.
            (ctx.out / "raw" / f"{tag}_rank{ctx.rank}.done").touch()
            _wait_files([ctx.out / "raw" / f"{tag}_rank{r}.done" for r in range(ctx.world)], args.e2e_child_timeout_s + 120)
            oom, err = bool(res.get("oom")), bool(res.get("error")) and not res.get("oom")
            # consistent decision on every rank
            red = ctx.reduce([oom, err, res.get("step_s", 0), res.get("peak_gib", 0), res.get("first_s", 0)])
            row = {"model": model, "G": G, "tokens": S, "docs": res.get("docs"), "kernel": res.get("kernel"),
                   "fused_ce": args.e2e_fused_ce, "kv_chunks": args.kv_chunks if G > 1 else None,
                   "grad_sync": args.e2e_grad_sync if G > 1 else None}
            if red[0]:
                row["status"] = "OOM"
            elif red[1]:
                row.update(status="error", note=(res.get("error") or "failed on another rank")[:200])
            else:
                step_s = red[2]
                row.update(status="ok", step_s=step_s, first_s=red[4], tokens_per_s=S / step_s,
                           tokens_per_s_per_gpu=S / step_s / G, peak_gib=red[3])
                largest[f"{model} G={G}"] = S
            rows.append(row)
            ctx.save_partial(rows, E2E_COLUMNS)
            ctx.log("e2e", row)
            if row["status"] != "ok":
                break
    # per-GPU tokens/s at G vs G = 1 on the same pack, and vs G = 1 on a pack of the same tokens per GPU
    g1 = {(r["model"], r["tokens"]): r.get("tokens_per_s_per_gpu") for r in rows if r["G"] == 1 and r.get("status") == "ok"}
    for r in rows:
        if r["G"] == 1 or not r.get("tokens_per_s_per_gpu"):
            continue
        for column, tokens in (("per_gpu_vs_G1", r["tokens"]), ("per_gpu_vs_G1_same_per_gpu", r["tokens"] // r["G"])):
            base = g1.get((r["model"], tokens))
            if base:
                r[column] = r["tokens_per_s_per_gpu"] / base
    return {"rows": rows, "columns": E2E_COLUMNS, "largest_pack_that_trains": largest}


E2E_COLUMNS = ["model", "G", "tokens", "docs", "kernel", "fused_ce", "kv_chunks", "grad_sync", "status", "first_s", "step_s", "tokens_per_s", "tokens_per_s_per_gpu",
               "per_gpu_vs_G1", "per_gpu_vs_G1_same_per_gpu", "peak_gib", "note"]


def _launch_child(ctx: Ctx, args, job: dict) -> dict:
    """Run one (model, size) fwd+bwd measurement in a fresh process group of job['G'] ranks."""
    raw = ctx.out / "raw"
    result = raw / f"{job['tag']}_rank{ctx.rank}.json"
    result.unlink(missing_ok=True)
    env = dict(os.environ, RANK=str(ctx.rank), WORLD_SIZE=str(job["G"]), LOCAL_RANK=str(ctx.local_rank),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(job["port"]), LOCAL_WORLD_SIZE=str(job["G"]))
    for k in list(env):  # torchrun's agent store would make the child a client of a store nobody serves
        if k.startswith("TORCHELASTIC_") or k in ("GROUP_RANK", "ROLE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE"):
            env.pop(k)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--e2e-child", json.dumps({**job, "result": str(result)}),
           "--out", str(ctx.out), "--device", args.device, "--timeout-s", str(args.e2e_child_timeout_s),
           "--steps", str(args.steps), "--e2e-kernel", args.e2e_kernel, "--e2e-layout", args.e2e_layout,
           "--kv-chunks", str(args.kv_chunks), "--e2e-grad-sync", args.e2e_grad_sync] + (["--e2e-fused-ce"] if args.e2e_fused_ce else []) + (["--tiny"] if args.tiny else []) + (["--no-checkpointing"] if not args.checkpointing else [])
    with open(raw / f"{job['tag']}_rank{ctx.rank}.log", "w") as logf:
        proc = subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT)
        t0 = time.time()
        while proc.poll() is None:
            time.sleep(0.5)
            # a peer that OOMed or failed has exited; do not wait for the collective timeout
            if _peer_failed(raw, job, ctx.rank) or time.time() - t0 > args.e2e_child_timeout_s + 60:
                time.sleep(5)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                break
    if result.exists():
        return json.loads(result.read_text())
    return {"error": f"child exited with {proc.returncode} without a result (see raw/{job['tag']}_rank{ctx.rank}.log)"}


def _wait_files(paths: list[Path], limit_s: float) -> None:
    t0 = time.time()
    while not all(p.exists() for p in paths) and time.time() - t0 < limit_s:
        time.sleep(0.2)


def _peer_failed(raw: Path, job: dict, rank: int) -> bool:
    for r in range(job["G"]):
        p = raw / f"{job['tag']}_rank{r}.json"
        if r != rank and p.exists():
            try:
                if not json.loads(p.read_text()).get("ok"):
                    return True
            except (OSError, ValueError):
                pass
    return False


def _kernel_name(step: CPStep, model) -> str:
    """The kernel `auto` resolves to for this model's attention layers (as attention.entry chooses it)."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = next(model.parameters()).dtype
    return choose_kernel(step.attn_backend, step.plan.q_positions.device, dtype, head_dim, head_dim, frozenset()).name


def e2e_child(args) -> None:
    """One fwd+bwd measurement; writes a JSON result and exits without tearing the group down."""
    job = json.loads(args.e2e_child)
    out: dict = {"ok": False}
    try:
        cuda = args.device == "cuda"
        rank, G = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        group = None
        if G > 1:
            kw = {"device_id": device} if cuda else {}
            dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout_s), **kw)
            group = dist.group.WORLD
        from transformers import AutoModelForCausalLM, LlamaConfig

        config = LlamaConfig(**E2E_CONFIGS[job["model"]])
        config.use_cache = False
        dtype = torch.bfloat16 if cuda else torch.float32
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="blockdiag_cp")
        model.to(device).train()
        if args.checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if args.e2e_fused_ce and not enable_fused_cross_entropy(model):
            raise RuntimeError(f"--e2e-fused-ce: {fused_cross_entropy_unavailable(model)}")
        ddp = group is not None and args.e2e_grad_sync == "ddp"
        if ddp:  # the README's recipe: DDP over the CP ranks, bucketed all-reduces overlapped with backward
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, device_ids=[device] if cuda else None, process_group=group,
                                            gradient_as_bucket_view=True)
        cp_config = bdcp.CPConfig(args.e2e_kernel, "allgather", layout=args.e2e_layout, kv_chunks=args.kv_chunks)
        S = job["tokens"]
        lengths = histogram_lengths(HIST_CSV, S, seed=0, cap_fraction=0.25)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, config.vocab_size, (1, S), generator=g)
        batch = {"input_ids": ids.to(device), "labels": ids.clone().to(device),
                 "position_ids": torch.cat([torch.arange(n) for n in lengths])[None].to(device)}
        out["docs"] = len(lengths)
        times = []
        fake_oom = S >= int(os.environ.get("MULTIGPU_FAKE_OOM_TOKENS", 1 << 62))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        for i in range(1 + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=cp_config)
            with train_ctx() as step:
                out["kernel"] = _kernel_name(step, model.module if ddp else model)
                if fake_oom and rank == G - 1:  # testing hook: one rank fails mid-step, the others are in a collective
                    raise torch.OutOfMemoryError("MULTIGPU_FAKE_OOM_TOKENS")
                model(**local).loss.backward()
            if group is not None and not ddp:  # the CP gradient all-reduce, per parameter, after backward (exposed)
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad, group=group)
            model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        out.update(ok=True, first_s=times[0], step_s=statistics.median(times[1:]), step_times=times,
                   peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0)
    except torch.OutOfMemoryError as exc:
        out.update(oom=True, error=str(exc)[:300])
    except Exception as exc:  # noqa: BLE001
        out.update(error=f"{type(exc).__name__}: {exc}"[:500], traceback=traceback.format_exc())
    print(json.dumps({k: v for k, v in out.items() if k != "traceback"}), flush=True)
    tmp = Path(job["result"] + ".tmp")
    tmp.write_text(json.dumps(out))
    tmp.rename(job["result"])
    os._exit(0)  # no destroy_process_group: peers may be stuck in a collective after an OOM here


# --------------------------------------------------------------------------- output


def environment(ctx: Ctx) -> dict:
    import transformers

    env = {"G": ctx.world, "device": ctx.args.device, "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "host": socket.gethostname(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "argv": sys.argv, "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "OMP_NUM_THREADS")}}
    if ctx.cuda:
        env["gpu"] = torch.cuda.get_device_name()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def _public(rows):
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def write_results(ctx: Ctx, results: dict) -> str:
    if ctx.rank != 0:
        return ""
    G = ctx.world
    md = [f"# Multi-GPU CP benchmark, G = {G} ({results['env'].get('gpu', ctx.args.device)})", "",
          "```", " ".join(results["env"]["argv"]), "```", ""]
    for name, part in results["parts"].items():
        state = "ok" if part["ok"] else ("INCOMPLETE" if part["ok"] is None else "FAILED: " + str(part["error"]))
        md.append(f"## {name} ({state}, {part['seconds']} s)")
        md.append("")
        if part.get("summary"):
            md += [part["summary"], ""]
        if part.get("rows"):
            md += [markdown_table(_public(part["rows"]), part["columns"]), ""]
        if part.get("largest_pack_that_trains") is not None:
            md += [f"largest pack that trains: {part['largest_pack_that_trains']}", ""]
    text = "\n".join(md)
    (ctx.out / f"multigpu_G{G}.md").write_text(text)
    payload = {**results, "parts": {k: {**v, "rows": _public(v.get("rows", []))} for k, v in results["parts"].items()}}
    tmp = ctx.out / f"multigpu_G{G}.json.tmp"
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.rename(ctx.out / f"multigpu_G{G}.json")
    return text


def short_table(results: dict) -> str:
    lines = ["part | ok | s | headline", "---|---|---|---"]
    for name, p in results["parts"].items():
        rows = p.get("rows", [])
        head = p.get("summary", "")
        if name == "attention":
            tot = [r for r in rows if r.get("pack") == "ALL" and r.get("fwdbwd_pct_ideal") is not None] or [r for r in rows if "fwd_ms" in r]
            head = "; ".join(f"{r['setup']}/{r['pack']}/{r['exchange']}/{r['layout']}: {r['fwdbwd_tflops_gpu']:.3g} TF/s/GPU"
                             + (f" {r['fwdbwd_pct_ideal']:.0f}% ideal" if r.get("fwdbwd_pct_ideal") is not None else "") for r in tot[:8])
        elif name == "overlap":
            head = "; ".join(f"{r['setup']}/{r['exchange']}/{r['layout']}/x{r.get('kv_chunks', 1)}: exposed {r['exposed_pct_of_attn']:.0f}% of attention" for r in rows if "exposed_pct_of_attn" in r)
        elif name == "e2e":
            head = "; ".join(f"{r['model']} G={r['G']} {r['tokens']}: "
                             + (f"{r['tokens_per_s_per_gpu']:.0f} tok/s/GPU {r['peak_gib']:.0f} GiB" if r.get("status") == "ok" else r["status"])
                             for r in rows)
        lines.append(f"{name} | {p['ok']} | {p['seconds']} | {head}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- summary over machine kinds


def summarize(paths: list[str], out: str) -> str:
    """Scaling tables (and a plot) from the multigpu_G*.json of several runs (e.g. G = 2, 4, 8); no process group."""
    runs = []
    for p in paths:
        p = Path(p)
        runs += [json.loads(f.read_text()) for f in ([p] if p.is_file() else sorted(p.rglob("multigpu_G*.json")))]
    att, e2e = [], []
    for r in runs:
        G = r["env"]["G"]
        rows = r["parts"].get("attention", {}).get("rows", [])
        with_all = {x["setup"] for x in rows if x.get("pack") == "ALL"}  # a setup with one pack has no ALL row
        att += [{"G": G, **x} for x in rows if x.get("pack") == "ALL" or (x.get("fwd_ms") and x["setup"] not in with_all)]
        for row in r["parts"].get("e2e", {}).get("rows", []):
            e2e.append(row)
    att.sort(key=lambda x: (x["setup"], x["kernel"], x["exchange"], x["layout"], x["G"]))
    e2e.sort(key=lambda x: (x["model"], x["tokens"], x["G"]))
    md = ["# Multi-GPU scaling summary", "", "## attention (all packs of a setup; % of the 1/G ideal)", "",
          markdown_table(att, ["setup", "kernel", "exchange", "layout", "G", "fwd_tflops_gpu", "bwd_tflops_gpu",
                               "fwdbwd_tflops_gpu", "fwd_pct_ideal", "bwd_pct_ideal", "fwdbwd_pct_ideal"]),
          "", "## end to end", "",
          markdown_table(e2e, ["model", "tokens", "G", "status", "step_s", "tokens_per_s_per_gpu", "per_gpu_vs_G1",
                               "per_gpu_vs_G1_same_per_gpu", "peak_gib"])]
    text = "\n".join(md) + "\n"
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "scaling.md").write_text(text)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for key in dict.fromkeys((a["setup"], a["exchange"], a["layout"]) for a in att):
            pts = [(a["G"], a.get("fwdbwd_pct_ideal")) for a in att if (a["setup"], a["exchange"], a["layout"]) == key
                   and a.get("fwdbwd_pct_ideal") is not None]
            if pts:
                axes[0].plot(*zip(*pts), marker="o", label="/".join(key))
        axes[0].axhline(100, color="k", linestyle="--", linewidth=0.8)
        axes[0].set_xlabel("G")
        axes[0].set_ylabel("fwd+bwd % of 1/G ideal")
        axes[0].set_title("attention scaling")
        axes[0].legend(fontsize=6)
        for key in dict.fromkeys((e["model"], e["tokens"]) for e in e2e):
            pts = [(e["G"], e["tokens_per_s_per_gpu"]) for e in e2e if (e["model"], e["tokens"]) == key and e.get("tokens_per_s_per_gpu")]
            if pts:
                axes[1].plot(*zip(*sorted(pts)), marker="o", label=f"{key[0]} {key[1] // 1024}k" if key[1] >= 1024 else f"{key[0]} {key[1]}")
        sizes = sorted({a["G"] for a in att} | {e["G"] for e in e2e})
        for ax in axes:
            ax.set_xticks(sizes)
            ax.set_xlim(min(sizes) - 0.5, max(sizes) + 0.5)
        axes[0].set_ylim(0, 105)
        axes[1].set_ylim(bottom=0)  # per-GPU rate: a fall from G = 1 reads at its true size
        axes[1].set_xlabel("G")
        axes[1].set_ylabel("tokens/s per GPU")
        axes[1].set_title("end to end (fwd+bwd)")
        axes[1].legend(fontsize=6)
        fig.tight_layout()
        fig.savefig(Path(out) / "scaling.png", dpi=120)
    except ImportError:
        pass
    return text


# --------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--parts", default="parity,attention,e2e,overlap")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="tiny sizes (CPU smoke run)")
    p.add_argument("--dtype", default=None, help="attention/overlap dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--parity-dtype", default=None, help="parity dtype (default bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--fp32-tol", type=float, default=1e-4)
    p.add_argument("--parity-tokens-per-rank", type=int, default=1024)
    p.add_argument("--parity-budget-s", type=float, default=240)
    p.add_argument("--kernels", type=lambda s: s.split(","), default=None, help="parity kernels (default: all on the device)")
    p.add_argument("--attn-kernels", type=lambda s: s.split(","), default=None, help="attention/overlap kernels (default varlen on CUDA)")
    p.add_argument("--exchanges", type=lambda s: s.split(","), default=["allgather", "halo", "a2a"])
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
    p.add_argument("--e2e-tokens", type=int, nargs="+", default=[65536, 131072, 262144, 524288, 1048576])
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
    p.add_argument("--kv-chunks", type=int, default=bdcp.CPConfig.kv_chunks,
                   help="KV-head groups the exchange is pipelined in (attention and e2e parts)")
    p.add_argument("--overlap-chunks", type=int, nargs="+", default=[1, 2, 4, 8],
                   help="overlap part: the KV-head group counts to time")
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
    fns = {"parity": part_parity, "attention": part_attention, "e2e": part_e2e, "overlap": part_overlap}
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

"""`bench kernels`: local attention fwd+bwd on one packed row, one GPU.

Compares our entry point per backend (`blockdiag_attention` on a cp=1 step: plan lookup,
key selection and the kernel) with the raw kernel it wraps, the dense-mask SDPA path that
stock Transformers takes on packed rows, and SDPA on one causal document as a rate ceiling.
`ms` (and useful TFLOP/s) is the rate with calls queued back to back, as inside a model;
`latency_ms` syncs around every call, so it adds the host's launch time (large for FA4's
CuTe-DSL launches at short packs, docs/performance.md).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from .. import CPConfig, make_cp_blockdiag_batch_and_ctx
from ..kernels import unsupported_reason
from ..kernels.attention.flex import compiled_flex
from ..attention import blockdiag_attention
from ..step import STEP_KWARG
from .common import (
    attention_flops,
    document_ids_for,
    environment,
    histogram_lengths,
    line_plot,
    lognormal_lengths,
    markdown_table,
    profile_table,
    time_cuda,
    time_interleaved,
    time_queued,
    write_json,
)


def _step_for(doc_ids: torch.Tensor, backend: str, device):
    batch = {"input_ids": torch.zeros(1, doc_ids.numel(), dtype=torch.long, device=device), "document_ids": doc_ids[None].to(device)}
    _, local, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, config=CPConfig(backend, "allgather"))
    return local[STEP_KWARG]


def _raw_flex(doc_ids, q, k, v, interval: bool = False):
    """FlexAttention as its documentation writes document masking (document ids compared), or with
    `interval` the mask our entry point uses (first position of the query's document <= key <= query),
    to tell the mask's cost apart from the entry point's."""
    from torch.nn.attention.flex_attention import create_block_mask

    docs = doc_ids.to(q.device)
    new_doc = torch.ones_like(docs, dtype=torch.bool)
    new_doc[1:] = docs[1:] != docs[:-1]
    idx = torch.arange(docs.numel(), device=docs.device)
    starts = torch.cummax(torch.where(new_doc, idx, torch.zeros_like(idx)), 0).values

    def mask_mod(b, h, qi, ki):
        if interval:
            return (ki >= starts[qi]) & (ki <= qi)
        return (docs[qi] == docs[ki]) & (ki <= qi)

    bm = create_block_mask(mask_mod, None, None, docs.numel(), docs.numel(), device=q.device, _compile=True)
    fn = compiled_flex()  # compiled as our kernel compiles it, so both go dynamic at the same length
    return lambda: fn(q, k, v, block_mask=bm, enable_gqa=True)


def _raw_varlen(lengths, q, k, v):
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(q.device)
    m = max(lengths)
    q3, k3, v3 = (t.squeeze(0).transpose(0, 1) for t in (q, k, v))  # [S, H, D] views of the same storage
    return lambda: varlen_attn(q3, k3, v3, cu, cu, m, m, window_size=(-1, 0))


def _raw_fa4(lengths, q, k, v):
    from flash_attn.cute import flash_attn_varlen_func

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    cu = cu.to(q.device)
    m = max(lengths)
    q3, k3, v3 = (t.squeeze(0).transpose(0, 1) for t in (q, k, v))
    return lambda: flash_attn_varlen_func(
        q3.contiguous(), k3.contiguous(), v3.contiguous(), cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
        max_seqlen_k=m, causal=True,
    )[0]


def _dense(doc_ids, q, k, v):
    docs = doc_ids.to(q.device)
    idx = torch.arange(docs.numel(), device=q.device)
    mask = (docs[:, None] == docs[None, :]) & (idx[None, :] <= idx[:, None])
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def _runnable_backends(args, device, dtype) -> list[str]:
    """`--backends` without the kernels that cannot run here (each skip is printed)."""
    keep = []
    for backend in args.backends:
        reason = unsupported_reason(backend, device, dtype, args.head_dim, args.head_dim)
        if reason is not None:
            print(f"skipping {backend}: {reason}", flush=True)
        else:
            keep.append(backend)
    return keep


def _inputs(args, seq_len: int, device, dtype):
    """The pack's document lengths and q, k, v, grad in Transformers' layout: projections give
    [1, S, H, D]; attention receives the [1, H, S, D] view."""
    if args.lengths_csv:
        lengths = histogram_lengths(args.lengths_csv, seq_len, seed=args.seed)
    else:
        lengths = lognormal_lengths(seq_len, mean=args.mean_doc_len, seed=args.seed)
    g = torch.Generator(device=device).manual_seed(args.seed)

    def rand(h):
        return torch.randn(1, seq_len, h, args.head_dim, device=device, dtype=dtype, generator=g).requires_grad_()

    leaves = rand(args.heads), rand(args.kv_heads), rand(args.kv_heads)
    q, k, v = (t.transpose(1, 2) for t in leaves)
    grad = torch.randn(1, seq_len, args.heads, args.head_dim, device=device, dtype=dtype, generator=g)
    return lengths, q, k, v, grad


def _methods(args, lengths, q, k, v, device):
    """(methods, references, plan_ms): name -> (call, useful FLOPs). The methods are ours per backend and
    the raw kernels they wrap; the references (dense-mask SDPA, the one-document ceiling) are far slower
    or faster and are timed on their own."""
    doc_ids = document_ids_for(lengths)
    seq_len = doc_ids.numel()
    useful = attention_flops(lengths, args.heads, args.head_dim)
    methods, plan_ms = {}, {}
    for backend in args.backends:
        plan_ms[backend] = time_cuda(lambda: _step_for(doc_ids, backend, device), warmup=1, reps=3).median_ms
        step = _step_for(doc_ids, backend, device)
        methods[f"ours/{backend}"] = (lambda step=step: blockdiag_attention(step, q, k, v, scale=None, sliding_window=None), useful)
    if "flex" in args.backends:
        methods["raw/flex"] = (_raw_flex(doc_ids, q, k, v), useful)
        if args.flex_interval_mask:
            methods["raw/flex interval mask"] = (_raw_flex(doc_ids, q, k, v, interval=True), useful)
    if "varlen" in args.backends:
        methods["raw/varlen"] = (_raw_varlen(lengths, q, k, v), useful)
    if "fa4" in args.backends:
        methods["raw/fa4"] = (_raw_fa4(lengths, q, k, v), useful)
    references = {}
    if seq_len <= args.dense_max_len:
        references["dense-mask sdpa"] = (_dense(doc_ids, q, k, v), useful)
    references["sdpa one causal doc (ceiling)"] = (
        lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
        attention_flops([seq_len], args.heads, args.head_dim),
    )
    return methods, references, plan_ms


def _fwd_bwd(fn, grad) -> None:
    out = fn()
    if out.dim() == 3:  # varlen: [S, H, D]
        out = out.unsqueeze(0)
    elif out.shape[1] == grad.shape[2] and out.shape[2] == grad.shape[1]:  # SDPA/flex layout [1, H, S, D]
        out = out.transpose(1, 2)
    out.backward(grad)


def _timings(args, methods: dict, references: dict, grad):
    """Per method: `Timing` (a sync around every call: first call, latency, spread) and the rate with
    calls queued back to back, as in a model (the host runs ahead)."""
    calls = {name: (lambda fn=fn: _fwd_bwd(fn, grad)) for name, (fn, _) in methods.items()}
    ref_calls = {name: (lambda fn=fn: _fwd_bwd(fn, grad)) for name, (fn, _) in references.items()}
    # Turns in blocks: the entry point and the raw kernel see the same clocks and allocator state.
    timings = time_interleaved(calls, warmup=args.warmup, reps=args.reps)
    for name, call in ref_calls.items():
        timings[name] = time_cuda(call, warmup=1, reps=args.reference_reps)
    queued = time_queued(calls, calls=args.queued_calls, rounds=args.queued_rounds)
    queued.update(time_queued(ref_calls, calls=2, rounds=args.reference_reps))
    if args.profile:
        seq_len = grad.shape[1]
        for name, call in calls.items():
            profile_table(call, f"{args.out}/profile_{seq_len}_{name.replace('/', '_').replace(' ', '_')}.txt")
    return timings, queued


def _add_ratios(by_name: dict, backends) -> None:
    """Ratios within one pack length: over the ceiling's rate, ours over varlen, ours over its raw kernel and dense SDPA."""
    ceiling, varlen = by_name.get("sdpa one causal doc (ceiling)"), by_name.get("ours/varlen")
    for row in by_name.values():
        if ceiling and row is not ceiling:
            row["vs_ceiling"] = row["tflops"] / ceiling["tflops"]  # useful TFLOP/s over the ceiling's
        if varlen and row["method"].startswith("ours/") and row is not varlen:
            row["vs_varlen"] = varlen["ms"] / row["ms"]
    for backend in backends:
        ours, raw, dense = by_name.get(f"ours/{backend}"), by_name.get(f"raw/{backend}"), by_name.get("dense-mask sdpa")
        if ours and raw:
            ours["vs_raw"] = raw["ms"] / ours["ms"]
        if ours and dense:
            ours["vs_dense"] = dense["ms"] / ours["ms"]


def run(args) -> list[dict]:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    args.backends = _runnable_backends(args, device, dtype)
    rows = []
    for seq_len in args.seq_lens:
        # Every length compiles from scratch (static shapes, as a run at one pack length does): a
        # recompile to dynamic shapes would hit whichever method met the new length first.
        torch.compiler.reset()
        lengths, q, k, v, grad = _inputs(args, seq_len, device, dtype)
        methods, references, plan_ms = _methods(args, lengths, q, k, v, device)
        timings, queued = _timings(args, methods, references, grad)
        by_name = {}
        for name, (_, flops) in {**methods, **references}.items():
            t = timings[name]
            row = by_name[name] = {
                "seq_len": seq_len, "docs": len(lengths), "method": name, "first_ms": t.first_ms, "ms": queued[name],
                "latency_ms": t.median_ms, "spread_ms": max(t.runs) - min(t.runs), "tflops": flops / queued[name] / 1e9,
                "cuda_mallocs": t.device_allocs,
            }
            if name.startswith("ours/"):
                row["plan_ms"] = plan_ms[name.split("/")[1]]
            print(row, flush=True)
        _add_ratios(by_name, args.backends)
        rows += by_name.values()
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seq-lens", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--backends", nargs="+", default=["flex", "varlen", "fa4"], help="kernels that cannot run here are skipped")
    p.add_argument("--mean-doc-len", type=float, default=2048)
    p.add_argument("--lengths-csv", default=None, help="histogram CSV of document lengths instead of log-normal")
    p.add_argument("--dense-max-len", type=int, default=131072)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--reference-reps", type=int, default=3, help="timed calls of the dense-mask and ceiling SDPA")
    p.add_argument("--queued-calls", type=int, default=6, help="calls queued back to back per rate measurement (ms, tflops)")
    p.add_argument("--queued-rounds", type=int, default=3, help="rate measurements per method (median)")
    p.add_argument("--profile", action="store_true", help="also write a profiler table per method (profile_*.txt)")
    p.add_argument("--flex-interval-mask", action="store_true", help="also time raw flex with our interval mask_mod")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests of the script")
    p.add_argument("--out", default="bench_out")


def main(args) -> None:
    rows = run(args)
    cols = ["seq_len", "docs", "method", "first_ms", "ms", "latency_ms", "spread_ms", "tflops", "vs_raw", "vs_ceiling", "vs_varlen", "vs_dense", "plan_ms", "cuda_mallocs"]
    table = markdown_table(rows, cols)
    print(table)
    write_json(f"{args.out}/kernels.json", {"env": environment(), "args": vars(args), "rows": rows})
    with open(f"{args.out}/kernels.md", "w") as f:
        f.write(table + "\n")
    line_plot(rows, "tflops", "useful TFLOP/s (fwd+bwd)", "Local attention on one packed row", f"{args.out}/kernels.png")

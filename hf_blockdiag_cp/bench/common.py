"""Shared pieces of the benchmarks: pack sampling, FLOP accounting, timing and output.

Useful FLOPs count only the block-causal area: forward 4·H·D·Σ l(l+1)/2 (two matmuls of
2·D FLOPs per allowed query-key pair), forward+backward 3.5× forward.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..compat.torch import cuda_sleep


def lognormal_lengths(total: int, mean: float, sigma: float = 1.0, seed: int = 0, cap: int | None = None) -> list[int]:
    """Document lengths drawn log-normally with the given mean, cut so they sum exactly to `total`."""
    g = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2
    lengths: list[int] = []
    while sum(lengths) < total:
        n = int(math.exp(mu + sigma * float(torch.randn(1, generator=g))))
        n = max(1, min(n, cap or total))
        lengths.append(min(n, total - sum(lengths)))
    return lengths


def histogram_buckets(csv_path: str | os.PathLike) -> tuple[list[tuple[int, int]], list[float]]:
    """The (low, high) length buckets of a histogram CSV (`range,number,...` rows like "[11, 50]";
    lengths below 1 raised to 1) and their document counts."""
    buckets, weights = [], []
    with open(csv_path) as f:
        for row in csv.DictReader(f):
            lo, hi = (int(x) for x in row["range"].strip('"[] ').split(","))
            buckets.append((max(lo, 1), hi))
            weights.append(float(row["number"]))
    return buckets, weights


def histogram_lengths(csv_path: str | os.PathLike, total: int, seed: int = 0, cap_fraction: float = 0.25) -> list[int]:
    """Lengths sampled from a histogram CSV (`histogram_buckets`), each capped at `cap_fraction` of
    the pack and uniform within its bucket, cut to sum exactly to `total`."""
    buckets, weights = histogram_buckets(csv_path)
    g = torch.Generator().manual_seed(seed)
    probs = torch.tensor(weights) / sum(weights)
    cap = max(1, int(total * cap_fraction))
    lengths: list[int] = []
    while sum(lengths) < total:
        lo, hi = buckets[int(torch.multinomial(probs, 1, generator=g))]
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        lengths.append(min(n, cap, total - sum(lengths)))
    return lengths


def document_ids_for(lengths: list[int]) -> torch.Tensor:
    return torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))


def causal_pairs(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def attention_flops(lengths: list[int], heads: int, head_dim: int, backward: bool = True) -> float:
    fwd = 4.0 * heads * head_dim * causal_pairs(lengths)
    return fwd * 3.5 if backward else fwd


@dataclass
class Timing:
    first_ms: float
    median_ms: float
    runs: list[float] = field(default_factory=list)
    device_allocs: int = 0  # cudaMalloc calls the caching allocator made inside the timed calls


def _device_allocs() -> int:
    """cudaMalloc calls so far: a timed call that makes any pays the allocator, not the kernel."""
    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("num_device_alloc", 0))


def time_cuda(fn: Callable[[], None], warmup: int = 2, reps: int = 5) -> Timing:
    """First call (compilation, mask building) timed alone, then the median of `reps` after `warmup`."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(max(0, warmup - 1)):
        fn()
    runs = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        runs.append((time.perf_counter() - t0) * 1e3)
    return Timing(first, statistics.median(runs), runs)


def time_interleaved(
    fns: dict[str, Callable[[], None]], warmup: int = 2, reps: int = 10, block: int = 3
) -> dict[str, Timing]:
    """Like `time_cuda` for several methods, but the methods take turns in blocks of `block`
    consecutive calls, the first call of a block untimed, until each has `reps` timed calls:
    clock ramps and thermal drift hit every method alike, and no timed call pays for the
    allocator re-fitting itself after another method's memory pattern."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    first = {}
    for name, fn in fns.items():
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        first[name] = (time.perf_counter() - t0) * 1e3
    for _ in range(max(0, warmup - 1)):
        for fn in fns.values():
            fn()
    runs: dict[str, list[float]] = {name: [] for name in fns}
    allocs = dict.fromkeys(fns, 0)
    while any(len(r) < reps for r in runs.values()):
        for name, fn in fns.items():
            if len(runs[name]) >= reps:
                continue
            fn()  # re-warm after the previous method
            for _ in range(min(block - 1, reps - len(runs[name]))):
                before = _device_allocs()
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                runs[name].append((time.perf_counter() - t0) * 1e3)
                allocs[name] += _device_allocs() - before
    return {name: Timing(first[name], statistics.median(r), r, allocs[name]) for name, r in runs.items()}


def time_queued(fns: dict[str, Callable[[], None]], calls: int = 5, rounds: int = 3) -> dict[str, float]:
    """Milliseconds per call when `calls` calls are queued back to back (one host sync per batch),
    median over `rounds` batches, the methods taking turns: the device rate with the host running
    ahead, as in a training step, where `time_interleaved` (a sync around every call) also counts
    the host's launch latency. Host-bound methods stay host-bound here: the host cannot queue faster
    than it launches."""
    if not torch.cuda.is_available():  # CPU smoke runs: wall time per call
        out = {}
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name] = (time.perf_counter() - t0) * 1e3 / calls
        return out
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            fn()  # re-warm after the previous method
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cuda_sleep(2_000_000)  # ~1 ms of device work, so the host's first launch is queued in time
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            torch.cuda.synchronize()
            per_call[name].append(start.elapsed_time(end) / calls)
    return {name: statistics.median(r) for name, r in per_call.items()}


def environment() -> dict:
    """Versions, GPU and date of this run, written beside every result (docs quote them with the command)."""
    import datetime

    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "cuda": torch.version.cuda,
           "date": datetime.date.today().isoformat()}
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
    return env


def write_json(path: str | os.PathLike, payload) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    out = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        out.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    return "\n".join(out)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


def line_plot(rows: list[dict], y: str, ylabel: str, title: str, path: str | os.PathLike) -> None:
    """One line per method of `y` against packed tokens (log2 axis), saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for method in dict.fromkeys(r["method"] for r in rows):
        pts = [(r["seq_len"], r[y]) for r in rows if r["method"] == method and y in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("packed tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_table(fn, path: str, calls: int = 3) -> None:
    """Operator tables of `calls` calls of `fn` into `path`: by self CUDA time (where the GPU's time
    goes) and by self CPU time (host overhead that can leave the GPU idle)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        if cuda:
            torch.cuda.synchronize()
    table = prof.key_averages()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for sort in (["self_cuda_time_total"] if cuda else []) + ["self_cpu_time_total"]:
            f.write(f"sorted by {sort}\n" + table.table(sort_by=sort, row_limit=30) + "\n\n")

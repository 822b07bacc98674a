"""The process context, timing and outputs of benchmarks/multigpu.py (one process per rank).

`Ctx` holds the rank's process group, device, output folder and log; `time_body` times a body on
every rank and takes the max over ranks; `run_part` runs one part under try/except with an
all-reduced failure flag; `write_results` rewrites DIR/multigpu_G{G}.json and .md; `summarize`
combines the JSON of several runs (e.g. G = 2, 4, 8) into a scaling table and plot.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from hf_blockdiag_cp.bench.common import markdown_table
from hf_blockdiag_cp.step import exchange_label


# --------------------------------------------------------------------------- process context


class Ctx:
    """One rank: its process group (NCCL on CUDA, gloo on CPU), device, output folder and log."""

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


def _mode(row: dict) -> str:
    """The exchange of a row, with how it overlapped attention (`exchange_label`)."""
    return exchange_label(row["exchange"], row.get("overlap"))


def short_table(results: dict) -> str:
    lines = ["part | ok | s | headline", "---|---|---|---"]
    for name, p in results["parts"].items():
        rows = p.get("rows", [])
        head = p.get("summary", "")
        if name == "attention":
            tot = [r for r in rows if r.get("pack") == "ALL" and r.get("fwdbwd_pct_ideal") is not None] or [r for r in rows if "fwd_ms" in r]
            head = "; ".join(f"{r['setup']}/{r['pack']}/{_mode(r)}/{r['layout']}: {r['fwdbwd_tflops_gpu']:.3g} TF/s/GPU"
                             + (f" {r['fwdbwd_pct_ideal']:.0f}% ideal" if r.get("fwdbwd_pct_ideal") is not None else "") for r in tot[:8])
        elif name == "overlap":
            head = "; ".join(f"{r['setup']}/{_mode(r)}/{r['layout']}: exposed {r['exposed_pct_of_attn']:.0f}% of attention" for r in rows if "exposed_pct_of_attn" in r)
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
        e2e += r["parts"].get("e2e", {}).get("rows", [])
    for a in att:
        a["exchange"] = _mode(a)
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
        _plot_summary(att, e2e, Path(out) / "scaling.png")
    except ImportError:  # matplotlib: the [bench] extra
        pass
    return text


def _plot_summary(att: list[dict], e2e: list[dict], path: Path) -> None:
    """Attention % of the 1/G ideal and e2e tokens/s per GPU, against G."""
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
    fig.savefig(path, dpi=120)

"""`bench scaling`: predicted per-GPU efficiency of CP at G = 2 … 32, validated on a multi-GPU run.

Inputs, both produced by the user: `--multigpu`, the `multigpu_G<G>.json` of a
`benchmarks/multigpu.py` run with the overlap and e2e parts (G = 1 rows via `--e2e-single`), and
`--kernels`, the `kernels.json` of `bench kernels` on one GPU (the kernel's useful TFLOP/s). The
model (`scaling_model`) is checked against every G > 1 row of the run (`scaling_fit`), then
predicts G = 2 … 32 for the 1.2B and 8B configs. Writes scaling_model.{md,json,png} to `--out`;
the exit status is 1 when a gating row is more than `--tolerance` off. docs/scaling.md.
"""

from __future__ import annotations

import argparse
import json
import math
import textwrap
from dataclasses import replace
from pathlib import Path

from .common import markdown_table, write_json
from .scaling_fit import TOLERANCE, calibrate_linear_rate, network_from_overlap, validate
from .scaling_model import INTER_NODE_GBPS_PER_GPU, LATENCY_MS, NODE_GPUS, OVERLAP_PLANS, KernelRates, Setup
from .scaling_model import per_gpu_efficiency, step_ms
from .setups import E2E_CONFIGS


PLANNED, KEYS = OVERLAP_PLANS  # `--overlaps` values besides fractions: the split as built, a split by keys


def overlap_value(text: str):
    """An `--overlaps` value: a fraction in [0, 1], "planned" or "keys"."""
    if text in OVERLAP_PLANS:
        return text
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"an overlap is a fraction in [0, 1], {PLANNED!r} or {KEYS!r}; got {text!r}")
    return value


def fkey(f) -> str:
    """How columns and labels name an overlap value."""
    return f if f in OVERLAP_PLANS else f"{f:g}"


def with_overlap(st: Setup, f) -> Setup:
    return replace(st, overlap=0.0, overlap_plan=f) if f in OVERLAP_PLANS else replace(st, overlap=f, overlap_plan=None)


def predictions(models, sizes, tokens, base: Setup, r_lin: dict, overlaps=(0.0, 1.0)) -> list[dict]:
    """Per model, pack and G: per-GPU efficiency (same pack, same tokens per GPU) and step time per overlap value
    (a fraction, "planned": the overlap as built, or "keys": a split by keys), with the step's breakdown at the first one."""
    rows = []
    fallback = r_lin.get("1.2b") or next(iter(r_lin.values()))
    for m in models:
        cfg = E2E_CONFIGS[m]
        for S in tokens:
            for G in sizes:
                row = {"model": m, "tokens": S, "G": G}
                for f in overlaps:
                    st = with_overlap(replace(base, r_lin_tflops=r_lin.get(m, fallback)), f)
                    e = per_gpu_efficiency(cfg, S, G, st)
                    row.update({f"same_pack_f{fkey(f)}": e["same_pack"], f"same_tpg_f{fkey(f)}": e["same_tokens_per_gpu"],
                                f"step_s_f{fkey(f)}": e["step_ms"] / 1e3})
                    if f == overlaps[0]:
                        parts = step_ms(cfg, S, G, st)
                        share = {k: 100 * parts[k] / parts["total"] for k in ("kv", "allreduce", "attention")}
                        row.update(kv_pct=share["kv"], allreduce_pct=share["allreduce"], attention_pct=share["attention"],
                                   imbalance=parts["imbalance"])
                rows.append(row)
    return rows


def _fmt_tokens(S):
    return f"{S // 2**20}M" if S >= 2**20 else f"{S // 1024}k"


def efficiency_table(rows, key: str, overlaps) -> str:
    sizes = sorted({r["G"] for r in rows})
    lines = ["| model | pack | " + " | ".join(f"G={g}" for g in sizes) + " |", "|---|---|" + "---|" * len(sizes)]
    for (m, S) in dict.fromkeys((r["model"], r["tokens"]) for r in rows):
        cells = []
        for g in sizes:
            r = next(x for x in rows if (x["model"], x["tokens"], x["G"]) == (m, S, g))
            cells.append(" / ".join(f"{100 * r[f'{key}_f{fkey(f)}']:.0f}" for f in overlaps))
        lines.append(f"| {m} | {_fmt_tokens(S)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows, path: Path, overlaps, caption: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    keys = (("same_pack", "same total pack"), ("same_tpg", "same tokens per GPU"))
    fig, axes = plt.subplots(len(keys), len(models), figsize=(5.5 * len(models), 8), squeeze=False)
    tokens = sorted({r["tokens"] for r in rows})
    colors = plt.cm.viridis([i / max(1, len(tokens) - 1) * 0.9 for i in range(len(tokens))])
    styles = {overlaps[0]: "-", overlaps[-1]: "--"}
    for j, m in enumerate(models):
        for i, (key, label) in enumerate(keys):
            ax = axes[i][j]
            for S, c in zip(tokens, colors):
                pts = sorted(((r["G"], r) for r in rows if r["model"] == m and r["tokens"] == S), key=lambda p: p[0])
                for f in overlaps:
                    ax.plot([g for g, _ in pts], [100 * r[f"{key}_f{fkey(f)}"] for _, r in pts], styles.get(f, ":"), color=c,
                            marker="o", ms=3, label=f"{_fmt_tokens(S)} f={fkey(f)}")
            ax.axvline(NODE_GPUS + 0.5, color="grey", linewidth=0.8, linestyle=":")
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({r["G"] for r in rows}))
            ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.set_ylim(0, 125 if key == "same_tpg" else 105)
            ax.set_xlabel(f"G (CP size; > {NODE_GPUS}: several nodes)")
            ax.set_ylabel("tokens/s per GPU, % of G = 1")
            ax.set_title(f"{m}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=6, ncol=2)
    fig.suptitle("\n".join(textwrap.wrap(caption, 140)), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--multigpu", required=True,
                   help="multigpu_G<G>.json of a G > 1 run of benchmarks/multigpu.py (overlap + e2e parts)")
    p.add_argument("--kernels", required=True, nargs="+",
                   help="kernels.json of `bench kernels` with ours/<kernel> rows, one per head dim (`--head-dim`): each "
                        "model takes the rates measured at its head dim, else the nearest measured (said in the report)")
    p.add_argument("--kernel", default="varlen",
                   help="attention kernel of the e2e rows without a `kernel` key, and of the predictions")
    p.add_argument("--inter-gbps", type=float, default=INTER_NODE_GBPS_PER_GPU,
                   help="inter-node GB/s per GPU (default 8 x 400 Gb/s / 8 GPUs)")
    p.add_argument("--latency-intra-ms", type=float, default=LATENCY_MS["intra"])
    p.add_argument("--latency-inter-ms", type=float, default=LATENCY_MS["inter"])
    p.add_argument("--overlaps", type=overlap_value, nargs="+", default=[0.0, PLANNED, KEYS, 1.0],
                   help="K/V exchange overlaps to predict: fractions hidden, planned (CPConfig(overlap='queries'): "
                        "hidden under the attention of the queries whose keys are local), or keys "
                        "(CPConfig(overlap='keys'): hidden under the attention over local keys)")
    p.add_argument("--layout", default="balanced")
    p.add_argument("--exchange", default="allgather", choices=["allgather", "a2a"],
                   help="a2a: rough (its measured time is mostly a fixed per-call cost, modelled here as bytes / rate)")
    p.add_argument("--models", nargs="+", default=["1.2b", "8b"], choices=sorted(E2E_CONFIGS))
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    p.add_argument("--tokens", type=int, nargs="+", default=[131072, 262144, 524288, 1048576, 2097152])
    p.add_argument("--tolerance", type=float, default=TOLERANCE)
    p.add_argument("--gate", choices=["e2e", "all"], default="e2e",
                   help="rows that decide the exit status: the e2e step rows (default) or also the attention-part rows")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--out", default="bench_out", help="writes scaling_model.md, .json and .png here")
    p.add_argument("--validate-only", action="store_true", help="skip the G = 2..32 predictions (fast)")


def rate_sources(args, results: dict, rates: KernelRates) -> list[dict]:
    """Per model and kernel that the validation or the predictions use: the model's head dim and the
    head dim whose measured kernel rates stand for it (`substituted` where they differ)."""
    e2e = results.get("parts", {}).get("e2e", {}).get("rows", [])
    pairs = dict.fromkeys([(r.get("model"), r.get("kernel") or args.kernel) for r in e2e]
                          + [(m, args.kernel) for m in args.models])
    out = []
    for model, kernel in pairs:
        if model in E2E_CONFIGS:
            head_dim = E2E_CONFIGS[model]["head_dim"]
            measured = rates.measured_head_dim(kernel, head_dim)
            out.append({"model": model, "kernel": kernel, "head_dim": head_dim, "rates_head_dim": measured,
                        "substituted": measured != head_dim})
    return out


def _inputs_section(args, env: dict, rates: KernelRates, net, r_lin: dict, sources: list[dict]) -> list[str]:
    machine = f"{env.get('gpu', env.get('device'))} x{env['G']}, torch {env.get('torch')}, NCCL {env.get('nccl')}"
    used = dict.fromkeys((s["kernel"], s["rates_head_dim"]) for s in sources)
    substituted = [f"{s['model']} (head dim {s['head_dim']}, {s['kernel']}) uses the rates measured at head dim "
                   f"{s['rates_head_dim']}" for s in sources if s["substituted"]]
    return [
        f"Inputs: `{args.multigpu}` ({machine}, {env.get('date', '')[:10]}), kernel rates `{' '.join(args.kernels)}` ("
        + "; ".join(f"{k} at head dim {d}: " + ", ".join(f"{_fmt_tokens(s)} {t:.0f} TF/s" for s, t in rates.points[(k, d)])
                    for k, d in used) + "), bf16.",
        *(["", "**Not calibrated at the model's head dim:** " + "; ".join(substituted)
           + " (pass a `bench kernels --head-dim D` JSON for each)."] if substituted else []),
        "", "Measured effective collective rates (GB/s, median of the overlap rows): "
        + ", ".join(f"{k[0]} {k[1]} {v:.0f}" for k, v in sorted(net.bw.items()))
        + f"; inter-node assumption {args.inter_gbps:g} GB/s per GPU; latency per ring step "
        f"{net.latency_ms['intra'] * 1e3:g} µs intra / {net.latency_ms['inter'] * 1e3:g} µs inter (assumed).",
        "", "Calibrated linear-layer rate R_lin (TFLOP/s, G = 1 step minus modelled attention): "
        + ", ".join(f"{m} {v:.0f}" for m, v in r_lin.items())
        + ("" if set(args.models) <= set(r_lin) else f" (models without a G = 1 row use {next(iter(r_lin))}'s)") + ".",
    ]


def _predictions_section(args, base: Setup, r_lin: dict, G_measured: int) -> tuple[list[str], list[dict]]:
    ov = tuple(args.overlaps)
    prow = predictions(args.models, args.cp_sizes, args.tokens, base, r_lin, ov)
    fl = " / ".join(f"f={fkey(f)}" for f in ov)
    caption = (f"Predicted, not measured beyond G = {G_measured}: {args.kernel} kernel rates and collective rates measured, "
               f"inter-node {args.inter_gbps:g} GB/s per GPU assumed; bf16, activation checkpointing, {args.layout} layout, "
               f"{args.exchange}; packs {', '.join(_fmt_tokens(s) for s in args.tokens)} (real length histogram, cap S/4); "
               f"solid f={fkey(ov[0])}, dashed f={fkey(ov[-1])}, dotted between (planned: split by queries; keys: split by keys)")
    plot(prow, Path(args.out) / "scaling_model.png", ov, caption)
    md = [f"## Predicted per-GPU efficiency, same total pack (%, {fl})", "",
          "tokens/s per GPU at G over the model's G = 1 on the same pack (memory ignored).", "",
          efficiency_table(prow, "same_pack", ov), "",
          f"## Predicted per-GPU efficiency, same tokens per GPU (%, {fl})", "",
          "tokens/s per GPU at G (pack S) over G = 1 on a pack of S/G tokens: "
          "also counts the longer documents of the longer pack.", "",
          efficiency_table(prow, "same_tpg", ov), "",
          f"## Step breakdown at f={fkey(ov[0])}", "",
          markdown_table([{**r, "step_s": r[f"step_s_f{fkey(ov[0])}"]} for r in prow],
                         ["model", "tokens", "G", "step_s", "attention_pct", "kv_pct", "allreduce_pct", "imbalance"]), ""]
    return md, prow


def main(args) -> int:
    results = json.loads(Path(args.multigpu).read_text())
    rates = KernelRates.from_json(args.kernels)
    latency = {"intra": args.latency_intra_ms, "inter": args.latency_inter_ms}
    net, bw_rows = network_from_overlap(results, args.inter_gbps, latency)
    base = Setup(rates, net, 1.0, kernel=args.kernel, layout=args.layout, exchange=args.exchange,
                 checkpointing=args.checkpointing)
    r_lin = calibrate_linear_rate(results, base)
    if not r_lin:
        raise SystemExit("the multigpu JSON has no G = 1 e2e row (run it with --e2e-single): "
                         "nothing to calibrate the linear layers on")
    vrows = validate(results, base, r_lin, args.tolerance)
    gated = [v for v in vrows if args.gate == "all" or v["measurement"].startswith("e2e")]
    ok = bool(gated) and all(v["status"] == "PASS" for v in gated)
    verdicts = {part: f"{sum(v['status'] == 'PASS' for v in vs)}/{len(vs)} within {100 * args.tolerance:g} %"
                for part in ("e2e", "attention") for vs in [[v for v in vrows if v["measurement"].startswith(part)]] if vs}
    env = results["env"]
    sources = rate_sources(args, results, rates)
    command = " ".join(["hf-blockdiag-cp-bench", *getattr(args, "argv", ["scaling"])])
    md = ["# Scaling model (bench scaling)", "", "```", command, "```", "",
          *_inputs_section(args, env, rates, net, r_lin, sources), "",
          f"## Validation at G = {env['G']} (tolerance {100 * args.tolerance:g} %, gate: {args.gate}): "
          f"{'PASS' if ok else 'FAIL'}",
          "", "; ".join(f"{k}: {v}" for k, v in verdicts.items()) + ". The attention-part rows check the kernel + exchange "
          "sub-model alone (exchange exposed, kernel time = measured G = 1 time x max-rank work share); see docs/scaling.md "
          "for why they do not gate by default.", "",
          markdown_table(vrows, ["measurement", "quantity", "predicted", "measured", "rel_err_pct", "status"]), ""]
    payload = {"inputs": {"multigpu": args.multigpu, "kernels": args.kernels, "env": env},
               "network_gbps": {f"{k[0]}/{k[1]}": v for k, v in net.bw.items()}, "bandwidth_samples": bw_rows,
               "r_lin_tflops": r_lin, "kernel_rates": sources, "assumptions": {"inter_gbps_per_gpu": args.inter_gbps, "node_gpus": NODE_GPUS,
                                                      "latency_ms": net.latency_ms, "kernel": args.kernel, "layout": args.layout,
                                                      "exchange": args.exchange, "checkpointing": args.checkpointing},
               "validation": vrows, "validation_ok": ok, "gate": args.gate, "verdicts": verdicts}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if not args.validate_only:
        section, payload["predictions"] = _predictions_section(args, base, r_lin, int(env["G"]))
        md += section
    (Path(args.out) / "scaling_model.md").write_text("\n".join(md))
    write_json(Path(args.out) / "scaling_model.json", payload)
    print("\n".join(md))
    print(f"validation ({args.gate} rows gate): {'PASS' if ok else 'FAIL'}; "
          + "; ".join(f"{k}: {v}" for k, v in verdicts.items()))
    return 0 if ok else 1

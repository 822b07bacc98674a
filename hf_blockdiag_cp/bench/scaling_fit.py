"""The measured inputs of `bench scaling`, read from a multi-GPU benchmark run
(`benchmarks/multigpu.py`'s `multigpu_G<G>.json`), and the model beside that run's rows.

- `network_from_overlap`: effective collective rates per exchange and direction, from the
  overlap part's exchange-alone times and the planner's max-rank bytes of the same packs.
- `calibrate_linear_rate`: the linear-layer rate R_lin per model, from the G = 1 end-to-end rows
  (measured step minus modelled attention, over the linear FLOPs).
- `validate`: predicted against measured for every G > 1 end-to-end row (step time, tokens/s
  per GPU, per-GPU rate against G = 1) and every attention-part row (% of the 1/G ideal).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from ..planning import kv_row_bytes
from ..step import exchange_label
from .scaling_model import BYTES_PER_ELEMENT, INTER_NODE_GBPS_PER_GPU, LATENCY_MS, Network, Setup, linear_flops_per_token
from .scaling_model import pack_cost, step_ms
from .setups import E2E_CONFIGS, SETUP_NAMES, attention_setups

TOLERANCE = 0.10



def _run_plan(row: dict) -> str | None:
    """The overlap plan (`scaling_model.OVERLAP_PLANS`) a run's row was measured with: "planned" for the
    split by queries (`overlap` "queries", or True in runs before the split by keys), "keys" for the
    split by keys, else None."""
    overlap = row.get("overlap")
    return "keys" if overlap == "keys" else "planned" if overlap in (True, "queries") else None

def _heads(s: str) -> tuple[int, int, int]:
    q, rest = s.split("/")
    kv, d = rest.split("x")
    return int(q), int(kv), int(d)


def measured_setups(results: dict) -> dict:
    """(setup, pack) -> the run's attention / overlap packs, rebuilt from its arguments."""
    a = results.get("args", {})
    packs = attention_setups(int(results["env"]["G"]), a.get("setups") or SETUP_NAMES, int(a.get("tokens_per_rank", 8192)),
                             int(a.get("magi_packs", 3)), bool(a.get("tiny", False)))
    return {(s["setup"], s["pack"]): s for s in packs}


def network_from_overlap(results: dict, inter_gbps: float = INTER_NODE_GBPS_PER_GPU, latency_ms=None) -> tuple[Network, list]:
    """Effective GB/s per (exchange, direction): median over the overlap rows of max-rank bytes / (ms - latency).
    Rows of results written before `kv_chunks` was removed that pipelined the exchange (`kv_chunks` > 1) are
    left out."""
    lat = dict(LATENCY_MS, **(latency_ms or {}))
    G = int(results["env"]["G"])
    setups = measured_setups(results)
    rows = [r for r in results["parts"].get("overlap", {}).get("rows", [])  # an overlapped row times the same exchange
            if r.get("comm_fwd_ms") and int(r.get("kv_chunks") or 1) == 1 and not r.get("overlap")]
    samples, detail = {}, []
    for r in rows:
        s = setups.get((r["setup"], r["pack"]))
        if s is None:
            continue
        kind = r.get("exchange_taken") or r["exchange"]
        _, kvh, d = _heads(r.get("heads") or f"{s['heads']}/{s['kv_heads']}x{s['head_dim']}")
        cost = pack_cost(tuple(s["lengths"]), G, r["layout"])
        row_b = kv_row_bytes(kvh, d, d, BYTES_PER_ELEMENT)
        for direction in ("fwd", "bwd"):
            if (kind, direction) not in cost.rows:
                continue
            nbytes = cost.rows[(kind, direction)] * row_b
            ms = r[f"comm_{direction}_ms"] - (G - 1) * lat["intra"]
            if nbytes > 0 and ms > 0:
                gbps = nbytes / (ms * 1e-3) / 1e9
                samples.setdefault((kind, direction), []).append(gbps)
                detail.append({"setup": r["setup"], "pack": r["pack"], "exchange": kind, "layout": r["layout"],
                               "direction": direction, "mib": nbytes / 2**20, "ms": r[f"comm_{direction}_ms"], "gbps": gbps})
    bw = {k: statistics.median(v) for k, v in samples.items()}
    if ("allgather", "fwd") not in bw or ("allgather", "bwd") not in bw:
        raise SystemExit("the multigpu JSON has no allgather overlap rows: no measured collective rate")
    return Network(bw, inter_gbps=inter_gbps, latency_ms=lat), detail


def e2e_rows(results: dict) -> list[dict]:
    return [r for r in results["parts"].get("e2e", {}).get("rows", []) if r.get("status") == "ok" and r.get("step_s")]


def run_e2e_layout(results: dict) -> str:
    """The layout the run's e2e rows trained with: multigpu.py's `--e2e-layout` (rows do not record it), else contiguous."""
    argv = list(results.get("env", {}).get("argv", []))
    return argv[argv.index("--e2e-layout") + 1] if "--e2e-layout" in argv[:-1] else "contiguous"


def calibrate_linear_rate(results: dict, base: Setup, configs: dict = E2E_CONFIGS) -> dict:
    """R_lin (TFLOP/s) per model from the G = 1 e2e rows: linear FLOPs / (step - modelled attention).
    `base` gives the rates, network, default kernel, checkpointing and packs; `configs` the models by name."""
    out = {}
    for r in e2e_rows(results):
        cfg, S = configs.get(r["model"]), int(r["tokens"])
        if int(r["G"]) != 1 or cfg is None:
            continue
        st = replace(base, r_lin_tflops=1.0, kernel=r.get("kernel") or base.kernel, layout="contiguous")
        attn = step_ms(cfg, S, 1, st)["attention"]
        lin_ms = r["step_s"] * 1e3 - attn
        out.setdefault(r["model"], []).append(S * linear_flops_per_token(cfg, base.checkpointing) / (lin_ms * 1e-3) / 1e12)
    return {m: statistics.mean(v) for m, v in out.items()}


def validate(results: dict, base: Setup, r_lin: dict, tol: float = TOLERANCE, configs: dict = E2E_CONFIGS) -> list[dict]:
    """The model beside every G > 1 measurement of the run: the e2e rows (`validate_e2e`), then the
    attention part's fwd+bwd % of the 1/G ideal (`validate_attention`)."""
    return validate_e2e(results, base, r_lin, tol, configs) + validate_attention(results, base.net, tol)


def validate_e2e(results: dict, base: Setup, r_lin: dict, tol: float = TOLERANCE, configs: dict = E2E_CONFIGS) -> list[dict]:
    """Step time, tokens/s per GPU, and per-GPU rate against the run's own G = 1 rows (same pack, same tokens per GPU)."""
    out = []
    e2e = e2e_rows(results)
    g1 = {(r["model"], int(r["tokens"])): r for r in e2e if int(r["G"]) == 1}
    fallback = r_lin.get("1.2b") or next(iter(r_lin.values()), None)
    run_layout = run_e2e_layout(results)
    for r in e2e:
        cfg, S, g = configs.get(r["model"]), int(r["tokens"]), int(r["G"])
        if g == 1 or cfg is None:
            continue
        st = replace(base, r_lin_tflops=r_lin.get(r["model"], fallback), kernel=r.get("kernel") or base.kernel,
                     layout=r.get("layout") or run_layout, exchange=r.get("exchange") or "allgather",
                     overlap=0.0, overlap_plan=_run_plan(r))  # the run's CPConfig.overlap
        p = step_ms(cfg, S, g, st)
        name = f"e2e {r['model']} S={S} G={g}"
        out.append(_vrow(name, "step_s", p["total"] / 1e3, r["step_s"], tol))
        out.append(_vrow(name, "tokens/s per GPU", S / g / (p["total"] / 1e3), r["tokens_per_s_per_gpu"], tol))
        for quantity, tokens, share in (("same pack", S, g), ("same tokens/GPU", S // g, 1)):
            ref = g1.get((r["model"], tokens))
            if ref:
                pred = step_ms(cfg, tokens, 1, replace(st, layout="contiguous"))["total"] / (share * p["total"])
                out.append(_vrow(name, f"per-GPU vs G=1 ({quantity})", pred,
                                 r["tokens_per_s_per_gpu"] / ref["tokens_per_s_per_gpu"], tol))
    return out


def validate_attention(results: dict, net: Network, tol: float = TOLERANCE) -> list[dict]:
    """The attention part's rows: measured G = 1 time x max-rank work share + modelled exchange, as % of the 1/G ideal."""
    G = int(results["env"]["G"])
    setups = measured_setups(results)
    out = []
    for r in results["parts"].get("attention", {}).get("rows", []):
        s = setups.get((r["setup"], r.get("pack")))
        if s is None or not r.get("fwdbwd_pct_ideal") or not r.get("single_fwd_ms"):
            continue
        kind = r.get("exchange_taken") or r["exchange"]
        cost = pack_cost(tuple(s["lengths"]), G, r["layout"])
        if (kind, "fwd") not in cost.rows:
            continue
        ideal = (r["single_fwd_ms"] + r["single_bwd_ms"]) / G
        row_b = kv_row_bytes(s["kv_heads"], s["head_dim"], s["head_dim"], BYTES_PER_ELEMENT)
        comm = sum(net.collective_ms(cost.rows[(kind, d)] * row_b, G, kind, d) for d in ("fwd", "bwd"))
        attn = ideal * cost.max_work * G / cost.total_work
        pred = attn + cost.exposed_ms(comm, attn, 0.0, _run_plan(r))
        mode = exchange_label(kind, r.get("overlap"))
        out.append(_vrow(f"attention {r['setup']}/{r['pack']} {mode} {r['layout']}", "fwd+bwd % of 1/G ideal",
                         100 * ideal / pred, r["fwdbwd_pct_ideal"], tol))
    return out


def _vrow(name, quantity, pred, meas, tol):
    err = (pred - meas) / meas
    return {"measurement": name, "quantity": quantity, "predicted": pred, "measured": meas, "rel_err_pct": 100 * err,
            "status": "PASS" if abs(err) <= tol else "FAIL"}

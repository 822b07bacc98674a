"""The analytic step model behind `bench scaling`: one training step of one pack of S tokens on
G GPUs, for the slowest rank (L layers, H query heads of dim D):

    T(G, S) = T_lin + T_attn + T_kv - hidden + T_ar,  hidden = min(f * T_kv, T_attn)
    T_lin  = local_len * F_lin / R_lin                 linear layers etc.: FLOPs per token over a calibrated rate
    T_attn = L * c * 4 * H * D * max_r work_r / R_attn(S)   c = 3.5 (fwd + bwd) + 1 with checkpointing (fwd recompute)
    T_kv   = L * (n_fwd * t(fwd bytes) + t(bwd bytes)) n_fwd = 2 with checkpointing; t(b) = (G-1)*a + b / B(G)
    T_ar   = n_tensors * 2(G-1)*a + 2(G-1)/G * P * 2 bytes / B(G)   ring all-reduce of the bf16 gradients

`work_r` and the K/V rows per rank come from the planner (`plan_layout`, `rank_work`, and the
exchange records' `rows_per_layer` over `plan_exchange`) on the pack (`Setup.packs`, by default
the multi-GPU benchmark's end-to-end pack). R_attn: measured single-GPU useful TFLOP/s of the
kernel, interpolated in log2(S). B(G): measured collective rates within a node (G <= `node_gpus`),
capped by an inter-node share per GPU beyond. f: the overlapped fraction of the K/V exchange (never
more than the attention it runs under); or a planned split (`Setup.overlap_plan`): hidden =
min(T_kv, T_attn * s), s the share of the busiest rank's work that can attend while its exchange
runs: "planned", the split by queries (`CPConfig(overlap="queries")`, `planning.overlap_work`), or
"keys", the split by keys (`CPConfig(overlap="keys")`, `planning.key_local_work`); neither counts the
split's own kernel cost (`bench ranks --overlaps`). Memory is not modelled.
docs/scaling.md explains the terms and their inputs.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from ..planning import exchange_records, key_local_work, kv_row_bytes, overlap_work, plan_exchange, plan_layout, rank_work
from .setups import e2e_pack_lengths

NODE_GPUS = 8
INTER_NODE_GBPS_PER_GPU = 8 * 400 / 8 / NODE_GPUS  # 8 NICs x 400 Gb/s per node (/8: GB/s) over its 8 GPUs = 50 GB/s
LATENCY_MS = {"intra": 0.005, "inter": 0.010}  # per ring step (assumed, not measured)
BYTES_PER_ELEMENT = 2  # bf16 activations, K/V and gradients


@dataclass(frozen=True)
class Network:
    """Effective collective rates in GB/s: `bw[(exchange, direction)]` measured within a node, plus the inter-node share."""

    bw: dict
    inter_gbps: float = INTER_NODE_GBPS_PER_GPU
    node_gpus: int = NODE_GPUS
    latency_ms: dict = field(default_factory=lambda: dict(LATENCY_MS))

    def rate(self, G: int, exchange: str = "allgather", direction: str = "fwd") -> tuple[float, float]:
        """(GB/s, latency ms per ring step) of a collective over G ranks."""
        bw = self.bw.get((exchange, direction), self.bw[("allgather", direction)])
        if G <= self.node_gpus:
            return bw, self.latency_ms["intra"]
        return min(bw, self.inter_gbps), self.latency_ms["inter"]

    def collective_ms(self, nbytes: float, G: int, exchange: str = "allgather", direction: str = "fwd") -> float:
        if G <= 1:
            return 0.0
        bw, lat = self.rate(G, exchange, direction)
        return (G - 1) * lat + (nbytes / (bw * 1e9) * 1e3 if bw != math.inf else 0.0)

    def allreduce_ms(self, nbytes: float, G: int, n_tensors: int = 1) -> float:
        """Ring all-reduce: 2(G-1)/G of the bytes through each rank's link, 2(G-1) latency steps per tensor."""
        if G <= 1:
            return 0.0
        bw, lat = self.rate(G, "allgather", "fwd")
        return n_tensors * 2 * (G - 1) * lat + (2 * (G - 1) / G * nbytes / (bw * 1e9) * 1e3 if bw != math.inf else 0.0)


class KernelRates:
    """Useful fwd+bwd TFLOP/s of each kernel at each head dim against pack length (single GPU),
    interpolated in log2(S), clamped. `points[(kernel, head_dim)]` = [(S, TFLOP/s), ...]."""

    def __init__(self, points: dict[tuple[str, int], list[tuple[int, float]]]):
        self.points = {k: sorted(v) for k, v in points.items()}
        for (kernel, head_dim), pts in self.points.items():
            lengths = [S for S, _ in pts]
            if len(set(lengths)) != len(lengths):
                raise ValueError(f"kernel {kernel!r} at head dim {head_dim}: a pack length measured twice ({lengths})")

    @classmethod
    def from_json(cls, paths) -> "KernelRates":
        """`bench kernels` JSONs, each at one head dim (its `args.head_dim`): rows with `seq_len`,
        `method` ("ours/<kernel>"), `tflops`."""
        pts: dict[tuple[str, int], list] = {}
        for path in [paths] if isinstance(paths, (str, Path)) else paths:
            data = json.loads(Path(path).read_text())
            head_dim = data.get("args", {}).get("head_dim")
            if head_dim is None:
                raise ValueError(f"{path}: no args.head_dim; expected a kernels.json written by `bench kernels`")
            for r in data["rows"]:
                m = str(r.get("method", ""))
                if m.startswith("ours/") and r.get("tflops"):
                    pts.setdefault((m.split("/", 1)[1], int(head_dim)), []).append((int(r["seq_len"]), float(r["tflops"])))
        return cls(pts)

    def measured_head_dim(self, kernel: str, head_dim: int) -> int:
        """`head_dim` if `kernel` was measured at it, else the nearest measured head dim (the larger on a
        tie), whose rates then stand in; `bench scaling` reports every such substitution."""
        dims = sorted(d for k, d in self.points if k == kernel)
        if not dims:
            raise ValueError(f"no measured rate for kernel {kernel!r}; the kernels JSONs have {sorted({k for k, _ in self.points})}")
        return min(dims, key=lambda d: (abs(d - head_dim), -d))

    def tflops(self, kernel: str, S: int, head_dim: int) -> float:
        pts = self.points[(kernel, self.measured_head_dim(kernel, head_dim))]
        if S <= pts[0][0]:
            return pts[0][1]
        if S >= pts[-1][0]:
            return pts[-1][1]
        for (s0, r0), (s1, r1) in zip(pts, pts[1:]):
            if s0 <= S <= s1:
                w = (math.log2(S) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
                return r0 + w * (r1 - r0)
        raise AssertionError("unreachable: S lies between the first and the last point")


def model_sizes(cfg: dict) -> dict:
    """Matmul parameters of a Llama config: per layer, LM head, total (tied embedding counted once), tensors."""
    H, I, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = H * q + 2 * H * kv + q * H + 3 * H * I
    head = H * cfg["vocab_size"]
    total = L * (layer + 2 * H) + H + head * (1 if cfg.get("tie_word_embeddings") else 2)
    tensors = L * 9 + 2 + (0 if cfg.get("tie_word_embeddings") else 1)
    return {"layer": layer, "head": head, "total": total, "tensors": tensors}


def linear_flops_per_token(cfg: dict, checkpointing: bool = True) -> float:
    """2 FLOPs per matmul parameter forward, 4 backward; checkpointing reruns the decoder layers' forward."""
    s = model_sizes(cfg)
    layers = s["layer"] * cfg["num_hidden_layers"]
    return 2 * (layers + s["head"]) * 3 + (2 * layers if checkpointing else 0)


@functools.lru_cache(maxsize=None)
def e2e_pack(tokens: int) -> tuple[int, ...]:
    """The multi-GPU benchmark's end-to-end pack of `tokens` tokens (cached: the model asks for it often)."""
    return tuple(e2e_pack_lengths(tokens))


# Planned overlaps, by the name `bench scaling --overlaps` takes: per rank, the work that can attend
# while its exchange runs. "planned": the split by queries (CPConfig(overlap="queries")); "keys": the
# split by keys, merged by log-sum-exp (CPConfig(overlap="keys")).
OVERLAP_PLANS = {"planned": overlap_work, "keys": key_local_work}


@dataclass(frozen=True)
class PackCost:
    """Per-rank quantities of one layout that the step model needs (rows, not bytes: models differ in row size)."""

    local_len: int
    max_work: int
    total_work: int
    rows: dict  # (exchange, direction) -> max over ranks of K/V rows received per layer
    # Per `OVERLAP_PLANS` name: the busiest rank's work that can attend while its exchange runs, as a share of it.
    overlap_shares: dict = field(default_factory=dict)

    def exposed_ms(self, kv_ms: float, attn_ms: float, f: float, plan: str | None = None) -> float:
        """Exchange time the step waits for: all of it less what hides under attention (`f` of it,
        never more than the attention; with a `plan`, under that plan's share of the attention)."""
        hidden = min(f * kv_ms, attn_ms) if plan is None else min(kv_ms, self.overlap_shares[plan] * attn_ms)
        return kv_ms - hidden


@functools.lru_cache(maxsize=None)
def pack_cost(lengths: tuple[int, ...], G: int, layout: str = "balanced") -> PackCost:
    """The planned layout's work per rank and, for every registered exchange that can serve it, the
    busiest rank's K/V rows per layer, forward and backward (the exchange record's `rows_per_layer`)."""
    lay = plan_layout(list(lengths), G, layout)
    work = rank_work(lay).tolist()
    busiest = max(range(G), key=work.__getitem__)
    plan = plan_exchange(lay)
    rows = {}
    for record in exchange_records():
        if record.reason(plan) is None and record.row_bytes is None:  # K/V rows only: the model's T_kv
            per_rank = [record.rows_per_layer(plan, r) for r in range(G)]
            rows[(record.name, "fwd")] = max(f for f, _ in per_rank)
            rows[(record.name, "bwd")] = max(b for _, b in per_rank)
    shares = {name: int(part(lay)[busiest]) / work[busiest] if G > 1 and work[busiest] else 0.0
              for name, part in OVERLAP_PLANS.items()}
    return PackCost(lay.local_len, max(work), sum(work), rows, shares)


@dataclass(frozen=True)
class Setup:
    """Everything but the pack size and G: rates, network, kernel, layout, exchange, overlap (a
    fraction `overlap`, or a planned split, `overlap_plan`: a name of `OVERLAP_PLANS`),
    checkpointing, and `packs(S)`, the document lengths of the pack of S tokens."""

    rates: KernelRates
    net: Network
    r_lin_tflops: float
    kernel: str = "varlen"
    layout: str = "balanced"
    exchange: str = "allgather"
    overlap: float = 0.0
    overlap_plan: str | None = None
    checkpointing: bool = True
    packs: Callable[[int], Sequence[int]] = field(default=e2e_pack, compare=False)


def attention_ms(cfg: dict, S: int, cost: PackCost, st: Setup) -> float:
    """Slowest rank's attention compute over all layers (fwd, bwd = 2.5x fwd, + fwd recompute)."""
    c = 3.5 + (1.0 if st.checkpointing else 0.0)
    fwd_flops = 4.0 * cfg["num_attention_heads"] * cfg["head_dim"] * cost.max_work
    rate = st.rates.tflops(st.kernel, S, cfg["head_dim"])
    return cfg["num_hidden_layers"] * c * fwd_flops / (rate * 1e12) * 1e3


def kv_exchange_ms(cfg: dict, G: int, cost: PackCost, st: Setup) -> float:
    """The slowest rank's K/V exchange over all layers: forward (twice with checkpointing) and backward."""
    if G <= 1:
        return 0.0
    row_b = kv_row_bytes(cfg["num_key_value_heads"], cfg["head_dim"], cfg["head_dim"], BYTES_PER_ELEMENT)
    ex = st.exchange if (st.exchange, "fwd") in cost.rows else "allgather"
    n_fwd = 2 if st.checkpointing else 1
    return cfg["num_hidden_layers"] * (n_fwd * st.net.collective_ms(cost.rows[(ex, "fwd")] * row_b, G, ex, "fwd")
                                       + st.net.collective_ms(cost.rows[(ex, "bwd")] * row_b, G, ex, "bwd"))


def step_ms(cfg: dict, S: int, G: int, st: Setup, lengths=None) -> dict:
    """Predicted step time (ms) of one pack at CP size G, by component (see the module docstring)."""
    lengths = tuple(lengths) if lengths is not None else tuple(st.packs(S))
    cost = pack_cost(lengths, G, st.layout if G > 1 else "contiguous")
    lin = cost.local_len * linear_flops_per_token(cfg, st.checkpointing) / (st.r_lin_tflops * 1e12) * 1e3
    attn = attention_ms(cfg, S, cost, st)
    kv = kv_exchange_ms(cfg, G, cost, st)
    exposed = cost.exposed_ms(kv, attn, st.overlap, st.overlap_plan)
    sizes = model_sizes(cfg)
    ar = st.net.allreduce_ms(sizes["total"] * BYTES_PER_ELEMENT, G, sizes["tensors"])
    total = lin + attn + exposed + ar
    return {"total": total, "linear": lin, "attention": attn, "kv": kv, "kv_exposed": exposed, "allreduce": ar,
            "imbalance": cost.max_work * G / cost.total_work if cost.total_work else 1.0}


def per_gpu_efficiency(cfg: dict, S: int, G: int, st: Setup) -> dict:
    """tokens/s per GPU at G over G = 1, (a) on the same pack S, (b) at the same tokens per GPU (G = 1 on S/G).
    The G = 1 baselines are the model's own (memory ignored: G = 1 would not fit the large packs)."""
    tG = step_ms(cfg, S, G, st)["total"]
    same_pack = step_ms(cfg, S, 1, st)["total"] / (G * tG)
    same_tpg = step_ms(cfg, S // G, 1, st)["total"] / tG
    return {"same_pack": same_pack, "same_tokens_per_gpu": same_tpg, "step_ms": tG}

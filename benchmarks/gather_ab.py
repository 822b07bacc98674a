"""The needed-key gather, fwd + bwd, with level-wise gradients (`attention.dispatch.needed_keys`) against
`index_select`'s autograd (an `index_add_` over repeated rows), on the `bench ranks` scenarios'
balanced layouts (a2a key buffers) and the all-gather's; both timed in the same run, taking turns.

    python benchmarks/gather_ab.py --out bench_out/gather_ab     # GPU; --device cpu for a smoke run
"""

from __future__ import annotations

import argparse

import torch

from hf_blockdiag_cp.attention.dispatch import needed_keys
from hf_blockdiag_cp.bench.common import document_ids_for, environment, markdown_table, time_queued, write_json
from hf_blockdiag_cp.bench.ranks import scenario_lengths
from hf_blockdiag_cp.kernels import calibrated_cost
from hf_blockdiag_cp.planning import plan_exchange, plan_layout
from hf_blockdiag_cp.step import build_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=131072)
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[4, 8])
    p.add_argument("--scenarios", nargs="+", default=["lognormal4k", "one_doc", "half_doc_plus_short"])
    p.add_argument("--exchanges", nargs="+", default=["a2a", "allgather"])
    p.add_argument("--kernel", default="fa4", help="whose calibrated cost plans the balanced layouts")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench_out/gather_ab")
    args = p.parse_args()
    device, dtype = torch.device(args.device), torch.bfloat16
    rows = []
    for scenario in args.scenarios:
        doc_ids = document_ids_for(scenario_lengths(scenario, args.seq_len, 0))
        for g in args.cp_sizes:
            layout = plan_layout(doc_ids, g, "balanced", kernel_cost=calibrated_cost(args.kernel))
            for exchange in args.exchanges:
                plan = plan_exchange(layout) if exchange != "allgather" else None
                for rank in range(g):
                    dp = build_step(layout, rank, None, device, "dense", exchange, plan).plan
                    if dp.key_index is None:
                        continue  # one contiguous range: a slice, no gather
                    n = dp.row_positions.numel()
                    k = torch.randn(n, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                    v = torch.randn_like(k, requires_grad=True)

                    def levels():
                        ek, ev = needed_keys(dp, k, v)
                        torch.autograd.backward((ek, ev), (torch.ones_like(ek), torch.ones_like(ev)))

                    def index_select():
                        ek, ev = k.index_select(0, dp.key_index), v.index_select(0, dp.key_index)
                        torch.autograd.backward((ek, ev), (torch.ones_like(ek), torch.ones_like(ev)))

                    t = time_queued({"levels": levels, "index_select": index_select}, calls=4, rounds=3)
                    rows.append({"scenario": scenario, "G": g, "exchange": exchange, "rank": rank, "rows": n,
                                 "keys": int(dp.key_index.numel()), "repeat_levels": len(dp.key_levels) - 1,
                                 "index_select_ms": t["index_select"], "levels_ms": t["levels"],
                                 "speedup": t["index_select"] / t["levels"]})
                    print(rows[-1], flush=True)
    table = markdown_table(rows, ["scenario", "G", "exchange", "rank", "rows", "keys", "repeat_levels", "index_select_ms",
                                  "levels_ms", "speedup"])
    print(table)
    write_json(f"{args.out}/gather_ab.json", {"env": environment(), "args": vars(args), "rows": rows})
    with open(f"{args.out}/gather_ab.md", "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()

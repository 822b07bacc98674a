"""State passing against head-parallel for one gated delta-rule layer under CP: bytes and time per layer,
and what `auto` chooses, at each CP size, on the packs of `bench model` (log-normal documents) and on
one document that fills the pack.

G processes form a gloo group; on one GPU they share it (NCCL cannot put two ranks on one GPU), so the
times include gloo's host copies over loopback TCP and G ranks' kernels queued on one device. Gloo
moves bytes far slower than NCCL between GPUs, so here the bytes weigh more than they would there;
`auto_chooses` is what a step's `auto` takes on this group, which weighs bytes at its backend's rate
(`planning.mixer_plan.mixer_cost_for`).
Bytes are the busiest rank's, forward and backward (`planning.mixer_plan.transport_bytes`). On a GPU
the parent process runs the layer once on each pack first, with Triton's autotuning results cached on
disk (`TRITON_CACHE_AUTOTUNING=1`), so the G ranks find their kernels compiled and tuned instead of
autotuning side by side on one device. Each transport runs in a step configured for it
(`CPConfig.mixer_transport`) and its row names what ran. Each row is printed and appended to
`mixer_transports.jsonl` as it is measured; the JSON is rewritten after each CP size, and a failing
rank stops the run (`torch.multiprocessing.spawn`).

    python benchmarks/mixer_transports.py --out bench_out/mixer_transports        # one GPU
    python benchmarks/mixer_transports.py --device cpu --small --seq-lens 2048 --cp-sizes 2   # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # read when fla's kernels are defined: before the imports below

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.bench.common import environment, lognormal_lengths, markdown_table, write_json
from hf_blockdiag_cp.mixers import MixerContext, gated_delta_mix
from hf_blockdiag_cp.model_patches.gated_delta import input_projections, mixer_layer
from hf_blockdiag_cp.planning import document_ids_from_lengths
from hf_blockdiag_cp.planning.mixer_plan import transport_bytes
from hf_blockdiag_cp.step.state import STEP_KWARG

import mixer_docs  # noqa: E402  (the same layer as the documents benchmark)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_layer(layer, step, hidden, probe, calls: int) -> tuple[float, str]:
    """Median seconds of one fwd+bwd of the layer's token mixer on this rank (every rank calls alike),
    and what the mixer ran (`MixerContext.describe`)."""
    spec = mixer_layer(layer)
    ctx = MixerContext.from_step(step)
    times = []
    for i in range(calls + 1):
        _sync(hidden.device)
        dist.barrier(group=step.group)
        t0 = time.perf_counter()
        mixed, _, b, a = input_projections(layer, hidden)
        (gated_delta_mix(spec, mixed, b, a, ctx) * probe).sum().backward()
        _sync(hidden.device)
        if i:  # the first call compiles and autotunes
            times.append(time.perf_counter() - t0)
    return statistics.median(times), ctx.describe()


def packs(seq_len: int, args) -> dict[str, list[int]]:
    return {"lognormal": lognormal_lengths(seq_len, mean=args.mean_doc_len, seed=0), "one_doc": [seq_len]}


def warm_kernels(args) -> None:
    """One fwd+bwd of the layer per pack in this process, so the ranks' first calls find the kernels
    compiled and their autotuning on disk (keys hold the head sizes, not the length)."""
    layer = mixer_docs.build_layer(args)
    for seq_len in args.seq_lens:
        for lengths in packs(seq_len, args).values():
            cu = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(args.device)
            x = torch.randn(1, seq_len, layer.hidden_size, device=args.device, dtype=layer.out_proj.weight.dtype,
                            requires_grad=True)
            layer(x, cu_seq_lens_q=cu).sum().backward()
    del layer
    torch.cuda.empty_cache()


def measure(rank: int, world_size: int, group, args, rows_path: str | None = None) -> list[dict]:
    """Every row of one CP size, each transport run by a step configured for it
    (`CPConfig.mixer_transport`); rank 0 appends each row to `rows_path` as it is measured."""
    device = torch.device(args.device)
    layer = mixer_docs.build_layer(args)
    spec = mixer_layer(layer)
    rows = []
    for seq_len in args.seq_lens:
        for name, lengths in packs(seq_len, args).items():
            ids = torch.zeros(1, seq_len, dtype=torch.long, device=device)
            batch = {"input_ids": ids, "labels": ids, "document_ids": document_ids_from_lengths(lengths, seq_len)[None].to(device)}
            _, auto_local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch)  # mixer_transport="auto"
            g = torch.Generator().manual_seed(rank)
            hidden = torch.randn(layout.local_len, layer.hidden_size, generator=g).to(device, layer.out_proj.weight.dtype)
            hidden.requires_grad_(True)
            probe = torch.randn(layout.local_len, spec.value_heads, spec.value_dim, generator=g).to(device, hidden.dtype)
            shape = spec.shape(hidden.element_size())
            chosen = MixerContext.from_step(auto_local[STEP_KWARG]).transport_for(shape)  # what the step's `auto` takes
            for transport, moved in transport_bytes(layout, shape).items():
                config = bdcp.CPConfig(mixer_transport=transport)
                _, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
                seconds, ran = time_layer(layer, local[STEP_KWARG], hidden, probe, args.calls)
                if f"transport={transport}" not in ran.split():
                    raise RuntimeError(f"mixer_transport={transport!r} ran {ran!r}")
                worst = torch.tensor([seconds])
                dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
                rows.append({"pack": name, "seq_len": seq_len, "docs": len(lengths), "G": world_size, "transport": transport,
                             "mib_per_layer": round(moved / 2**20, 2), "ms_per_layer": round(float(worst) * 1e3, 2),
                             "auto_chooses": chosen, "ran": ran})
                if rank == 0 and rows_path is not None:
                    print(rows[-1], flush=True)
                    with open(rows_path, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
    return rows


def worker(rank, world_size, port, args, rows_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    measure(rank, world_size, dist.group.WORLD, args, rows_path)
    dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[16384, 65536])
    p.add_argument("--cp-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mean-doc-len", type=float, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--small", action="store_true", help="a small layer (CPU runs)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench_out/mixer_transports")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.device == "cuda":
        started = time.perf_counter()
        warm_kernels(args)
        print(f"kernels compiled and tuned in {time.perf_counter() - started:.1f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    rows_path = f"{args.out}/mixer_transports.jsonl"  # rank 0 appends each row as measured
    open(rows_path, "w").close()
    for g in args.cp_sizes:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(g, port, args, rows_path), nprocs=g)  # raises if any rank fails
        with open(rows_path) as f:
            rows = [json.loads(line) for line in f]
        write_json(f"{args.out}/mixer_transports.json", {"env": environment(), "args": vars(args), "rows": rows})
    print(markdown_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()

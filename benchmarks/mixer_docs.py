"""The gated delta-rule token mixer's cost against the number of documents in a pack of fixed length:
one patched Qwen3.5 GatedDeltaNet layer, forward + backward, over packs of `--seq-len` tokens split
into each of `--docs` documents of near-equal length, timed in the same run (methods taking turns),
with the ratio to the fewest documents. Linear cost in the documents keeps that ratio near 1.

    python benchmarks/mixer_docs.py --out bench_out/mixer_docs                      # GPU (the 1.13B layer)
    python benchmarks/mixer_docs.py --device cpu --dtype float32 --seq-len 8192 --docs 64 512 --small
"""

from __future__ import annotations

import argparse

import torch
import transformers

from hf_blockdiag_cp.bench.common import environment, markdown_table, time_queued, write_json
from hf_blockdiag_cp.bench.model_hybrid import CONFIGS, TINY_LINEAR
from hf_blockdiag_cp.model_patches import apply_model_patches


def build_layer(args):
    """Layer 0 (a gated delta-rule layer) of the `bench model --arch qwen3_5` config, patched."""
    fields = dict(CONFIGS["qwen3_5"][1], num_hidden_layers=1, layer_types=["linear_attention"])
    if args.small:
        fields.update(TINY_LINEAR, hidden_size=64, vocab_size=101)
    config = transformers.Qwen3_5TextConfig(**fields)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    apply_model_patches(model)
    return model.model.layers[0].linear_attn.to(args.device)


def equal_docs(total: int, n: int) -> torch.Tensor:
    """cu_seqlens of `n` documents of near-equal length summing to `total`."""
    sizes = torch.full((n,), total // n, dtype=torch.int32)
    sizes[: total % n] += 1
    return torch.cat([torch.zeros(1, dtype=torch.int32), sizes.cumsum(0, dtype=torch.int32)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=65536)
    p.add_argument("--docs", type=int, nargs="+", default=[30, 100, 300, 1000])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--small", action="store_true", help="a small layer (CPU runs)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default="bench_out/mixer_docs")
    args = p.parse_args()
    layer = build_layer(args)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.seq_len, layer.hidden_size, generator=g).to(args.device, getattr(torch, args.dtype))
    x.requires_grad_(True)
    probe = torch.randn_like(x)

    def step(cu):
        def run():
            (layer(x, cu_seq_lens_q=cu) * probe).sum().backward()
        return run

    fns = {n: step(equal_docs(args.seq_len, n).to(args.device)) for n in args.docs}
    for fn in fns.values():  # first calls: kernel compilation and autotuning
        fn()
    ms = time_queued(fns, calls=args.calls)
    base = ms[args.docs[0]]
    rows = [{"docs": n, "seq_len": args.seq_len, "ms_fwd_bwd": round(ms[n], 3), "ratio_to_fewest": round(ms[n] / base, 3)}
            for n in args.docs]
    table = markdown_table(rows, list(rows[0]))
    print(table)
    write_json(f"{args.out}/mixer_docs.json", {"env": environment(), "args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

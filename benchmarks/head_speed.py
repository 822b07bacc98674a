"""The log-prob head alone: forward + backward time and peak memory of per-token log p(target) from
hidden states `[N, H]` and an output embedding `[V, H]`, five ways, same inputs, same process.

    python benchmarks/head_speed.py --out bench_out/head_speed                  # one H100 / H200, bf16
    python benchmarks/head_speed.py --device cpu --tiny --out /tmp/head_tiny    # smoke check, CPU

Methods (`--methods`):
- ours_eager: `logprobs.token_log_probs(tiles="eager")`, the chunked head with each tile's math op by op;
- ours_compiled: the same with `tiles="compiled"` (`logprobs.tiles`, torch.compile(dynamic=True));
- stock: the full `[N, V]` logits of the LM head (`h @ Wᵀ` in the compute dtype), then TRL's
  `selective_log_softmax` (its Triton log-softmax kernel where Triton runs, else fp32 log_softmax and
  gather row by row), what TRL's trainers did before their fused head;
- trl_fused: TRL's fused LM head kernel (`trl.kernels.ChunkedLogProbFunction`, what DPOTrainer runs
  through `add_fused_lm_head`), log-probs only;
- liger: Liger's fused linear cross-entropy, reduction="none" (log p = -loss), where liger_kernel imports.
A row: hidden and weight in --dtype (as a bf16 model's), random targets, loss = Σ log p, backward to
hidden and weight (their .grad reset each iteration); --warmup untimed iterations (the first one's time
is `first_ms`: compilation included), then the median of --iters timed ones (CUDA synchronised around
each). `peak_extra_gib`: `max_memory_allocated` during one iteration above what was allocated before it
(inputs); CUDA only. `max_dlogp` / `rel_dhidden`: against ours_eager on the same inputs (exactness check).
Ratios against stock: `speed_vs_stock` = stock ms / ms (> 1: faster), `peak_vs_stock`. Writes
<out>/head_speed.json and <out>/head_speed.md; a method that does not run says why in `status`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_blockdiag_cp.logprobs import token_log_probs

METHODS = ("ours_eager", "ours_compiled", "stock", "trl_fused", "liger")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def head_fn(method: str, chunk_size: int | None):
    """`fn(hidden, weight, targets) -> log p [N]` of `method`; raises ImportError where it cannot run."""
    if method in ("ours_eager", "ours_compiled"):
        tiles = method.removeprefix("ours_")
        return lambda h, w, t: token_log_probs(h, w, None, t, chunk_size=chunk_size, tiles=tiles)[0]
    if method == "stock":
        from trl.trainer.utils import selective_log_softmax

        return lambda h, w, t: selective_log_softmax(h @ w.t(), t)
    if method == "trl_fused":
        from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE
        from trl.kernels import ChunkedLogProbFunction

        return lambda h, w, t: ChunkedLogProbFunction.apply(h, w, None, t, 1.0, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                                            ("log_probs",))[0]
    if method == "liger":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        loss = LigerFusedLinearCrossEntropyLoss(reduction="none")

        def liger(h, w, t):
            out = loss(w, h, t)
            return -(out[0] if isinstance(out, tuple) else out)

        return liger
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_step(fn, hidden, weight, targets) -> torch.Tensor:
    hidden.grad = weight.grad = None
    log_probs = fn(hidden, weight, targets)
    log_probs.float().sum().backward()
    return log_probs.detach()


def timed_step(fn, inputs, device) -> float:
    sync(device)
    start = time.perf_counter()
    one_step(fn, *inputs)
    sync(device)
    return (time.perf_counter() - start) * 1e3


def measure(fn, inputs, device, warmup: int, iters: int) -> dict:
    """first_ms, ms (median), peak_extra_gib of `fn` on `inputs`."""
    first = timed_step(fn, inputs, device)
    for _ in range(warmup - 1):
        timed_step(fn, inputs, device)
    times = [timed_step(fn, inputs, device) for _ in range(iters)]
    peak = None
    if device.type == "cuda":
        inputs[0].grad = inputs[1].grad = None
        sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        one_step(fn, *inputs)
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30
    return {"first_ms": round(first, 3), "ms": round(statistics.median(times), 3),
            "peak_extra_gib": None if peak is None else round(peak, 3)}


def make_inputs(tokens: int, hidden_size: int, vocab: int, dtype, device, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, device=device, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, device=device, generator=g) / hidden_size**0.5).to(dtype)
    targets = torch.randint(vocab, (tokens,), device=device, generator=g)
    return hidden, weight.requires_grad_(), targets


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_shape(args, hidden_size: int, tokens: int, device) -> list[dict]:
    inputs = make_inputs(tokens, hidden_size, args.vocab, DTYPES[args.dtype], device)
    rows, reference = [], None
    for method in args.methods:
        row = {"H": hidden_size, "N": tokens, "V": args.vocab, "dtype": args.dtype, "method": method}
        try:
            fn = head_fn(method, args.chunk_size)
            row.update(measure(fn, inputs, device, args.warmup, args.iters))
            log_probs, grad_hidden = one_step(fn, *inputs), inputs[0].grad.clone()
            if method == "ours_eager":
                reference = (log_probs, grad_hidden)
            if reference is not None:
                row["max_dlogp"] = float((log_probs.float() - reference[0].float()).abs().max())
                row["rel_dhidden"] = rel(grad_hidden, reference[1])
            row["status"] = "ok"
        except ImportError as exc:
            row["status"] = f"skipped: {exc}"
        except torch.OutOfMemoryError:
            row["status"] = "oom"
        except Exception as exc:  # a method that fails is a row that says so, not a lost table
            row["status"] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        inputs[0].grad = inputs[1].grad = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        rows.append(row)
    stock = next((r for r in rows if r["method"] == "stock" and r["status"] == "ok"), None)
    for row in rows:
        if stock is not None and row["status"] == "ok":
            row["speed_vs_stock"] = round(stock["ms"] / row["ms"], 3)
            if stock["peak_extra_gib"]:
                row["peak_vs_stock"] = round(row["peak_extra_gib"] / stock["peak_extra_gib"], 3)
    return rows


COLUMNS = ("H", "N", "method", "ms", "speed_vs_stock", "peak_extra_gib", "peak_vs_stock", "first_ms", "max_dlogp",
           "rel_dhidden", "status")


def markdown(rows: list[dict], header: str) -> str:
    def cell(v):
        return "" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)

    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--vocab", type=int, default=128_256)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384, 32768])
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--chunk-size", type=int, default=None, help="our head's rows per tile (default: the library's)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="V=512, H=64, N=300 and 700, 1 warm-up, 3 iterations")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.hidden, args.tokens, args.warmup, args.iters = 512, [64], [300, 700], 1, 3
        args.chunk_size = args.chunk_size or 128  # ragged last tiles
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here (use --device cpu --tiny for the smoke check)")
    rows = [row for h in args.hidden for n in args.tokens for row in run_shape(args, h, n, device)]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"Log-prob head, forward + backward, {name}, {args.dtype}, V = {args.vocab}, torch {torch.__version__}, "
              f"median of {args.iters} after {args.warmup} warm-up")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": name, "torch": torch.__version__, "args": vars(args)}
    (out / "head_speed.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    (out / "head_speed.md").write_text(markdown(rows, header))
    print(markdown(rows, header))


if __name__ == "__main__":
    main()

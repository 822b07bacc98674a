"""`bench model`: a Hugging Face causal LM (default: a 1.2B Llama-architecture config; `--arch
qwen3_5`: a ~1B Qwen3.5-style gated delta-rule hybrid) fwd+bwd on packed batches,
`blockdiag_cp` at cp=1 vs HF `sdpa` vs HF `flex_attention`, one GPU.

Methods: `blockdiag_cp/<kernel>[/<mixer kernel>]` (any attention kernel name or `auto`, and for
hybrids `CPConfig.mixer_backend`, default `auto`; the model patches applied),
`hf_sdpa`, `hf_flex` (the stock model on the same pack with position_ids: exact for attention,
not for a hybrid's linear-attention layers, which run across documents), `hf_sdpa_docs` (the same
with the documents also given as `cu_seq_lens_q/k`, `max_length_q/k` and `seq_idx`, as
`DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True)` gives them, `seq_idx`
only where causal-conv1d is installed, which newer Transformers require for it: a hybrid's fla delta
rule then restarts per document, its torch convolution does not), `hf_padded` (the stock
model with sdpa on the pack's documents unpacked and right-padded, `--padded-tokens` per batch;
tokens/s counts real tokens only); a `+fce` suffix runs the method with Liger's fused linear
cross-entropy as the loss (`integrations.liger`), so HF `flex_attention` + fused CE is the fair
baseline of ours + fused CE.
Reports tokens/s (steady state, median), the first step's time (compilation and plan
building included), peak memory and ours / each baseline per length; optionally the largest
packed length that fits per method. `--compile model|layers` compiles ours and the baselines
alike (`--eager-baselines`: ours only); the rows count what dynamo compiled (`*_later`: after each
method's first step).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import statistics
import sys
import time

import torch

from .. import CPConfig, make_cp_blockdiag_batch_and_ctx
from ..compat.torch import compile_counters
from ..integrations.liger import enable_fused_cross_entropy, fused_cross_entropy_unavailable
from .common import environment, line_plot, lognormal_lengths, markdown_table, profile_table, write_json
from .model_hybrid import CONFIGS, TIMING_DEFAULTS, Models, build_models, padded_batches, padded_step

HF_IMPLS = {"hf_sdpa": "sdpa", "hf_flex": "flex_attention", "hf_padded": "sdpa", "hf_sdpa_docs": "sdpa"}


def document_kwargs(lengths: list[int], device) -> dict:
    """The documents as Transformers' flash-attention and hybrid kernels take them (DataCollatorWithFlattening's
    `return_flash_attn_kwargs=True, return_seq_idx=True`)."""
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    seq_idx = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)])[None].to(device)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest, "seq_idx": seq_idx}


def packed_batch(seq_len: int, vocab: int, mean_doc_len: float, seed: int, device: str):
    lengths = lognormal_lengths(seq_len, mean=mean_doc_len, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (1, seq_len), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return lengths, {"input_ids": ids.to(device), "labels": ids.clone().to(device), "position_ids": pos.to(device)}


def set_fused_cross_entropy(model, on: bool) -> None:
    """Switch the model instance's loss between the stock one and Liger's fused linear cross-entropy."""
    if on:
        if "_fused_forward" not in model.__dict__:
            if not enable_fused_cross_entropy(model):
                raise SystemExit(f"+fce: {fused_cross_entropy_unavailable(model)}")
            model.__dict__["_fused_forward"] = model.__dict__["forward"]  # the instance forward Liger installed
        model.__dict__["forward"] = model.__dict__["_fused_forward"]
    else:
        model.__dict__.pop("forward", None)  # back to the class's forward (stock loss)


def step_fn(models: Models, method: str, lengths: list[int], batch: dict, args):
    """(model, attention implementation, fused CE on?, one fwd+bwd step, row extras) of `method`."""
    base, _, extra = method.partition("+")
    if extra not in ("", "fce"):
        raise SystemExit(f"method {method!r}: the only suffix is +fce (fused linear cross-entropy)")
    fused = extra == "fce"
    if base.startswith("blockdiag_cp"):
        kernel, _, mixer = base.split("/", 1)[1].partition("/")
        config, model = CPConfig(kernel, "allgather", mixer_backend=mixer or "auto"), models.ours

        extras = {"patches": list(models.patches)}

        def run():
            ctx, local, _ = make_cp_blockdiag_batch_and_ctx(None, None, batch, config=config)
            with ctx() as step:
                model(**local).loss.backward()
            model.zero_grad(set_to_none=True)
            if step.choices.mixers:
                extras["mixers"] = step.choices.mixers  # what the token mixers ran (the row shows it)

        return model, "blockdiag_cp", fused, run, extras
    if base not in HF_IMPLS:
        raise SystemExit(f"method {method!r}: expected blockdiag_cp/<kernel>, {', '.join(HF_IMPLS)} (optionally +fce)")
    model, extras = models.stock, {"patches": []}
    if base == "hf_padded":
        budget = batch["input_ids"].shape[1] if args.padded_tokens is None else args.padded_tokens
        batches, weights, padded = padded_batches(lengths, batch["input_ids"], budget)
        inner = padded_step(model, batches, weights)
        extras.update(padded_tokens=padded, padded_batches=len(batches))
    elif base == "hf_sdpa_docs":
        documents = dict(batch, **document_kwargs(lengths, batch["input_ids"].device))
        if importlib.util.find_spec("causal_conv1d") is None:  # newer Transformers refuse seq_idx without it
            documents.pop("seq_idx")
        extras["seq_idx"] = "seq_idx" in documents

        def inner():
            model(**documents).loss.backward()
    else:

        def inner():
            model(**batch).loss.backward()

    def run():
        with models.stock_kernels():
            inner()
        model.zero_grad(set_to_none=True)

    return model, HF_IMPLS[base], fused, run, extras


def _one_step(model, impl: str, fused: bool, run) -> tuple[float, float] | None:
    """(seconds, peak GiB) of one fwd+bwd step, or None if it ran out of memory."""
    cuda = torch.cuda.is_available()
    model.set_attn_implementation(impl)
    set_fused_cross_entropy(model, fused)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        run()
        if cuda:
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        model.zero_grad(set_to_none=True)
        gc.collect()
        torch.cuda.empty_cache()
        return None
    return time.perf_counter() - t0, (torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"))


def measure(models: Models, methods: list[str], seq_len: int, args, on_block=lambda rows: None) -> list[dict]:
    """Every method on the same pack, in blocks of `args.block_steps` consecutive steps, methods
    taking turns for `args.rounds` rounds (ABCABC), so drift hits them alike. The first step of a
    block is not timed: it re-warms the allocator after another method's memory pattern. The very
    first step of a method (compilation, plan building) is reported as `first_s`; steady state is
    the median of the timed steps. Methods in `args.one_block` (slow baselines) get one block.
    After every block, `on_block` gets the rows as measured so far and a progress line goes to stderr,
    so a run cut short by a time limit keeps what it measured."""
    lengths, batch = packed_batch(seq_len, models.stock.config.vocab_size, args.mean_doc_len, args.seed, args.device)
    runs = {m: step_fn(models, m, lengths, batch, args) for m in methods}
    rows = {m: {"method": m, "seq_len": seq_len, "docs": len(lengths), **runs[m][4]} for m in methods}
    times: dict[str, list[float]] = {m: [] for m in methods}
    peaks: dict[str, float] = {m: float("-inf") for m in methods}
    for round_ in range(args.rounds):
        for m in methods:
            if rows[m].get("oom") or (round_ > 0 and m in args.one_block):
                continue
            started = time.perf_counter()
            for i in range(args.block_steps):
                before = compile_counters()
                result = _one_step(*runs[m][:4])
                for key, value in compile_counters().items():
                    rows[m][key] = rows[m].get(key, 0) + value - before.get(key, 0)
                    if round_ or i:  # after the method's first step: should stay 0 (no recompiles)
                        rows[m][f"{key}_later"] = rows[m].get(f"{key}_later", 0) + value - before.get(key, 0)
                if result is None:
                    rows[m]["oom"] = True
                    break
                seconds, peak = result
                peaks[m] = max(peaks[m], peak) if peak == peak else peak  # NaN on CPU
                if round_ == 0 and i == 0:
                    rows[m]["first_s"] = seconds
                elif i > 0:
                    times[m].append(seconds)
            _summarize(rows[m], runs[m][4], times[m], peaks[m])
            print(f"[bench model] {seq_len} {m}: round {round_ + 1}/{args.rounds} in {time.perf_counter() - started:.1f} s"
                  f" (first step {rows[m].get('first_s', float('nan')):.1f} s, timed {[round(t, 3) for t in times[m]]}"
                  f"{', out of memory' if rows[m].get('oom') else ''})", file=sys.stderr, flush=True)
            on_block(list(rows.values()))
    if args.profile:  # one more step per method, after the timed ones (compiled, warm)
        for m in methods:
            if times[m]:
                name = m.replace("/", "_").replace("+", "_")
                profile_table(lambda m=m: _one_step(*runs[m][:4]), f"{args.out}/profile_{seq_len}_{name}.txt", calls=1)
    for row in rows.values():
        print(row, flush=True)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return list(rows.values())


def _summarize(row: dict, recorded: dict, times: list[float], peak: float) -> None:
    """Fill `row` with what the method's steps recorded (e.g. the token mixers that ran) and its
    steady state so far: the median of the timed steps, peak memory, the spread and every step."""
    row.update(recorded)
    if times:
        step_s = statistics.median(times)
        row.update(step_s=step_s, tokens_per_s=row["seq_len"] / step_s, peak_gib=peak,
                   step_spread_s=max(times) - min(times), timed_steps=len(times),
                   steps_s=[round(t, 4) for t in times])  # every timed step, in order (the table shows the median)


def ratios(rows: list[dict]) -> list[dict]:
    """Tokens/s of each `blockdiag_cp` method over each baseline measured at the same length in the same run."""
    out = []
    for seq_len in dict.fromkeys(r["seq_len"] for r in rows):
        rate = {r["method"]: r.get("tokens_per_s") for r in rows if r["seq_len"] == seq_len}
        for ours in (m for m in rate if m.startswith("blockdiag_cp") and rate[m]):
            for base in (m for m in rate if not m.startswith("blockdiag_cp") and rate[m]):
                out.append({"seq_len": seq_len, "ours": ours, "baseline": base, "ratio": rate[ours] / rate[base]})
    return out


def ratio_lines(result: dict) -> str:
    return "\n".join(f"{r['seq_len']}: {r['ours']} / {r['baseline']} = {r['ratio']:.3f}x" for r in result["ratios"])


def run(args, report=lambda result: None) -> dict:
    """Every method at every length, then the largest-fitting search; `report` gets the partial
    result after each method's block of steps, so a run cut short by a time limit keeps what it measured."""
    started = time.perf_counter()
    models = build_models(args)
    print(f"[bench model] models built in {time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    parameters = sum(p.numel() for p in models.stock.parameters())
    result = {"parameters": parameters, "rows": [], "fit_rows": [], "largest_fitting": {}, "ratios": []}
    for s in args.seq_lens:
        done = list(result["rows"])
        rows = measure(models, list(args.methods), s, args,
                       on_block=lambda partial, done=done: report(dict(result, rows=done + partial, ratios=ratios(done + partial))))
        result["rows"].extend(rows)
        result["ratios"] = ratios(result["rows"])
        print(ratio_lines({"ratios": ratios(rows)}), flush=True)
        report(result)
    for method in args.fit_methods:
        result["largest_fitting"][method] = None
        for s in args.fit_lens:
            (row,) = measure(models, [method], s, args)
            result["fit_rows"].append(row)
            if row.get("oom"):
                break
            result["largest_fitting"][method] = s
            report(result)
        report(result)
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="hub id or local path of a config (overrides --arch)")
    p.add_argument("--arch", choices=sorted(CONFIGS), default="llama",
                   help="default config: llama (1.2B Llama), qwen3_5 (~1B Qwen3.5-style gated delta-rule hybrid), "
                        "nemotron_h (~1.2B Nemotron-H-style Mamba2 hybrid), lfm2 (~1.3B LFM2-style short-convolution "
                        "hybrid)")
    p.add_argument("--tiny", action="store_true", help="--arch at toy sizes (CPU smoke runs)")
    p.add_argument("--seq-lens", type=int, nargs="*", default=[16384, 32768, 65536], help="none: only the --fit-methods search")
    p.add_argument("--methods", nargs="+", default=["blockdiag_cp/varlen", "blockdiag_cp/flex", "hf_sdpa", "hf_flex"])
    p.add_argument("--fit-methods", nargs="*", default=[])
    p.add_argument("--fit-lens", type=int, nargs="*", default=[131072, 262144, 524288, 786432])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick compile probes)")
    p.add_argument("--mean-doc-len", type=float, default=2048)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--tiled-mlp", type=int, default=None, metavar="TOKENS",
                   help="ours: run each MLP over tiles of TOKENS rows (integrations.memory.enable_tiled_mlp)")
    p.add_argument("--offload-checkpoints", action="store_true",
                   help="ours: keep checkpointed layer inputs in pinned host memory (enable_checkpoint_offload)")
    p.add_argument("--block-steps", type=int, default=None,
                   help="consecutive steps per method and round (the first untimed); default 3")
    p.add_argument("--rounds", type=int, default=None, help="rounds of blocks, methods taking turns; default 2 (qwen3_5: 1)")
    p.add_argument("--one-block", nargs="*", default=["hf_sdpa"], help="methods measured in the first round only")
    p.add_argument("--padded-tokens", type=int, default=None,
                   help="hf_padded: padded tokens per batch (gradients accumulated); default the pack length; 0: one batch")
    p.add_argument("--stock-delta-rule", choices=["torch", "installed"], default="torch",
                   help="stock model's token-mixer kernels (delta rule, Mamba2 scan): Transformers' torch ones "
                        "(as the patch) or what it picked")
    p.add_argument("--compile", choices=["none", "model", "layers"], default="none",
                   help="torch.compile ours and the stock baselines alike: the whole model or each decoder layer "
                        "(checkpointed layers compile inside their checkpoint; integrations.compile)")
    p.add_argument("--eager-baselines", action="store_true",
                   help="with --compile: compile ours only; the stock baselines run as without it (HF flex compiles its "
                        "attention itself), for baselines whose compiled first step takes too long")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend with --compile (aot_eager: CPU smoke runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", action="store_true", help="one more step per method under the profiler (profile_*.txt)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only for smoke tests of the script")
    p.add_argument("--out", default="bench_out")


COLUMNS = ["seq_len", "docs", "method", "first_s", "step_s", "step_spread_s", "timed_steps", "tokens_per_s", "peak_gib", "oom",
           "frames_compiled", "graphs_compiled", "graphs_compiled_later", "padded_tokens", "mixers"]


TITLES = {"llama": "1.2B Llama-architecture", "qwen3_5": "~1B Qwen3.5-style hybrid", "nemotron_h": "~1.2B Nemotron-H-style hybrid",
          "lfm2": "~1.3B LFM2-style hybrid"}


def _write(args, result) -> str:
    table = markdown_table(result["rows"] + result["fit_rows"], COLUMNS)
    footer = "ours / baselines (tokens/s):\n" + ratio_lines(result)
    footer += "\n\nlargest fitting pack: " + str(result["largest_fitting"])
    write_json(f"{args.out}/model.json", {"env": environment(), "args": vars(args), **result})
    with open(f"{args.out}/model.md", "w") as f:
        f.write(table + "\n\n" + footer + "\n")
    return table + "\n" + footer


def dynamo_settings(args) -> contextlib.AbstractContextManager:
    """With --compile, the methods share one model object and switch its attention implementation, so each
    adds cache entries to the same compiled code: room for them, and a loud error instead of a silent fall
    back to eager if they still run out. Restored when the run ends."""
    if args.compile == "none":
        return contextlib.nullcontext()
    config = torch.compiler.config
    return config.patch(recompile_limit=max(config.recompile_limit, 64), fail_on_recompile_limit_hit=True)


def main(args) -> None:
    if args.eager_baselines and args.compile == "none":
        raise SystemExit("--eager-baselines: expected --compile model or layers (it keeps the baselines out of it)")
    with dynamo_settings(args):
        _main(args)


def _main(args) -> None:
    block_steps, rounds = TIMING_DEFAULTS[args.arch]
    args.block_steps = block_steps if args.block_steps is None else args.block_steps
    args.rounds = rounds if args.rounds is None else args.rounds
    result = run(args, report=lambda partial: _write(args, partial))
    print(_write(args, result))
    title = f"{args.model or TITLES[args.arch]} model, one GPU, cp=1"
    if args.compile != "none":
        title += f", torch.compile ({args.compile}{', ours only' if args.eager_baselines else ''})"
    line_plot(result["rows"], "tokens_per_s", "tokens/s (fwd+bwd)", title, f"{args.out}/model.png")

"""DPO training steps, one GPU, same run: `BlockdiagCPDPOTrainer` (the step's pairs packed padding-free
in one pack, cp_size=1) against TRL's own `DPOTrainer` (the same pairs in one padded batch), on the
~1.2B Llama and ~1.13B Qwen3.5 configs of `bench model` (`CONFIGS`), random init, no downloads.

    timeout 570 python benchmarks/dpo_speed.py --out bench_out/dpo_speed        # one H200
    python benchmarks/dpo_speed.py --tiny --out /tmp/dpo_speed_tiny               # CPU smoke check, < 1 min

On the H200: packages from shared/device/activate.sh, the repository root on PYTHONPATH. A model and
method's first row compiles and autotunes (HF flex_attention 150-200 s, fla's TileLang and autotuning
100-155 s: docs/performance.md), so a cold default run ends (--budget-s) after the Llama rows and their
longest-pack search, the Qwen3.5 rows skipped: run `--models qwen3_5` as a second command.

A step: policy forward + reference forward + backward + clipping + optimizer step, timed by a callback
syncing CUDA at `on_step_begin` / `on_step_end` (the dataloader's packing or padding comes before, the
dataset and trainer construction before training: not counted). Both methods: the model built on the
GPU in bf16 (weights, gradients and Adam states, as `bench model`; `--tiny`: toy configs, CPU, fp32),
DPOConfig(bf16, non-reentrant activation checkpointing, adamw_torch lr 1e-6, max_grad_norm 1, sigmoid,
beta 0.1, logging_steps 1, no saving, report_to none, max_length >= every sequence: none truncated),
the reference a copy of the policy (loss log 2; the work is any reference's); each row a fresh policy,
reference and trainer, the CUDA cache emptied after it.
- ours: BlockdiagCPDPOTrainer(cp_size=1, max_tokens=S, CPConfig(attn_backend=--attn-backend, auto: FA4
  where available)): one pack of exactly S tokens per step, log-probs in token chunks (no logits).
- trl: trl.DPOTrainer, the stock model at the first of --trl-attn that runs (flex_attention, then sdpa;
  Qwen3.5 has no flex), batch = the P pairs: 2P rows right-padded to the longest; TRL's fused LM head;
  the hybrid layers run what Transformers picks (fla where installed).
Pairs: sequence lengths log-normal (mean --mean-len, sigma 1, cap --max-length) summing to exactly S
(real tokens, both sequences of every pair), the prompt (half the shorter sequence) shared by the pair.

Columns: model (parameters), method, attn (ours: kernel and token mixers its step ran; trl: the
attn_implementation), S (real tokens per step), pairs, longest (sequence), computed (tokens the model
runs on: S, or 2P x longest for trl), first_s (first step: compilation, autotuning), step_s (median of
the --steps timed steps after it), timed, tokens_per_s (S / step_s), peak_gib (max_memory_allocated over
the row: weights, reference, gradients, Adam states, activations), status (ok, oom, error, skipped).
Ratios: ours / trl tokens/s and peak memory per model and S. Longest pack (--longest-models): S ascending
from above the largest main row that ran (--longest-ours, --longest-trl), one step each, until one does
not run. Time: a row starts only if expected to end within --budget-s (--first-row-s for a model and
method's first row, else its step time scaled in S); its timed steps stop after --row-budget-s. A line
per step (flushed) and <out>/dpo_speed.json after each row: a run cut short keeps what it measured.
"""

from __future__ import annotations

# ruff: noqa: E402  (the clock starts before the imports)
import os
import time

STARTED = time.perf_counter()  # --budget-s counts from here, the imports included
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # fla's autotuning kept on disk for a later run

import argparse
import sys

import speed_rows  # same folder: the trainer benchmarks' models, data, trainers and timer
from hf_blockdiag_cp.bench.common import markdown_table
from speed_rows import (
    ROW_OVERHEAD_S, add_run_arguments, dpo_trainer, environment, expected_s, finish_run_arguments, log, model_config,
    pair_examples, parameters, skipped, train_row, write_outputs,
)

speed_rows.configure("dpo_speed", STARTED)
COLUMNS = ["model", "method", "attn", "S", "pairs", "longest", "computed", "first_s", "step_s", "timed", "tokens_per_s",
           "peak_gib", "status"]


def keys(args, name: str, method: str) -> list[dict]:
    """The rows whose step time predicts a row's (`expected_s`): the model and method's."""
    return [{"model": args.labels[name], "method": method}]


def run_row(args, history: list[dict], name: str, method: str, S: int, attn: str, steps: int) -> dict:
    """One (model, method, S) row: a fresh policy, reference and trainer, `steps` optimizer steps (the
    first untimed), OOM and other failures recorded in `status`; the device cleaned up afterwards.
    Skipped when it is not expected to end within --budget-s (`history`: the rows so far)."""
    rows = pair_examples(S, args.mean_len, args.max_length, model_config(name, args).vocab_size, seed=args.seed)
    lengths = [len(r["prompt_ids"]) + len(r[k]) for r in rows for k in ("chosen_ids", "rejected_ids")]
    row = {"model": args.labels[name], "method": method, "attn": attn, "S": S, "pairs": len(rows),
           "longest": max(lengths), "computed": S if method == "ours" else len(lengths) * max(lengths)}
    status = skipped(args, history, keys(args, name, method), S, steps)
    if status:
        return dict(row, status=status)
    label = f"{name} {method} ({attn}) S={S}"
    log(f"{label}: {len(rows)} pairs, longest {max(lengths)}, {steps} step(s)")
    train_row(args, row, label, S, lambda timer, workdir: dpo_trainer(args, name, method, attn, rows, S, steps, timer,
                                                                      workdir))
    log(f"{label}: {row['status']}, first {row.get('first_s', float('nan')):.2f} s, steps {row.get('steps_s')}, "
        f"{row.get('tokens_per_s', float('nan')):,.0f} tokens/s, peak {row.get('peak_gib', float('nan')):.1f} GiB, "
        f"first loss {row.get('loss')}")
    return row


def ratios(rows: list[dict], labels: list[str], sizes: list[int]) -> list[dict]:
    """Per model and S: ours / trl tokens/s and peak memory where both ran timed steps, else what each did."""
    out = []
    for label in labels:
        for S in sizes:
            runs = {m: [r for r in rows if (r["model"], r["method"], r["S"]) == (label, m, S)] for m in ("ours", "trl")}
            ours, trl = (next((r for r in runs[m] if r.get("tokens_per_s")), None) for m in ("ours", "trl"))
            entry = {"model": label, "S": S}
            if ours and trl:
                entry.update(ours_tokens_per_s=ours["tokens_per_s"], trl_tokens_per_s=trl["tokens_per_s"],
                             ours_over_trl=ours["tokens_per_s"] / trl["tokens_per_s"])
                if "peak_gib" in ours and "peak_gib" in trl:
                    entry["peak_ours_over_trl"] = ours["peak_gib"] / trl["peak_gib"]
            else:
                entry["note"] = "; ".join(f"{m}: {', '.join(r['status'] for r in runs[m]) or 'not run'}" for m in runs)
            out.append(entry)
    return out


def method_rows(args, history: list[dict], name: str, method: str, S: int, steps: int) -> list[dict]:
    """The method's row(s) at S (`speed_rows.method_rows`: trl's attentions tried in turn)."""
    return speed_rows.method_rows(args, history, name, method, S, steps, run=run_row)


def grid(args, result: dict, name: str, save) -> None:
    for S in args.seq_lens:
        for method in args.methods:
            result["rows"].extend(method_rows(args, result["rows"] + result["fit_rows"], name, method, S, 1 + args.steps))
            save(result)


def longest(args, result: dict, name: str, save) -> None:
    """Per method: S ascending from above the largest main row that ran, one step each, until one does
    not run, or one step is expected to take over --row-budget-s, or the run over --budget-s."""
    label = args.labels[name]
    for method, sizes in (("ours", args.longest_ours), ("trl", args.longest_trl)):
        if method not in args.methods:
            continue
        known = [r for r in result["rows"] if r["model"] == label and r["method"] == method]
        failed = [r for r in known if r["status"] == "oom"]
        entry = {"largest_ran": max((r["S"] for r in known if r["status"] == "ok"), default=None),
                 "first_failed": min((r["S"] for r in failed), default=None),
                 "why": failed[0]["status"] if failed else None, "tried": []}
        for S in sorted(s for s in sizes if s > (entry["largest_ran"] or 0)):
            if entry["first_failed"] is not None and S >= entry["first_failed"]:
                break
            one_step = expected_s(args, result["rows"] + result["fit_rows"], keys(args, name, method), S, 1) - ROW_OVERHEAD_S
            if one_step > args.row_budget_s:
                entry.update(why=f"skipped: S={S}, one step ~{one_step:.0f} s expected, over --row-budget-s")
                break
            rows = method_rows(args, result["rows"] + result["fit_rows"], name, method, S, 1)
            result["fit_rows"].extend(rows)
            status = rows[-1]["status"]
            if status != "ok":
                entry.update(why=status, **({} if status.startswith("skipped") else {"first_failed": S}))
            if not status.startswith("skipped"):
                entry["tried"].append(S)
            if status != "ok":
                break
            entry["largest_ran"] = S
        result["longest"][f"{label} {method}"] = entry
        save(result)


def report(args, result: dict) -> str:
    env = result["env"]
    lines = [f"DPO steps, one {env.get('device', 'CPU')}, cp=1, {args.dtype} weights, activation checkpointing, adamw_torch, "
             f"sequences log-normal mean {args.mean_len:g} (cap {args.max_length}), S = real tokens per optimizer step; "
             f"ours = BlockdiagCPDPOTrainer (one pack), trl = trl.DPOTrainer (one padded batch); torch {env['torch']}, "
             f"transformers {env['transformers']}, trl {env['trl']}, {env['date']}", "",
             markdown_table(result["rows"] + result["fit_rows"], COLUMNS), "", "ours / trl (same model, same pairs):", "",
             markdown_table(result["ratios"], ["model", "S", "ours_tokens_per_s", "trl_tokens_per_s", "ours_over_trl",
                                               "peak_ours_over_trl", "note"])]
    if result["longest"]:
        longest_rows = [{"model_method": k, **v} for k, v in result["longest"].items()]
        lines += ["", "longest pack that ran one step:", "",
                  markdown_table(longest_rows, ["model_method", "largest_ran", "first_failed", "why", "tried"])]
    return "\n".join(lines)


def save(args, result: dict) -> str:
    """Ratios, then <out>/dpo_speed.json and .md as measured so far; returns the tables."""
    result["ratios"] = ratios(result["rows"], list(args.labels.values()), args.seq_lens)
    return write_outputs(args, "dpo_speed", result, report(args, result))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p, budget_s=520.0, out="bench_out/dpo_speed")
    p.add_argument("--methods", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="S, real tokens per step (default 16384 65536)")
    p.add_argument("--longest", choices=["on", "off"], default="on", help="search the longest pack that runs a step")
    p.add_argument("--longest-models", nargs="*", choices=["llama", "qwen3_5"], default=["llama"])
    p.add_argument("--longest-ours", type=int, nargs="*", default=None, help="default 131072 262144 524288")
    p.add_argument("--longest-trl", type=int, nargs="*", default=None, help="default 32768 65536 131072")
    p.add_argument("--mean-len", type=float, default=None, help="mean sequence length, prompt + completion (2048)")
    p.add_argument("--max-length", type=int, default=None, help="cap of a sequence's length and DPOConfig.max_length (8192)")
    p.add_argument("--trl-attn", nargs="+", default=None, help="trl: attn_implementations tried in turn")
    args = p.parse_args(argv)
    cuda = finish_run_arguments(args, STARTED)
    defaults = (dict(seq_lens=[512, 1024], longest_ours=[2048, 4096], longest_trl=[2048], mean_len=64.0, max_length=256)
                if args.tiny else dict(seq_lens=[16384, 65536], longest_ours=[131072, 262144, 524288],
                                       longest_trl=[32768, 65536, 131072], mean_len=2048.0, max_length=8192))
    defaults["trl_attn"] = ["flex_attention", "sdpa"] if cuda else ["sdpa"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.longest == "off":
        args.longest_models = []
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.labels = {name: f"{name} {parameters(name, args) / 1e9:.3g}B" for name in args.models}
    env = environment()
    result = {"env": env, "rows": [], "fit_rows": [], "longest": {}, "ratios": []}
    log(f"{args.device} {env.get('device', '')}: models {args.labels}, S {args.seq_lens}, methods {args.methods}")
    for name in args.models:  # each model's main rows, then its longest-pack search
        grid(args, result, name, lambda r: save(args, r))
        if name in args.longest_models:
            longest(args, result, name, lambda r: save(args, r))
    print(save(args, result), flush=True)
    log(f"done; {args.out}/dpo_speed.json")


if __name__ == "__main__":
    sys.exit(main())

"""GRPO training steps on injected completions, one GPU, same run: `BlockdiagCPGRPOTrainer` (the step's
prompt + completion rows packed padding-free in one pack, cp_size=1) against TRL's own `GRPOTrainer`
(the same rows padded), on the ~1.2B Llama and ~1.13B Qwen3.5 configs of `bench model`, random init.

    timeout 570 python benchmarks/grpo_speed.py --models llama --out bench_out/grpo_speed     # one H200
    python benchmarks/grpo_speed.py --tiny --out /tmp/grpo_speed_tiny                           # CPU smoke check

Generation is out of the comparison: both trainers get the same completions from an override of
`_generate_single_turn` (random tokens, no EOS), so a step is TRL's scoring of the injected rows, the
loss forward with the chunked or fused LM head, the backward and the optimizer step (beta 0, one
iteration: no reference or old-policy forward). A step's N completions (--completions) have
lengths evenly spread from C/N to C (C = --max-completion, the row's size: 8k or 32k), after a
prompt of --prompt tokens, as RL batches mix short and long answers; TRL pads every row to the
longest. The trainers, timing and OOM handling are `speed_rows.py`'s, as for `dpo_speed.py`;
columns: model, method, attn, C, rows, tokens (real tokens per step), computed (tokens the model
runs on), first_s, step_s, timed, tokens_per_s (real tokens / step_s), peak_gib, status.
GRPOConfig: bf16, non-reentrant activation checkpointing, adamw_torch lr 1e-6, max_grad_norm 1,
loss_type dapo, num_generations = --completions (one prompt per step), logging_steps 1.
"""

from __future__ import annotations

# ruff: noqa: E402
import os
import time

STARTED = time.perf_counter()
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import argparse
import logging
import sys

import speed_rows  # same folder: the trainer benchmarks' models, data, trainers and timer
from hf_blockdiag_cp.bench.common import markdown_table
from speed_rows import (
    add_run_arguments, environment, finish_run_arguments, grpo_trainer, log, skipped, spread_lengths, train_row,
    write_outputs,
)

speed_rows.configure("grpo_speed", STARTED)
COLUMNS = ["model", "method", "attn", "C", "rows", "tokens", "computed", "first_s", "step_s", "timed", "tokens_per_s",
           "peak_gib", "status"]


def run_row(args, history: list[dict], name: str, method: str, C: int, attn: str, steps: int) -> dict:
    lengths = spread_lengths(C, args.completions)
    tokens = sum(lengths) + args.prompt * len(lengths)
    row = {"model": args.labels[name], "method": method, "attn": attn, "C": C, "rows": len(lengths), "tokens": tokens,
           "S": tokens, "computed": tokens if method == "ours" else len(lengths) * (args.prompt + C)}
    status = skipped(args, history, [{"model": args.labels[name], "method": method}], tokens, steps)
    if status:
        return dict(row, status=status)
    label = f"{name} {method} ({attn}) C={C}"
    log(f"{label}: {len(lengths)} completions, {tokens} tokens, {steps} step(s)")
    train_row(args, row, label, tokens, lambda timer, workdir: grpo_trainer(args, name, method, attn, lengths, steps,
                                                                           timer, workdir))
    log(f"{label}: {row['status']}, steps {row.get('steps_s')}, {row.get('tokens_per_s', float('nan')):,.0f} "
        f"tokens/s, peak {row.get('peak_gib', float('nan')):.1f} GiB")
    return row


def ratios(rows: list[dict], labels: list[str], sizes: list[int]) -> list[dict]:
    out = []
    for label in labels:
        for C in sizes:
            ours, theirs = (next((r for r in rows if (r["model"], r["method"], r["C"]) == (label, m, C)
                                  and r.get("tokens_per_s")), None) for m in ("ours", "trl"))
            entry = {"model": label, "C": C}
            if ours and theirs:
                entry.update(ours_over_trl=ours["tokens_per_s"] / theirs["tokens_per_s"],
                             peak_ours_over_trl=ours.get("peak_gib", float("nan")) / theirs.get("peak_gib", float("nan")))
            else:
                entry["note"] = "; ".join(f"{m}: {', '.join(r['status'] for r in rows if (r['model'], r['method'], r['C']) == (label, m, C)) or 'not run'}"
                                          for m in ("ours", "trl"))
            out.append(entry)
    return out


def save(args, result: dict) -> str:
    result["ratios"] = ratios(result["rows"], list(args.labels.values()), args.max_completions)
    env = result["env"]
    return write_outputs(args, "grpo_speed", result, "\n".join([
        f"GRPO steps on injected completions, one {env.get('device', 'CPU')}, cp=1, {args.dtype}, activation "
        f"checkpointing, {args.completions} completions of C/{args.completions}..C tokens after a {args.prompt}-token "
        f"prompt; torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, {env['date']}", "",
        markdown_table(result["rows"], COLUMNS), "", "ours / trl:", "",
        markdown_table(result["ratios"], ["model", "C", "ours_over_trl", "peak_ours_over_trl", "note"])]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p, budget_s=540.0, out="bench_out/grpo_speed")
    p.add_argument("--methods", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--max-completions", type=int, nargs="+", default=None, help="C, the longest completion (8192 32768)")
    p.add_argument("--completions", type=int, default=8, help="completions per step (one prompt's group)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (256)")
    p.add_argument("--trl-attn", nargs="+", default=None, help="trl: attn_implementations tried in turn")
    args = p.parse_args(argv)
    cuda = finish_run_arguments(args, STARTED)
    if args.max_completions is None:
        args.max_completions = [64, 256] if args.tiny else [8192, 32768]
    if args.prompt is None:
        args.prompt = 16 if args.tiny else 256
    if args.trl_attn is None:
        args.trl_attn = ["flex_attention", "sdpa"] if cuda else ["sdpa"]
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_blockdiag_cp").setLevel(logging.INFO)  # the kernel and token mixers each step runs
    args.labels = {name: f"{name} {speed_rows.parameters(name, args) / 1e9:.3g}B" for name in args.models}
    result = {"env": environment(), "rows": []}
    log(f"{args.device}: models {args.labels}, C {args.max_completions}, methods {args.methods}")
    for name in args.models:
        for C in args.max_completions:
            for method in args.methods:
                rows = speed_rows.method_rows(args, result["rows"], name, method, C, 1 + args.steps, run=run_row)
                result["rows"].extend(rows)
                save(args, result)
    print(save(args, result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

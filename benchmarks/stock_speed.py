"""Training steps where packing saves nothing, one GPU, same run: this library's trainers at cp_size=1 (the
step's sequences in one padding-free pack) against the stock Transformers / TRL trainers (the same
sequences in one padded batch), for SFT, DPO, reward and GRPO, on the ~1.2B Llama and ~1.13B Qwen3.5
configs of `bench model`, random init, no downloads. In the `equal` mix every sequence has the same
length, so the stock batch holds no padding and its SDPA runs the flash kernel: what is left is each
side's own cost of a step.

    timeout 570 python benchmarks/stock_speed.py --models llama --tasks sft dpo --out bench_out/stock   # one GPU
    python benchmarks/stock_speed.py --tiny --out /tmp/stock_speed_tiny     # CPU smoke check, < 2 min
    ... --profile llama:dpo:equal:2048:ours llama:dpo:equal:2048:trl      # those rows only, one step profiled

On the GPU: packages from shared/device/activate.sh, the repository root on PYTHONPATH; split the grid
over calls with --models / --tasks / --mixes / --seq-lens / --methods (a model and method's first row
compiles and autotunes: FA4, fla, flex_attention), then `--merge A/stock_speed.json B/stock_speed.json
--out DIR` writes their rows as one table.

A step: one optimizer step (forward, backward, clipping, AdamW), timed by a callback syncing CUDA at
`on_step_begin` / `on_step_end` (batch collation before it; dataset and trainer construction before
training: not counted); for DPO the reference forward too, for GRPO the scoring of injected completions
(no generation: `speed_rows.Injected`). Both methods: the model built on the device in bf16 (`--tiny`:
toy configs, CPU, fp32), bf16 on, non-reentrant activation checkpointing, adamw_torch lr 1e-6,
max_grad_norm 1, one micro-batch per step, a fresh model and trainer per row (`speed_rows`).
- sft: ours = BlockdiagCPSFTTrainer (SFTConfig packing, max_length = S: TRL's one pack; the model's own
  loss), ours_fce = the same with Liger's fused linear cross-entropy (skipped where Liger cannot run),
  ours_trainer = BlockdiagCPTrainer (the Transformers Trainer path, max_tokens = S); trl = trl.SFTTrainer
  on the documents padded (packing and padding_free off), its fused LM head. Every token a target.
- dpo: BlockdiagCPDPOTrainer against trl.DPOTrainer as in dpo_speed.py (sigmoid, beta 0.1, the
  reference a copy of the policy). reward: BlockdiagCPRewardTrainer against trl.RewardTrainer, the
  sequence-classification model of the same config (one label). grpo: BlockdiagCPGRPOTrainer against
  trl.GRPOTrainer as in grpo_speed.py (beta 0, dapo, one group of completions a step).
- ours: one pack of exactly S tokens (pairs: `speed_rows.pair_batching`), CPConfig(attn_backend=
  --attn-backend); trl: the first of --trl-attn-equal / --trl-attn-lognormal that runs (all of them with
  --trl-attn-all; the ratio then against the fastest).
Data per (task, mix, L): `equal`: S / L sequences of exactly L tokens, S = --step-tokens, else the
least multiple of L (of 2L for pairs) from max(--min-step-tokens, 4L); pairs share a prompt of L/2;
GRPO: a --prompt-token prompt and completions of L - prompt. `lognormal` (the mix of dpo_speed.py and
grpo_speed.py; L from --lognormal-lens): lengths log-normal, mean L/4, sigma 1, capped at L, summing to
S = max(--min-step-tokens, 2L) (at L = 8192: dpo_speed.py's S = 16,384 pairs); GRPO: grpo_speed.py's
--completions completions of L/n, 2L/n, ..., L tokens after the prompt.

Columns: model (parameters), task, mix, seq_len (L), S (real tokens per step, the same for both methods),
sequences (pairs for dpo and reward), longest, computed (tokens the model runs on: S, or rows x longest
padded), method, attn (what ran: ours' kernel and token mixers, trl's attn_implementation), tokens_per_s
(S / step_s), step_s (median of the --steps timed steps after the first), first_s (first step:
compilation, autotuning), peak_gib (max_memory_allocated over the row), status (ok, oom, error, skipped).
Ratios: each ours method over trl, tokens/s and peak memory, per (model, task, mix, L). A row starts only
if expected to end within --budget-s; a line per step (flushed) and <out>/stock_speed.json and .md after
each row: a run cut short keeps what it measured. --profile MODEL:TASK:MIX:L:METHOD runs those rows
only, one more step, profiled (`step_profile.py`: GPU time per operator, host-device syncs and their
call sites) into <out>/profile_<row>.txt and left out of the timing.
"""

from __future__ import annotations

# ruff: noqa: E402  (the clock starts before the imports)
import os
import time

STARTED = time.perf_counter()  # --budget-s counts from here, the imports included
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # fla's autotuning kept on disk for a later run

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from transformers import TrainingArguments
from trl import RewardConfig, RewardTrainer, SFTConfig, SFTTrainer

import speed_rows  # same folder: the trainer benchmarks' models, data, trainers and timer
from hf_blockdiag_cp import BlockdiagCPTrainer, CPConfig
from hf_blockdiag_cp.bench.common import markdown_table
from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy, fused_cross_entropy_unavailable
from hf_blockdiag_cp.integrations.trl import BlockdiagCPRewardTrainer, BlockdiagCPSFTTrainer
from speed_rows import (
    add_run_arguments, build_model, dpo_trainer, environment, finish, finish_run_arguments, grpo_trainer, log,
    model_config, one_pack, pair_batching, pair_examples, random_ids, run_fields, sequence_lengths, skipped,
    spread_lengths, tokenizer, train_row, write_outputs,
)
from step_profile import ProfileStep

speed_rows.configure("stock_speed", STARTED)
TASKS = ("sft", "dpo", "reward", "grpo")
MIXES = ("equal", "lognormal")
PAIRED = ("dpo", "reward")
METHODS = {"sft": ("ours", "ours_fce", "ours_trainer", "trl")}  # the other tasks: ours and trl
COLUMNS = ["model", "task", "mix", "seq_len", "S", "sequences", "longest", "computed", "method", "attn", "tokens_per_s",
           "step_s", "first_s", "peak_gib", "status"]
RATIO_COLUMNS = ["model", "task", "mix", "seq_len", "method", "trl_attn", "ours_tokens_per_s", "trl_tokens_per_s",
                 "ours_over_trl", "peak_ours_over_trl", "note"]


def step_tokens(args, task: str, mix: str, L: int) -> int:
    """S of an SFT, DPO or reward row: --step-tokens, else (equal) the least multiple of L (2L for pairs)
    from max(--min-step-tokens, 4L), or (lognormal) max(--min-step-tokens, 2L)."""
    if args.step_tokens:
        return args.step_tokens
    if mix == "lognormal":
        return max(args.min_step_tokens, 2 * L)
    unit = 2 * L if task in PAIRED else L
    return -(-max(args.min_step_tokens, 4 * L) // unit) * unit


def row_data(args, name: str, task: str, mix: str, L: int) -> dict:
    """The step's data: `seqs` (every sequence's length, prompt included), `data` (SFT documents, pairs, or
    GRPO completion lengths) and S, its real tokens."""
    if task == "grpo":
        if mix == "equal" and L <= args.prompt:
            raise SystemExit(f"--seq-lens {L}: GRPO's sequences hold the {args.prompt}-token prompt (--prompt)")
        lengths = ([L - args.prompt] * (step_tokens(args, task, mix, L) // L) if mix == "equal"
                   else spread_lengths(L, args.completions))
        seqs = [args.prompt + n for n in lengths]
        return dict(seqs=seqs, data=lengths, S=sum(seqs))
    S, vocab = step_tokens(args, task, mix, L), model_config(name, args).vocab_size
    if mix == "equal" and S % (2 * L if task in PAIRED else L):
        raise SystemExit(f"--step-tokens {S}: not a whole number of {task} {'pairs' if task in PAIRED else 'sequences'}"
                         f" of {L} tokens")
    if task in PAIRED:
        rows = (speed_rows.pairs_of([L] * (S // L), vocab, args.seed) if mix == "equal"
                else pair_examples(S, L / 4, L, vocab, seed=args.seed))
        seqs = [len(r["prompt_ids"]) + len(r[k]) for r in rows for k in ("chosen_ids", "rejected_ids")]
        return dict(seqs=seqs, data=rows, S=S)
    seqs = [L] * (S // L) if mix == "equal" else sequence_lengths(S, L / 4, L, seed=args.seed)
    ids = random_ids(vocab, args.seed)
    return dict(seqs=seqs, data=[{"input_ids": ids(n)} for n in seqs], S=S)


def sft_trainer(args, name: str, method: str, attn: str, docs: list[dict], S: int, steps: int, timer, workdir: str):
    """SFT on `docs`, every token a target: ours TRL's one pack of S tokens, ours_trainer the Trainer's, trl
    the documents padded to the longest (TRL's fused LM head)."""
    ours = method != "trl"
    model = build_model(name, "blockdiag_cp" if ours else attn, args)
    if method == "ours_fce" and not enable_fused_cross_entropy(model):
        raise RuntimeError("Liger's fused cross-entropy did not apply")
    cp = dict(cp_size=1, cp_config=CPConfig(attn_backend=attn))
    if method == "ours_trainer":
        config = TrainingArguments(**run_fields(args, workdir, steps, 1), remove_unused_columns=False)
        return finish(one_pack(BlockdiagCPTrainer(model=model, args=config, train_dataset=docs, max_tokens=S,
                                                  callbacks=[timer], **cp), S))
    longest = max(len(d["input_ids"]) for d in docs)
    config = SFTConfig(**run_fields(args, workdir, steps, 1 if ours else len(docs)), packing=ours, padding_free=False,
                       max_length=S if ours else longest)
    common = dict(model=model, args=config, train_dataset=speed_rows.dataset(docs, "speed_docs"),
                  processing_class=tokenizer(), callbacks=[timer])
    return finish(one_pack(BlockdiagCPSFTTrainer(**common, **cp), S) if ours else SFTTrainer(**common))


def reward_trainer(args, name: str, method: str, attn: str, rows: list[dict], S: int, steps: int, timer,
                   workdir: str):
    """Reward model training on `rows` (prompt + chosen, prompt + rejected): ours one pack of S tokens, trl the
    2P sequences padded to the longest."""
    pairs = [{"chosen_ids": r["prompt_ids"] + r["chosen_ids"], "rejected_ids": r["prompt_ids"] + r["rejected_ids"]}
             for r in rows]
    longest = max(len(p[k]) for p in pairs for k in p)
    ours = method == "ours"
    batch, extra = pair_batching(BlockdiagCPRewardTrainer, len(pairs)) if ours else (len(pairs), {})
    config = RewardConfig(**run_fields(args, workdir, steps, batch), max_length=longest)
    common = dict(model=build_model(name, "blockdiag_cp" if ours else attn, args, reward=True), args=config,
                  train_dataset=speed_rows.dataset(pairs, "speed_reward"), processing_class=tokenizer(),
                  callbacks=[timer])
    if ours:
        return finish(one_pack(BlockdiagCPRewardTrainer(**common, **extra, cp_size=1, max_tokens=S,
                                                        cp_config=CPConfig(attn_backend=attn)), S))
    return finish(RewardTrainer(**common))


def maker(args, name: str, task: str, method: str, attn: str, spec: dict, steps: int):
    """`make(timer, workdir)`: the row's trainer."""
    if task == "grpo":
        return lambda timer, workdir: grpo_trainer(args, name, method, attn, spec["data"], steps, timer, workdir)
    build = {"sft": sft_trainer, "dpo": dpo_trainer, "reward": reward_trainer}[task]
    return lambda timer, workdir: build(args, name, method, attn, spec["data"], spec["S"], steps, timer, workdir)


def run_row(args, history: list[dict], name: str, task: str, mix: str, L: int, spec: dict, method: str, attn: str,
            steps: int) -> dict:
    """One (model, task, mix, L, method) row; skipped where not expected to end within --budget-s or where
    ours_fce cannot run; profiled (one more step) where --profile names it."""
    seqs, S, label = spec["seqs"], spec["S"], args.labels[name]
    row = {"model": label, "task": task, "mix": mix, "seq_len": L, "S": S, "sequences": len(seqs),
           "longest": max(seqs), "computed": S if method != "trl" else len(seqs) * max(seqs), "method": method,
           "attn": attn}
    if task in PAIRED:
        row["sequences"] = f"{len(seqs) // 2} pairs"
    model = SimpleNamespace(config=model_config(name, args))  # what Liger's check reads: the model type
    why = fused_cross_entropy_unavailable(model) if method == "ours_fce" else None
    status = f"skipped: {why}" if why else skipped(args, history, [{"model": label, "method": method, "task": task},
                                                                   {"model": label, "method": method}], S, steps)
    if status:
        return dict(row, status=status)
    tag = f"{name}:{task}:{mix}:{L}:{method}"
    callbacks, untimed = (), ()
    if tag in args.profile:
        steps += 1
        path = f"{args.out}/profile_{tag.replace(':', '_')}.txt"
        callbacks, untimed = [ProfileStep(steps, path, f"{tag} ({attn}), S={S}")], (steps,)
        row["profile"] = path
    log(f"{tag} ({attn}): S={S}, {len(seqs)} sequences, longest {max(seqs)}, {steps} step(s)")
    train_row(args, row, f"{tag} ({attn})", S, maker(args, name, task, method, attn, spec, steps), callbacks, untimed)
    if callbacks and callbacks[0].summary:
        summary = callbacks[0].summary
        row.update(gpu_ms=summary["gpu_ms"], syncs=summary["syncs"], sync_counts=summary["counts"])
    log(f"{tag} ({row['attn']}): {row['status']}, first {row.get('first_s', float('nan')):.2f} s, steps "
        f"{row.get('steps_s')}, {row.get('tokens_per_s', float('nan')):,.0f} tokens/s, peak "
        f"{row.get('peak_gib', float('nan')):.1f} GiB, first loss {row.get('loss')}")
    return row


def ratios(rows: list[dict]) -> list[dict]:
    """Per (model, task, mix, L) and ours method: its tokens/s and peak memory over trl's fastest row."""
    out = []
    for key in dict.fromkeys((r["model"], r["task"], r["mix"], r["seq_len"]) for r in rows):
        group = [r for r in rows if (r["model"], r["task"], r["mix"], r["seq_len"]) == key]
        stock = max((r for r in group if r["method"] == "trl" and r.get("tokens_per_s")),
                    key=lambda r: r["tokens_per_s"], default=None)
        for method in dict.fromkeys(r["method"] for r in group if r["method"] != "trl"):
            ours = next((r for r in group if r["method"] == method and r.get("tokens_per_s")), None)
            entry = dict(zip(("model", "task", "mix", "seq_len"), key), method=method)
            if ours and stock:
                entry.update(trl_attn=stock["attn"], ours_tokens_per_s=ours["tokens_per_s"],
                             trl_tokens_per_s=stock["tokens_per_s"],
                             ours_over_trl=ours["tokens_per_s"] / stock["tokens_per_s"])
                if "peak_gib" in ours and "peak_gib" in stock:
                    entry["peak_ours_over_trl"] = ours["peak_gib"] / stock["peak_gib"]
            else:
                statuses = {m: ", ".join(r["status"] for r in group if r["method"] == m) for m in (method, "trl")}
                entry["note"] = "; ".join(f"{m}: {status or 'not run'}" for m, status in statuses.items())
            out.append(entry)
    return out


def save(args, result: dict) -> str:
    """Ratios, then <out>/stock_speed.json and .md as measured so far; returns the tables."""
    result["ratios"] = ratios(result["rows"])
    env = result["env"]
    columns = COLUMNS + (["gpu_ms", "syncs"] if args.profile else [])
    return write_outputs(args, "stock_speed", result, "\n".join([
        f"Training steps where packing saves nothing: one {env.get('device', 'CPU')}, cp=1, {result['dtype']}, "
        f"activation checkpointing, adamw_torch; ours = this library's trainers (one pack), trl = the stock trainers "
        f"(one padded batch); torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, {env['date']}", "",
        markdown_table(result["rows"], columns), "", "ours / trl (same model, same sequences; trl's fastest row):", "",
        markdown_table(result["ratios"], RATIO_COLUMNS)]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(p, budget_s=540.0, out="bench_out/stock_speed")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    p.add_argument("--mixes", nargs="+", choices=MIXES, default=list(MIXES))
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="L of the equal mix (default 2048 8192)")
    p.add_argument("--lognormal-lens", type=int, nargs="+", default=None, help="L (the cap) of the lognormal mix "
                   "(default 8192: dpo_speed.py's and grpo_speed.py's recorded mix)")
    p.add_argument("--methods", nargs="+", choices=METHODS["sft"], default=list(METHODS["sft"]),
                   help="those a task has (ours_fce, ours_trainer: sft only)")
    p.add_argument("--step-tokens", type=int, default=None, help="S of every sft, dpo and reward row (default: by L)")
    p.add_argument("--min-step-tokens", type=int, default=None, help="least S by default (16384)")
    p.add_argument("--prompt", type=int, default=None, help="GRPO's prompt tokens (256)")
    p.add_argument("--completions", type=int, default=8, help="GRPO's completions in the lognormal mix")
    p.add_argument("--trl-attn-equal", nargs="+", default=None, help="trl, equal mix: attn_implementations tried in "
                   "turn (default sdpa: flash kernels without padding)")
    p.add_argument("--trl-attn-lognormal", nargs="+", default=None, help="trl, lognormal mix: the same (default "
                   "flex_attention sdpa)")
    p.add_argument("--trl-attn-all", action="store_true", help="trl: run every attention listed, not the first that "
                   "runs")
    p.add_argument("--profile", nargs="*", default=[], metavar="MODEL:TASK:MIX:L:METHOD",
                   help="run only these rows, one more step profiled")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="run nothing: the rows of these "
                   "stock_speed.json files (split runs) in one table in --out")
    args = p.parse_args(argv)
    cuda = finish_run_arguments(args, STARTED)
    defaults = (dict(seq_lens=[32, 64], lognormal_lens=[64], min_step_tokens=256, prompt=16) if args.tiny
                else dict(seq_lens=[2048, 8192], lognormal_lens=[8192], min_step_tokens=16384, prompt=256))
    defaults.update(trl_attn_equal=["sdpa"], trl_attn_lognormal=["flex_attention", "sdpa"] if cuda else ["sdpa"])
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for tag in args.profile:
        fields = tag.split(":")
        known = (("llama", "qwen3_5"), TASKS, MIXES, None, METHODS["sft"])
        if len(fields) != 5 or not fields[3].isdigit() or any(k and f not in k for f, k in zip(fields, known)):
            p.error(f"--profile {tag!r}: expected MODEL:TASK:MIX:L:METHOD, e.g. llama:dpo:equal:2048:ours")
    args.trl_attn = {"equal": args.trl_attn_equal, "lognormal": args.trl_attn_lognormal}
    args.max_length = 0  # dpo_trainer's floor of DPOConfig.max_length: the longest sequence decides
    return args


def grid(args) -> list[tuple]:
    """(model, task, mix, L, method) of every row to run, in order: --profile's, else the selectors'."""
    if args.profile:
        return [(n, t, m, int(L), meth) for n, t, m, L, meth in (tag.split(":") for tag in args.profile)]
    lengths = {"equal": args.seq_lens, "lognormal": args.lognormal_lens}
    return [(name, task, mix, L, method) for name in args.models for task in args.tasks for mix in args.mixes
            for L in lengths[mix] for method in args.methods if method in METHODS.get(task, ("ours", "trl"))]


def merge(args) -> None:
    """--merge: the rows of several runs' JSON files, in order, as one table (the first run's environment)."""
    runs = [json.loads(Path(path).read_text()) for path in args.merge]
    result = {"env": runs[0]["env"], "dtype": runs[0]["dtype"], "rows": [r for run in runs for r in run["rows"]]}
    args.profile = [tag for run in runs for tag in run["args"]["profile"]]
    print(save(args, result), flush=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    todo = grid(args)
    names = dict.fromkeys(row[0] for row in todo)
    args.labels = {name: f"{name} {speed_rows.parameters(name, args) / 1e9:.3g}B" for name in names}
    result = {"env": environment(), "dtype": args.dtype, "rows": [], "ratios": []}
    log(f"{args.device} {result['env'].get('device', '')}: {len(todo)} rows, models {args.labels}")
    specs: dict[tuple, dict] = {}
    for name, task, mix, L, method in todo:
        spec = specs.setdefault((name, task, mix, L), row_data(args, name, task, mix, L))

        def run(a, history, n, meth, S, attn, steps, task=task, mix=mix, L=L, spec=spec):
            return run_row(a, history, n, task, mix, L, spec, meth, attn, steps)

        result["rows"].extend(speed_rows.method_rows(args, result["rows"], name, method, spec["S"], 1 + args.steps, run,
                                                     key=f"{name} {mix}", attns=args.trl_attn[mix],
                                                     every=args.trl_attn_all))
        save(args, result)
    print(save(args, result), flush=True)
    log(f"done; {args.out}/stock_speed.json")


if __name__ == "__main__":
    sys.exit(main())

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
longest. Timing, OOM handling, the longest-pack search and the outputs are those of `dpo_speed.py`
(its helpers); columns: model, method, attn, C, rows, tokens (real tokens per step), computed (tokens
the model runs on), first_s, step_s, timed, tokens_per_s (real tokens / step_s), peak_gib, status.
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

import accelerate
import torch
import trl
from transformers import AutoModelForCausalLM, PrinterCallback
from trl import GRPOConfig, GRPOTrainer

import dpo_speed as shared  # same folder: the DPO benchmark's model configs, timer and tables
from hf_blockdiag_cp import CPConfig
from hf_blockdiag_cp.bench.common import environment, markdown_table, write_json
from hf_blockdiag_cp.integrations.trl import BlockdiagCPGRPOTrainer

COLUMNS = ["model", "method", "attn", "C", "rows", "tokens", "computed", "first_s", "step_s", "timed", "tokens_per_s",
           "peak_gib", "status"]


def log(message: str) -> None:
    print(f"[grpo_speed {time.perf_counter() - STARTED:6.1f} s] {message}", flush=True)


shared.log = log


def completion_lengths(args, C: int) -> list[int]:
    n = args.completions
    return [max(1, C * (i + 1) // n) for i in range(n)]


class Injected:
    """Mix in before a GRPO trainer: completions of `lengths` tokens (random, no EOS) instead of sampling."""

    lengths: list[int] = []
    vocab: int = 3

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, self.vocab, (self.lengths[i % len(self.lengths)],), generator=g).tolist()
               for i in range(len(prompt_ids))]
        return ids, None


def prompt_dataset(args, vocab: int):
    """One prompt of --prompt random tokens, pre-tokenized as TRL takes it (`prompt` as ids: a list)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    g = torch.Generator().manual_seed(args.seed)
    rows = [{"prompt": " ".join(str(t) for t in torch.randint(3, vocab, (args.prompt,), generator=g).tolist())}] * 64
    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=f"grpo_speed_{args.prompt}")


def number_tokenizer(vocab: int):
    """A word-level tokenizer over the words "0".."vocab-1" (a prompt is its ids as text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{str(i): i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def make_trainer(args, name: str, method: str, attn: str, C: int, steps: int, timer, workdir: str):
    cuda = args.device == "cuda"
    config = shared.model_config(name, args)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=args.dtype,
                                                 attn_implementation="blockdiag_cp" if method == "ours" else attn)
    grpo = GRPOConfig(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=args.completions,
        num_generations=args.completions, max_completion_length=C, beta=0.0, loss_type="dapo", learning_rate=1e-6,
        lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, save_strategy="no",
        report_to="none", bf16=cuda, use_cpu=not cuda, disable_tqdm=True, seed=0, **shared.checkpointing_fields())
    base = BlockdiagCPGRPOTrainer if method == "ours" else GRPOTrainer
    cls = type(f"Injected{base.__name__}", (Injected, base), {"lengths": completion_lengths(args, C),
                                                              "vocab": config.vocab_size})
    kwargs = dict(cp_size=1, cp_config=CPConfig(attn_backend=attn)) if method == "ours" else {}
    trainer = cls(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions], args=grpo,
                  train_dataset=prompt_dataset(args, config.vocab_size), processing_class=number_tokenizer(config.vocab_size),
                  callbacks=[timer], **kwargs)
    trainer.remove_callback(PrinterCallback)
    return trainer


def run_row(args, history: list[dict], name: str, method: str, C: int, attn: str, steps: int) -> dict:
    lengths = completion_lengths(args, C)
    tokens = sum(lengths) + args.prompt * len(lengths)
    row = {"model": args.labels[name], "method": method, "attn": attn, "C": C, "rows": len(lengths), "tokens": tokens,
           "S": tokens, "computed": tokens if method == "ours" else len(lengths) * (args.prompt + C)}
    expected, left = shared.expected_s(args, history, name, method, tokens, steps), args.deadline - time.perf_counter()
    if expected > left:
        return dict(row, status=f"skipped: ~{expected:.0f} s expected, {max(left, 0):.0f} s left of --budget-s")
    label = f"{name} {method} ({attn}) C={C}"
    log(f"{label}: {len(lengths)} completions, {tokens} tokens, {steps} step(s)")
    shared.train_row(args, row, label, tokens, lambda timer, workdir: make_trainer(args, name, method, attn, C, steps,
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
    write_json(f"{args.out}/grpo_speed.json", {"args": vars(args), **result})
    env = result["env"]
    tables = "\n".join([
        f"GRPO steps on injected completions, one {env.get('device', 'CPU')}, cp=1, {args.dtype}, activation "
        f"checkpointing, {args.completions} completions of C/{args.completions}..C tokens after a {args.prompt}-token "
        f"prompt; torch {env['torch']}, transformers {env['transformers']}, trl {env['trl']}, {env['date']}", "",
        markdown_table(result["rows"], COLUMNS), "", "ours / trl:", "",
        markdown_table(result["ratios"], ["model", "C", "ours_over_trl", "peak_ours_over_trl", "note"])])
    with open(f"{args.out}/grpo_speed.md", "w") as f:
        f.write(tables + "\n")
    return tables


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=["llama", "qwen3_5"], default=["llama", "qwen3_5"])
    p.add_argument("--methods", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--max-completions", type=int, nargs="+", default=None, help="C, the longest completion (8192 32768)")
    p.add_argument("--completions", type=int, default=8, help="completions per step (one prompt's group)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (256)")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first (untimed) one")
    p.add_argument("--attn-backend", default="auto", help="ours: CPConfig.attn_backend")
    p.add_argument("--trl-attn", nargs="+", default=None, help="trl: attn_implementations tried in turn")
    p.add_argument("--budget-s", type=float, default=540.0)
    p.add_argument("--row-budget-s", type=float, default=120.0)
    p.add_argument("--first-row-s", type=float, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy configs and sizes, CPU, fp32: a smoke check")
    p.add_argument("--out", default="bench_out/grpo_speed")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    if args.max_completions is None:
        args.max_completions = [64, 256] if args.tiny else [8192, 32768]
    if args.prompt is None:
        args.prompt = 16 if args.tiny else 256
    if args.trl_attn is None:
        args.trl_attn = ["flex_attention", "sdpa"] if cuda else ["sdpa"]
    if args.first_row_s is None:
        args.first_row_s = 5.0 if args.tiny else 200.0
    args.device, args.dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    args.deadline = STARTED + args.budget_s
    args.trl_attn_of = {}
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(format="%(message)s")
    logging.getLogger("hf_blockdiag_cp").setLevel(logging.INFO)  # the kernel and token mixers each step runs
    args.labels = {name: f"{name} {shared.parameters(name, args) / 1e9:.3g}B" for name in args.models}
    result = {"env": {**environment(), "trl": trl.__version__, "accelerate": accelerate.__version__}, "rows": []}
    log(f"{args.device}: models {args.labels}, C {args.max_completions}, methods {args.methods}")
    for name in args.models:
        for C in args.max_completions:
            for method in args.methods:
                rows = shared.method_rows(args, result["rows"], name, method, C, 1 + args.steps, run=run_row)
                result["rows"].extend(rows)
                save(args, result)
    print(save(args, result), flush=True)


if __name__ == "__main__":
    sys.exit(main())

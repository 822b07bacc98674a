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
import copy
import gc
import statistics
import sys
import tempfile
from types import SimpleNamespace

import accelerate
import torch
import trl
from transformers import PrinterCallback, TrainerCallback, TrainingArguments
from trl import DPOConfig, DPOTrainer

import hf_blockdiag_cp  # noqa: F401  (registers the "blockdiag_cp" attention)
from hf_blockdiag_cp import CPConfig
from hf_blockdiag_cp.bench.common import environment, lognormal_lengths, markdown_table, write_json
from hf_blockdiag_cp.bench.model_hybrid import build_config
from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

TINY_LAYERS = {"llama": 2, "qwen3_5": 4}  # --tiny: Qwen3.5's fourth layer is its first full-attention one
ROW_OVERHEAD_S = 30.0  # a row besides its steps: model and trainer construction, a recompile for a new shape
MIN_SEQ = 8  # shorter sampled sequences (the cut remainder) are merged into another one
SYNC = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
COLUMNS = ["model", "method", "attn", "S", "pairs", "longest", "computed", "first_s", "step_s", "timed", "tokens_per_s",
           "peak_gib", "status"]


def log(message: str) -> None:
    print(f"[dpo_speed {time.perf_counter() - STARTED:6.1f} s] {message}", flush=True)


def pair_examples(total: int, mean: float, cap: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized pairs whose sequences (prompt + completion) sum to exactly `total` tokens."""
    lengths = lognormal_lengths(total, mean, seed=seed, cap=cap)
    while len(lengths) > 2 and (len(lengths) % 2 or min(lengths) < MIN_SEQ):
        short = lengths.pop(lengths.index(min(lengths)))
        lengths[lengths.index(min(lengths))] += short
    if len(lengths) % 2 or min(lengths) < 2:
        raise SystemExit(f"S={total}: too few tokens for pairs of mean length {mean}")
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()  # 0-2: the tokenizer's specials

    rows = []
    for a, b in zip(lengths[::2], lengths[1::2]):
        prompt = min(a, b) // 2
        rows.append({"prompt_ids": ids(prompt), "chosen_ids": ids(a - prompt), "rejected_ids": ids(b - prompt)})
    return rows


def tokenizer():
    """A three-token tokenizer: the pairs are pre-tokenized, the trainers only read its pad and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def model_config(name: str, args):
    layers = args.layers or (TINY_LAYERS[name] if args.tiny else None)
    config = build_config(SimpleNamespace(model=None, arch=name, tiny=args.tiny, layers=layers))
    config.pad_token_id, config.eos_token_id = 0, 1  # the tokenizer's (TRL would align them, with a warning)
    return config


def build_models(name: str, attn: str, args):
    """(policy, reference): the config's model built on the device with seed 0, and a copy of it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: a 1B model's CPU init costs a minute
        policy = AutoModelForCausalLM.from_config(model_config(name, args), dtype=args.dtype, attn_implementation=attn)
    return policy, copy.deepcopy(policy)


def parameters(name: str, args) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config(name, args)).parameters())


class PretokenizedDPOTrainer(DPOTrainer):
    """TRL's DPOTrainer taking `prompt_ids` / `chosen_ids` / `rejected_ids` as given (its preparation
    expects text; it runs before training and is not timed either way)."""

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset


class StepTimer(TrainerCallback):
    """Seconds of every optimizer step (CUDA synchronised at both ends). Stops training after a step once
    `deadline` has passed, or once the steps after the first (at least one) took `budget` seconds."""

    def __init__(self, label: str, budget: float, deadline: float):
        self.label, self.budget, self.deadline = label, budget, deadline
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        SYNC()
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        SYNC()
        self.times.append(time.perf_counter() - self._t0)
        log(f"{self.label} step {len(self.times)}/{args.max_steps}: {self.times[-1]:.2f} s")
        if time.perf_counter() > self.deadline or sum(self.times[1:]) > self.budget:
            control.should_training_stop = True


def checkpointing_fields() -> dict:
    """Non-reentrant activation checkpointing in this Transformers' spelling (`activation_*` from 5.23)."""
    prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}


def pair_dataset(rows: list[dict]):
    """The pairs as a `datasets.Dataset` (TRL takes no other), its fingerprint given: hashing the table
    failed with the datasets / pyarrow wheels of the H200's Python 3.12 (docs/testing.md)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=f"dpo_speed_{len(rows)}_pairs")


def make_trainer(args, name: str, method: str, attn: str, rows: list[dict], S: int, steps: int, timer, workdir: str):
    cuda = args.device == "cuda"
    longest = max(len(r["prompt_ids"]) + len(r[k]) for r in rows for k in ("chosen_ids", "rejected_ids"))
    config = DPOConfig(
        output_dir=workdir, max_steps=steps, per_device_train_batch_size=1 if method == "ours" else len(rows),
        learning_rate=1e-6, lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1,
        save_strategy="no", report_to="none", bf16=cuda, use_cpu=not cuda, disable_tqdm=True, seed=0,
        max_length=max(args.max_length, longest), loss_type=["sigmoid"], beta=0.1, **checkpointing_fields())
    policy, ref = build_models(name, "blockdiag_cp" if method == "ours" else attn, args)
    common = dict(model=policy, ref_model=ref, args=config, train_dataset=pair_dataset(rows),
                  processing_class=tokenizer(), callbacks=[timer])
    if method == "ours":
        trainer = BlockdiagCPDPOTrainer(**common, cp_size=1, max_tokens=S, cp_config=CPConfig(attn_backend=attn))
        packs = len(trainer.get_train_dataloader())
        if packs != 1:
            raise RuntimeError(f"the pairs of S={S} made {packs} packs; expected one pack per step")
    else:
        trainer = PretokenizedDPOTrainer(**common)
    trainer.remove_callback(PrinterCallback)
    return trainer


def ran_with(trainer, method: str, attn: str) -> str:
    """What the steps ran: ours logs the step's kernel (and token mixers) once; trl its attn_implementation."""
    if method != "ours":
        return attn
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k in ("cp_attn_kernel", "cp_mixers")}
    return " ".join(str(v) for v in logged.values()) or attn


def expected_s(args, history: list[dict], name: str, method: str, S: int, steps: int) -> float:
    """Seconds a row should take: the per-step time of the nearest row of the model and method that ran
    a step, scaled linearly in S, times `steps`, plus ROW_OVERHEAD_S; --first-row-s before any ran."""
    done = [r for r in history if (r["model"], r["method"]) == (args.labels[name], method) and r.get("first_s")]
    if not done:
        return args.first_row_s
    last = min(done, key=lambda r: abs(r["S"] - S))
    return ROW_OVERHEAD_S + steps * (last.get("step_s") or last["first_s"]) * S / last["S"]


def train_row(args, row: dict, label: str, tokens: int, make) -> None:
    """Train `make(timer, workdir)`'s trainer into `row`: status (ok, oom, error), the method's attention
    (`ran_with`) and first loss, the first and the median timed step, tokens/s (`tokens` per step) and
    the peak memory; the device cleaned up afterwards. Shared with grpo_speed.py."""
    timer = StepTimer(label, args.row_budget_s, args.deadline)
    trainer, cuda = None, args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as workdir:
        try:
            trainer = make(timer, workdir)
            trainer.train()
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            row.update(status="ok", attn=ran_with(trainer, row["method"], row["attn"]), loss=losses[0] if losses else None)
        except Exception as exc:  # noqa: BLE001 - a size or kernel that does not run here is a result
            message = f"{type(exc).__name__}: {str(exc).strip()}"
            oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in message.lower()
            row.update(status="oom" if oom else f"error: {message[:100]}", error=message[:2000])
    if timer.times:
        timed = timer.times[1:]
        row.update(first_s=timer.times[0], timed=len(timed))
        if timed:
            step = statistics.median(timed)
            row.update(step_s=step, tokens_per_s=tokens / step, steps_s=[round(t, 3) for t in timed])
    if cuda:
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        row["left_gib"] = torch.cuda.memory_allocated() / 2**30  # should be ~0: nothing of the row kept


def run_row(args, history: list[dict], name: str, method: str, S: int, attn: str, steps: int) -> dict:
    """One (model, method, S) row: a fresh policy, reference and trainer, `steps` optimizer steps (the
    first untimed), OOM and other failures recorded in `status`; the device cleaned up afterwards.
    Skipped when it is not expected to end within --budget-s (`history`: the rows so far)."""
    rows = pair_examples(S, args.mean_len, args.max_length, model_config(name, args).vocab_size, seed=args.seed)
    lengths = [len(r["prompt_ids"]) + len(r[k]) for r in rows for k in ("chosen_ids", "rejected_ids")]
    row = {"model": args.labels[name], "method": method, "attn": attn, "S": S, "pairs": len(rows),
           "longest": max(lengths), "computed": S if method == "ours" else len(lengths) * max(lengths)}
    expected, left = expected_s(args, history, name, method, S, steps), args.deadline - time.perf_counter()
    if expected > left:
        return dict(row, status=f"skipped: ~{expected:.0f} s expected, {max(left, 0):.0f} s left of --budget-s")
    label = f"{name} {method} ({attn}) S={S}"
    log(f"{label}: {len(rows)} pairs, longest {max(lengths)}, {steps} step(s)")
    train_row(args, row, label, S, lambda timer, workdir: make_trainer(args, name, method, attn, rows, S, steps, timer,
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


def method_rows(args, history: list[dict], name: str, method: str, S: int, steps: int, run=None) -> list[dict]:
    """The method's row at S (`run`: this script's `run_row` or another benchmark's, same arguments);
    trl: with the attention fixed for the model once one ran (or ran out of memory), else each of
    --trl-attn in turn until one does, the failed attempts rows too (they say why)."""
    run = run_row if run is None else run
    if method == "ours":
        return [run(args, history, name, "ours", S, args.attn_backend, steps)]
    out = []
    for attn in [args.trl_attn_of[name]] if name in args.trl_attn_of else args.trl_attn:
        out.append(run(args, history + out, name, "trl", S, attn, steps))
        if out[-1]["status"] in ("ok", "oom"):
            args.trl_attn_of[name] = attn
        if not out[-1]["status"].startswith("error"):
            break
    return out


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
            one_step = expected_s(args, result["rows"] + result["fit_rows"], name, method, S, 1) - ROW_OVERHEAD_S
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
    write_json(f"{args.out}/dpo_speed.json", {"args": vars(args), **result})
    tables = report(args, result)
    with open(f"{args.out}/dpo_speed.md", "w") as f:
        f.write(tables + "\n")
    return tables


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=["llama", "qwen3_5"], default=["llama", "qwen3_5"])
    p.add_argument("--methods", nargs="+", choices=["ours", "trl"], default=["ours", "trl"])
    p.add_argument("--seq-lens", type=int, nargs="+", default=None, help="S, real tokens per step (default 16384 65536)")
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first (untimed) one")
    p.add_argument("--longest", choices=["on", "off"], default="on", help="search the longest pack that runs a step")
    p.add_argument("--longest-models", nargs="*", choices=["llama", "qwen3_5"], default=["llama"])
    p.add_argument("--longest-ours", type=int, nargs="*", default=None, help="default 131072 262144 524288")
    p.add_argument("--longest-trl", type=int, nargs="*", default=None, help="default 32768 65536 131072")
    p.add_argument("--mean-len", type=float, default=None, help="mean sequence length, prompt + completion (2048)")
    p.add_argument("--max-length", type=int, default=None, help="cap of a sequence's length and DPOConfig.max_length (8192)")
    p.add_argument("--attn-backend", default="auto", help="ours: CPConfig.attn_backend")
    p.add_argument("--trl-attn", nargs="+", default=None, help="trl: attn_implementations tried in turn")
    p.add_argument("--budget-s", type=float, default=520.0, help="the run's time: a row starts only if expected to end in it")
    p.add_argument("--row-budget-s", type=float, default=120.0, help="a row's timed steps stop once they took this")
    p.add_argument("--first-row-s", type=float, default=None, help="expected time of a model and method's first row "
                   "(compilation, autotuning): 200 (5 with --tiny)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick probes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy configs and sizes, CPU, fp32, sdpa: a smoke check")
    p.add_argument("--out", default="bench_out/dpo_speed")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.tiny
    defaults = (dict(seq_lens=[512, 1024], longest_ours=[2048, 4096], longest_trl=[2048], mean_len=64.0, max_length=256)
                if args.tiny else dict(seq_lens=[16384, 65536], longest_ours=[131072, 262144, 524288],
                                       longest_trl=[32768, 65536, 131072], mean_len=2048.0, max_length=8192))
    defaults["trl_attn"] = ["flex_attention", "sdpa"] if cuda else ["sdpa"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.device, args.dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    if args.tiny:
        torch.set_num_threads(1)  # toy matrices: more threads only contend (a shared 2-core machine: 10x slower)
    if args.longest == "off":
        args.longest_models = []
    if args.first_row_s is None:
        args.first_row_s = 5.0 if args.tiny else 200.0
    args.deadline = STARTED + args.budget_s
    args.trl_attn_of = {}  # the attention TRL's rows of each model use once one ran
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    args.labels = {name: f"{name} {parameters(name, args) / 1e9:.3g}B" for name in args.models}
    env = {**environment(), "trl": trl.__version__, "accelerate": accelerate.__version__}
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

"""The rows of the trainer speed benchmarks (`dpo_speed.py`, `grpo_speed.py`, `stock_speed.py`): model
configs, tokenizers and pre-tokenized data, the DPO and GRPO trainers of both methods, the step timer, and
one row's training, failure handling and time budget. Each script names itself for the log (`configure`).

Methods: "ours" (and variants "ours_*") run this library's trainer at cp_size=1 on one pack of the step's
sequences; "trl" runs the stock trainer on the same data, padded, at an `attn_implementation` tried in turn.
"""

from __future__ import annotations

import copy
import gc
import inspect
import logging
import statistics
import tempfile
import time
from types import SimpleNamespace

import torch
from transformers import PrinterCallback, TrainerCallback, TrainingArguments
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

import hf_blockdiag_cp  # noqa: F401  (registers the "blockdiag_cp" attention)
from hf_blockdiag_cp import CPConfig
from hf_blockdiag_cp.bench.common import environment as common_environment
from hf_blockdiag_cp.bench.common import lognormal_lengths, write_json
from hf_blockdiag_cp.bench.model_hybrid import build_config
from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer, BlockdiagCPGRPOTrainer

TINY_LAYERS = {"llama": 2, "qwen3_5": 4}  # --tiny: Qwen3.5's fourth layer is its first full-attention one
ROW_OVERHEAD_S = 30.0  # a row besides its steps: model and trainer construction, a recompile for a new shape
MIN_SEQ = 8  # shorter sampled sequences (the cut remainder) are merged into another one
SYNC = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
LOG = SimpleNamespace(name="speed", started=time.perf_counter())


class LastChoice(logging.Handler):
    """Keeps the last "blockdiag_cp runs kernel ..." line the library logged (once per new choice, at INFO)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.kernel = self.mixers = None

    def emit(self, record):
        text = record.getMessage()
        if text.startswith("blockdiag_cp runs kernel "):
            self.kernel = text[len("blockdiag_cp runs kernel "):].split(" (attn_backend")[0]
            self.mixers = text.split("token mixers ")[1] if "token mixers " in text else None


LAST_CHOICE = LastChoice()


def environment() -> dict:
    """`bench.common.environment` (versions, GPU, date) with TRL's and accelerate's versions."""
    import accelerate
    import trl

    return {**common_environment(), "trl": trl.__version__, "accelerate": accelerate.__version__}


def configure(name: str, started: float) -> None:
    """Name the running script in the log lines and its start (the clock of --budget-s); keep the library's
    choices of kernel (`ran_with`); no progress bars of `datasets`."""
    import datasets

    LOG.name, LOG.started = name, started
    choices = logging.getLogger("hf_blockdiag_cp.step.state")
    choices.setLevel(min(choices.getEffectiveLevel(), logging.INFO))
    choices.addHandler(LAST_CHOICE)
    datasets.disable_progress_bars()


def add_run_arguments(p, budget_s: float, out: str) -> None:
    """The arguments of every trainer benchmark: models, steps, ours' kernel, the time budget, --tiny, --out."""
    p.add_argument("--models", nargs="+", choices=["llama", "qwen3_5"], default=["llama", "qwen3_5"])
    p.add_argument("--steps", type=int, default=2, help="timed steps after the first (untimed) one")
    p.add_argument("--attn-backend", default="auto", help="ours: CPConfig.attn_backend")
    p.add_argument("--budget-s", type=float, default=budget_s, help="the run's time: a row starts only if expected to "
                   "end in it")
    p.add_argument("--row-budget-s", type=float, default=120.0, help="a row's timed steps stop once they took this")
    p.add_argument("--first-row-s", type=float, default=None, help="expected time of a model and method's first row "
                   "(compilation, autotuning): 200 (5 with --tiny)")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (quick probes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="toy configs and sizes, CPU, fp32, sdpa: a smoke check")
    p.add_argument("--out", default=out)


def finish_run_arguments(args, started: float) -> bool:
    """Device and dtype (bf16 CUDA unless --tiny: fp32 CPU on one thread), --first-row-s's default, the deadline
    (`started` + --budget-s), no trl attention fixed yet; returns whether the run is on CUDA."""
    cuda = torch.cuda.is_available() and not args.tiny
    args.device, args.dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    if args.tiny:
        torch.set_num_threads(1)  # toy matrices: more threads only contend (a shared 2-core machine: 10x slower)
    if args.first_row_s is None:
        args.first_row_s = 5.0 if args.tiny else 200.0
    args.deadline = started + args.budget_s
    args.trl_attn_of = {}  # the attention trl's rows use once one ran (`method_rows`)
    return cuda


def write_outputs(args, name: str, result: dict, tables: str) -> str:
    """<out>/<name>.json (the arguments and `result`) and <out>/<name>.md (`tables`); returns `tables`."""
    write_json(f"{args.out}/{name}.json", {"args": vars(args), **result})
    with open(f"{args.out}/{name}.md", "w") as f:
        f.write(tables + "\n")
    return tables


def log(message: str) -> None:
    print(f"[{LOG.name} {time.perf_counter() - LOG.started:6.1f} s] {message}", flush=True)


# --------------------------------------------------------------------------- data


def sequence_lengths(total: int, mean: float, cap: int, seed: int = 0, even: bool = False) -> list[int]:
    """Log-normal lengths (sigma 1, capped at `cap`) summing to exactly `total`; the shortest is merged into
    the next shortest while one is under MIN_SEQ tokens or (`even`) while their count is odd."""
    lengths = lognormal_lengths(total, mean, seed=seed, cap=cap)
    while len(lengths) > 2 and ((even and len(lengths) % 2) or min(lengths) < MIN_SEQ):
        short = lengths.pop(lengths.index(min(lengths)))
        lengths[lengths.index(min(lengths))] += short
    return lengths


def spread_lengths(longest: int, n: int) -> list[int]:
    """`n` lengths evenly spread from longest/n to `longest`, as an RL group mixes short and long answers."""
    return [max(1, longest * (i + 1) // n) for i in range(n)]


def random_ids(vocab: int, seed: int):
    """`ids(n)`: n random token ids from one seeded stream, above the tokenizer's specials (0-2)."""
    g = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()


def pairs_of(lengths: list[int], vocab: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized pairs, one per two consecutive `lengths` (prompt + completion each); the prompt, half
    the shorter sequence, is shared by the pair."""
    ids, rows = random_ids(vocab, seed), []
    for a, b in zip(lengths[::2], lengths[1::2]):
        prompt = min(a, b) // 2
        rows.append({"prompt_ids": ids(prompt), "chosen_ids": ids(a - prompt), "rejected_ids": ids(b - prompt)})
    return rows


def pair_examples(total: int, mean: float, cap: int, vocab: int, seed: int = 0) -> list[dict]:
    """Pre-tokenized pairs of log-normal sequences (prompt + completion) summing to exactly `total` tokens."""
    lengths = sequence_lengths(total, mean, cap, seed=seed, even=True)
    if len(lengths) % 2 or min(lengths) < 2:
        raise SystemExit(f"S={total}: too few tokens for pairs of mean length {mean}")
    return pairs_of(lengths, vocab, seed)


def dataset(rows: list[dict], name: str):
    """`rows` as a `datasets.Dataset` (TRL takes no other), its fingerprint given: hashing the table
    failed with the datasets / pyarrow wheels of the H200's Python 3.12 (docs/testing.md)."""
    from datasets import Dataset
    from datasets.table import InMemoryTable

    return Dataset(InMemoryTable.from_pylist(rows), fingerprint=f"{name}_{len(rows)}_rows")


def tokenizer():
    """A three-token tokenizer: the data is pre-tokenized, the trainers only read its pad and eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<pad>": 0, "<eos>": 1, "<unk>": 2}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def number_tokenizer(vocab: int):
    """A word-level tokenizer over the words "0".."vocab-1" (a GRPO prompt is its ids as text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{str(i): i for i in range(3, vocab)}}
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


# --------------------------------------------------------------------------- models and trainers


def model_config(name: str, args):
    layers = args.layers or (TINY_LAYERS[name] if args.tiny else None)
    config = build_config(SimpleNamespace(model=None, arch=name, tiny=args.tiny, layers=layers))
    config.pad_token_id, config.eos_token_id = 0, 1  # the tokenizer's (TRL would align them, with a warning)
    return config


def build_model(name: str, attn: str, args, reward: bool = False):
    """The config's causal LM (or, `reward`, sequence classifier with one label) built on the device with seed 0."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = model_config(name, args)
    if reward:
        config.num_labels = 1
    cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: a 1B model's CPU init costs a minute
        return cls.from_config(config, dtype=args.dtype, attn_implementation=attn)


def parameters(name: str, args) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config(name, args)).parameters())


def checkpointing_fields() -> dict:
    """Non-reentrant activation checkpointing in this Transformers' spelling (`activation_*` from 5.23)."""
    prefix = "activation" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ else "gradient"
    return {f"{prefix}_checkpointing": True, f"{prefix}_checkpointing_kwargs": {"use_reentrant": False}}


def run_fields(args, workdir: str, steps: int, batch: int) -> dict:
    """The training arguments every row shares: `steps` optimizer steps of one micro-batch of `batch`, AdamW
    lr 1e-6 constant, clipping at 1, a log per step, no saving, bf16 on the GPU, activation checkpointing."""
    cuda = args.device == "cuda"
    return dict(output_dir=workdir, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-6,
                lr_scheduler_type="constant", optim="adamw_torch", max_grad_norm=1.0, logging_steps=1,
                save_strategy="no", report_to="none", bf16=cuda, use_cpu=not cuda, disable_tqdm=True, seed=0,
                **checkpointing_fields())


def pair_batching(trainer_cls, pairs: int) -> tuple[int, dict]:
    """(per_device_train_batch_size, trainer keywords) that put a step's `pairs` pairs in one micro-batch of
    one pack: `batching="pairs"` and the pairs where the trainer takes `batching`, else one pack a micro-batch."""
    takes = any("batching" in inspect.signature(c.__init__).parameters
                for c in trainer_cls.__mro__ if "__init__" in vars(c))
    return (pairs, {"batching": "pairs"}) if takes else (1, {})


def one_pack(trainer, S: int):
    """`trainer`, checked to train the step's sequences as one pack of S tokens (an epoch of one micro-batch)."""
    packs = len(trainer.get_train_dataloader())
    if packs != 1:
        raise RuntimeError(f"the sequences of S={S} made {packs} micro-batches; expected one pack per step")
    return trainer


def finish(trainer):
    trainer.remove_callback(PrinterCallback)
    return trainer


class PretokenizedDPOTrainer(DPOTrainer):
    """TRL's DPOTrainer taking `prompt_ids` / `chosen_ids` / `rejected_ids` as given (its preparation
    expects text; it runs before training and is not timed either way)."""

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset


def dpo_trainer(args, name: str, method: str, attn: str, rows: list[dict], S: int, steps: int, timer, workdir: str):
    """DPO on `rows`: ours one pack of S tokens, trl one padded batch of the pairs; the reference a copy of
    the policy; sigmoid loss, beta 0.1, max_length at least every sequence (none truncated)."""
    longest = max(len(r["prompt_ids"]) + len(r[k]) for r in rows for k in ("chosen_ids", "rejected_ids"))
    batch, extra = pair_batching(BlockdiagCPDPOTrainer, len(rows)) if method == "ours" else (len(rows), {})
    config = DPOConfig(**run_fields(args, workdir, steps, batch), max_length=max(args.max_length, longest),
                       loss_type=["sigmoid"], beta=0.1)
    policy = build_model(name, "blockdiag_cp" if method == "ours" else attn, args)
    common = dict(model=policy, ref_model=copy.deepcopy(policy), args=config, processing_class=tokenizer(),
                  train_dataset=dataset(rows, "speed_pairs"), callbacks=[timer])
    if method == "ours":
        return finish(one_pack(BlockdiagCPDPOTrainer(**common, **extra, cp_size=1, max_tokens=S,
                                                     cp_config=CPConfig(attn_backend=attn)), S))
    return finish(PretokenizedDPOTrainer(**common))


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
    ids = random_ids(vocab, args.seed)(args.prompt)
    return dataset([{"prompt": " ".join(str(t) for t in ids)}] * 64, f"speed_prompt_{args.prompt}")


def grpo_trainer(args, name: str, method: str, attn: str, lengths: list[int], steps: int, timer, workdir: str):
    """GRPO on injected completions of `lengths` after one --prompt-token prompt: one group a step (beta 0,
    loss_type dapo); ours packs the rows padding-free, trl pads them to the longest."""
    config = model_config(name, args)
    model = build_model(name, "blockdiag_cp" if method == "ours" else attn, args)
    grpo = GRPOConfig(**run_fields(args, workdir, steps, len(lengths)), num_generations=len(lengths),
                      max_completion_length=max(lengths), beta=0.0, loss_type="dapo")
    base = BlockdiagCPGRPOTrainer if method == "ours" else GRPOTrainer
    cls = type(f"Injected{base.__name__}", (Injected, base), {"lengths": lengths, "vocab": config.vocab_size})
    kwargs = dict(cp_size=1, cp_config=CPConfig(attn_backend=attn)) if method == "ours" else {}
    return finish(cls(model=model, reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
                      args=grpo, train_dataset=prompt_dataset(args, config.vocab_size),
                      processing_class=number_tokenizer(config.vocab_size), callbacks=[timer], **kwargs))


# --------------------------------------------------------------------------- timing and budget


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


def ran_with(trainer, method: str, attn: str) -> str:
    """What the steps ran: ours' kernel (and token mixers), from the trainer's logs where it logs them, else
    from the library's last logged choice (the GRPO trainer logs none; the rows of a model run in a row);
    trl its attn_implementation."""
    if not method.startswith("ours"):
        return attn
    logged = {k: v for entry in trainer.state.log_history for k, v in entry.items() if k in ("cp_attn_kernel", "cp_mixers")}
    if not logged and LAST_CHOICE.kernel:
        logged = {"kernel": LAST_CHOICE.kernel, "mixers": LAST_CHOICE.mixers or ""}
    return " ".join(str(v) for v in logged.values() if v) or attn


def expected_s(args, history: list[dict], keys: list[dict], S: int, steps: int) -> float:
    """Seconds a row should take: the per-step time of the nearest (in S) row that ran a step and matches
    the first of `keys` (column values) any row matches, scaled linearly in S, times `steps`, plus
    ROW_OVERHEAD_S; --first-row-s when none does."""
    for key in keys:
        done = [r for r in history if r.get("first_s") and all(r.get(k) == v for k, v in key.items())]
        if done:
            last = min(done, key=lambda r: abs(r["S"] - S))
            return ROW_OVERHEAD_S + steps * (last.get("step_s") or last["first_s"]) * S / last["S"]
    return args.first_row_s


def skipped(args, history: list[dict], keys: list[dict], S: int, steps: int) -> str | None:
    """The status of a row not expected to end within --budget-s (`expected_s`), else None."""
    expected, left = expected_s(args, history, keys, S, steps), args.deadline - time.perf_counter()
    return f"skipped: ~{expected:.0f} s expected, {max(left, 0):.0f} s left of --budget-s" if expected > left else None


def train_row(args, row: dict, label: str, tokens: int, make, callbacks=(), untimed=()) -> None:
    """Train `make(timer, workdir)`'s trainer (plus `callbacks`) into `row`: status (ok, oom, error), the
    method's attention (`ran_with`) and first loss, the first and the median timed step (steps numbered
    in `untimed`, from 1, left out), tokens/s (`tokens` per step) and the peak memory; the device cleaned
    up afterwards."""
    timer = StepTimer(label, args.row_budget_s, args.deadline)
    trainer, cuda = None, args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with tempfile.TemporaryDirectory() as workdir:
        try:
            trainer = make(timer, workdir)
            for callback in callbacks:
                trainer.add_callback(callback)
            trainer.train()
            losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
            row.update(status="ok", attn=ran_with(trainer, row["method"], row["attn"]), loss=losses[0] if losses else None)
        except Exception as exc:  # noqa: BLE001 - a size or kernel that does not run here is a result
            message = f"{type(exc).__name__}: {str(exc).strip()}"
            oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in message.lower()
            row.update(status="oom" if oom else f"error: {message[:100]}", error=message[:2000])
    times = [t for i, t in enumerate(timer.times) if i + 1 not in untimed]
    if times:
        timed = times[1:]
        row.update(first_s=times[0], timed=len(timed))
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


def method_rows(args, history: list[dict], name: str, method: str, S: int, steps: int, run, key=None, attns=None,
                every: bool = False) -> list[dict]:
    """The method's row at S (`run(args, history, name, method, S, attn, steps)`, the script's); trl: with
    the attention fixed for `key` (default the model) once one ran (or ran out of memory), else each of
    `attns` (default --trl-attn) in turn until one does, the failed attempts rows too (they say why);
    `every`: each of `attns` whatever the others did."""
    if method != "trl":
        return [run(args, history, name, method, S, args.attn_backend, steps)]
    key = name if key is None else key
    out = []
    tried = attns or args.trl_attn
    for attn in tried if every else [args.trl_attn_of[key]] if key in args.trl_attn_of else tried:
        out.append(run(args, history + out, name, "trl", S, attn, steps))
        if out[-1]["status"] in ("ok", "oom"):
            args.trl_attn_of[key] = attn
        if not every and not out[-1]["status"].startswith("error"):
            break
    return out

"""Preference training with TRL's `DPOTrainer` on packed pairs under block-diagonal CP.

    torchrun --standalone --nproc-per-node 2 examples/train_dpo.py --steps 20 --eval --output-dir out/train_dpo
    torchrun --standalone --nproc-per-node 4 examples/train_dpo.py --cp-size 2          # CPU: dp=2 x cp=2
    accelerate launch --num_processes 8 examples/train_dpo.py --cp-size 4 --bf16 --attn-backend fa4

Defaults: a tiny Llama built from a config (fp32, random init, seed `--seed`), a character-level
tokenizer (`integrations.demo`) and preference pairs made from the Python standard library (the
embedded corpus, `hf_blockdiag_cp.data.corpus`), so it runs offline: for a top-level function,
prompt = its first `PROMPT_LINES` lines, chosen = the lines that follow (at most
`CONTINUATION_LINES`, as many as fit in `--max-length` tokens) as written, rejected = the same
lines with their indentation stripped (no longer Python). The reference model is a deep copy of the
initial policy. TRL tokenizes the pairs (EOS after each completion; each sequence truncated to
`--max-length` tokens, which the generated pairs never need); `BlockdiagCPDPOTrainer` packs whole
pairs (both sequences of a pair in one pack of `--max-tokens` tokens, default 2 * `--max-length`
rounded up to a multiple of 2*cp) and runs the policy and the reference on every pack sharded over
the CP group, exactly per sequence. Same optimizer and schedule as `examples/trainer_packed.py`.

Loss (the same number for any dp x cp): per optimizer step, the mean over the P pairs of the
step's `--packs-per-step` packs of TRL's per-pair DPO loss; for `--loss-type sigmoid` (TRL's default)

    loss_pair = -log sigmoid(beta * ((log pi(c|x) - log ref(c|x)) - (log pi(r|x) - log ref(r|x)))),

log pi(y|x) the log-probability of completion y summed over its tokens (prompt x not scored). Each
rank backpropagates (the sum of its packs' pair losses) * dp / P (every rank of a CP group holds the
same per-pair sums: they come from per-document sums over the group), so the mean over the ranks,
which the Trainer logs and DDP averages, is the mean over the step's pairs: TRL's loss for one
batch of those pairs.

What goes where (the part a user copies):

- model: `attn_implementation="blockdiag_cp"` (after `import hf_blockdiag_cp`); `ref_model`: here
  `copy.deepcopy(policy)` (the trainer runs a reference loaded with another attention on
  `blockdiag_cp` too; without one: a PEFT policy's disabled adapters, or `precompute_ref_log_probs=True`).
- `DPOConfig`: `per_device_train_batch_size=1` (one pack per micro-batch: `batching="tokens"`; the
  trainer's default `batching="pairs"` takes `per_device_train_batch_size` pairs per micro-batch instead,
  as TRL does), `gradient_accumulation_steps` = packs per step / dp, `max_length` = TRL's per-sequence truncation,
  `bf16` explicitly (TRL's default is True); never `parallelism_config` (accelerate's own CP) nor
  `use_liger_kernel`.
- `BlockdiagCPDPOTrainer(model=..., ref_model=..., args=..., train_dataset=..., eval_dataset=...,
  processing_class=tokenizer, cp_size=..., batching="tokens", max_tokens=...,
  cp_config=CPConfig(attn_backend=...))`, no `data_collator`.

Writes, with `--output-dir DIR`: `DIR/metrics.json` (`losses` per optimizer step as the Trainer
logged them, `trl`: TRL's metrics per step (`rewards/chosen`, `rewards/margins`,
`rewards/accuracies`, `logps/chosen`, ...), `tokens_per_second`, `cp_size`, `dp_size`, `world_size`,
and with `--eval` every `eval_*` metric of `evaluate()` after training), `DIR/loss.png`, and the
final policy (`DIR/model.safetensors`, `DIR/config.json`).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import random
import sys
from pathlib import Path

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.integrations.demo import CHAR_SPECIAL_TOKENS, char_tokenizer, tiny_config
from hf_blockdiag_cp.integrations.scripts import (
    OneLineParser, add_cp_config_arguments, check_launch, check_ranges, checkpointing_arguments, config_error,
    cp_config_from_args, fail, layout_error, loaded, one_line_errors, process_group_closed, trainer_metrics,
    write_outputs,
)
from hf_blockdiag_cp.integrations.trl.dpo_loss import LOSS_TYPES

PROMPT_LINES = 2  # a pair's prompt: the function's first lines
CONTINUATION_LINES = 10  # at most this many lines after them make the completions
# TRL's metrics of a training log, kept per step in metrics.json.
TRL_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "logits/chosen", "logits/rejected", "entropy", "mean_token_accuracy", "num_tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--examples", type=int, default=3000, help="preference pairs made from the stdlib (at most as many "
                   "as it has functions with enough lines)")
    p.add_argument("--max-length", type=int, default=256, help="tokens per sequence (prompt + completion): "
                   "DPOConfig.max_length, TRL's truncation")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens per pack, a multiple of 2*cp that holds a pair "
                   "(default: 2 * --max-length rounded up to one)")
    p.add_argument("--beta", type=float, default=0.1, help="DPOConfig.beta: strength of the tie to the reference")
    p.add_argument("--loss-type", nargs="+", default=["sigmoid"], choices=LOSS_TYPES, metavar="TYPE",
                   help=f"DPOConfig.loss_type, one or more (summed): {', '.join(LOSS_TYPES)}")
    p.add_argument("--eval", action="store_true", help="hold out --eval-examples pairs; after training print eval_loss "
                   "and eval_rewards/accuracies (sharded evaluation: the mean over every eval pair)")
    p.add_argument("--eval-examples", type=int, default=64, help="pairs held out by --eval")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--packs-per-step", type=int, default=4, help="global batch: packs per optimizer step (split over DP)")
    p.add_argument("--cp-size", type=int, default=None, help="CP group size (default: number of processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    add_cp_config_arguments(p)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (packing and sharding run there)")
    p.add_argument("--output-dir", default="out/train_dpo", help="write metrics.json, loss.png and the final model here")
    args = p.parse_args(argv)
    check_ranges(p, args, positive=("examples", "max_length", "beta", "steps", "packs_per_step", "lr", "eval_examples"),
                 non_negative=("num_workers", "max_grad_norm"))
    if args.max_tokens is not None and args.max_tokens <= 0:
        p.error(f"--max-tokens must be positive; got {args.max_tokens}")
    return args


def argument_error(args, world_size: int) -> str | None:
    """Why `args` cannot run on `world_size` processes (sizes, then kernel, exchange and layout names),
    or None. The default pack size is always a multiple of 2*cp, so only a given --max-tokens is checked."""
    sizes = args if args.max_tokens is not None else argparse.Namespace(**{**vars(args), "max_tokens": 0})
    return layout_error(sizes, world_size) or config_error(args)


@contextlib.contextmanager
def refusals_in_one_line():
    """End the rank with one `error:` line for a setting the trainer's setup checks refuse once they see
    the model and the data (a ValueError naming the field; a pair longer than the pack names
    max_tokens). Every rank holds the same data and settings, so every rank refuses alike."""
    try:
        yield
    except ValueError as exc:
        fail(" ".join(str(exc).split()), during_run=True)


# --------------------------------------------------------------------------- model and data


def build_model_and_tokenizer(args, attn_implementation: str = bdcp.ATTN_IMPLEMENTATION):
    """The initial policy (seeded: the same weights on every rank) and the character tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = char_tokenizer()
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer), args.max_length),
                                             attn_implementation=attn_implementation, dtype=torch.float32)
    model.config.use_cache = False
    return model, tokenizer


def stdlib_pairs(count: int, seed: int, max_length: int):
    """Up to `count` prompt/chosen/rejected pairs from the top-level functions of the stdlib corpus
    whose characters the tokenizer has, in an order shuffled by `seed`: the first PROMPT_LINES lines,
    then the longest run of the next lines (at most CONTINUATION_LINES) that fits in `max_length`
    tokens with the prompt and EOS, as written (chosen) and with its indentation stripped (rejected:
    the same code, no longer Python). No truncation cuts a pair."""
    from datasets import Dataset

    characters = set(char_tokenizer().get_vocab())
    rows = []
    for doc in corpus.documents():
        text = doc.text.decode("utf-8", "replace")
        if not text.startswith("def ") or not set(text) <= characters or any(t in text for t in CHAR_SPECIAL_TOKENS):
            continue
        lines = text.splitlines(keepends=True)
        prompt, chosen = "".join(lines[:PROMPT_LINES]), lines[PROMPT_LINES:PROMPT_LINES + CONTINUATION_LINES]
        while chosen and len(prompt) + len("".join(chosen)) + 1 > max_length:  # + 1: TRL's EOS
            chosen.pop()
        rejected = "".join(line.lstrip(" \t") for line in chosen)
        if rejected != "".join(chosen):
            rows.append({"prompt": prompt, "chosen": "".join(chosen), "rejected": rejected})
    if not rows:
        raise ValueError(f"no pair fits in {max_length} tokens (a stdlib function's first {PROMPT_LINES} lines and "
                         "more, then EOS); raise it")
    random.Random(seed).shuffle(rows)
    return Dataset.from_list(rows[:count])


def load_data(args):
    """(train pairs, eval pairs or None): with --eval the last --eval-examples pairs are held out."""
    data = stdlib_pairs(args.examples, args.seed, args.max_length)
    if not args.eval:
        return data, None
    held_out = min(args.eval_examples, len(data) - 1)
    return data.select(range(len(data) - held_out)), data.select(range(len(data) - held_out, len(data)))


def dpo_config(args, world_size: int, cp_size: int):
    """One pack per micro-batch, `--packs-per-step` packs per optimizer step over the DP replicas, AdamW
    (betas 0.9/0.95, no weight decay) or SGD at a constant rate; TRL's `max_length`, `beta`, `loss_type`."""
    from trl import DPOConfig

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not torch.cuda.is_available()
    return DPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=args.packs_per_step // (world_size // cp_size), learning_rate=args.lr,
        lr_scheduler_type="constant", optim="sgd" if args.optimizer == "sgd" else "adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        **checkpointing_arguments(args.gradient_checkpointing), dataloader_drop_last=True,
        dataloader_num_workers=args.num_workers, remove_unused_columns=False, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=use_cpu, seed=args.seed,
        max_length=args.max_length, beta=args.beta, loss_type=args.loss_type,
        bf16=args.bf16)  # explicit: TRL's default is True



def trl_metrics(trainer) -> dict[str, list[float]]:
    """TRL's metrics per optimizer step, as the Trainer logged them."""
    steps = [h for h in trainer.state.log_history if "loss" in h]
    return {name: [h[name] for h in steps] for name in TRL_METRICS if all(name in h for h in steps)}


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = check_launch(args, argument_error)  # before any collective: a bad argument ends every rank with one line
    cp_size = world_size if args.cp_size is None else args.cp_size
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPDPOTrainer

    data, eval_data = loaded("--max-length", load_data, args)
    model, tokenizer = build_model_and_tokenizer(args)
    with refusals_in_one_line():  # the trainer checks every pair against the pack size here
        trainer = BlockdiagCPDPOTrainer(
            model=model,
            ref_model=copy.deepcopy(model),  # the initial policy
            args=dpo_config(args, world_size, cp_size),
            train_dataset=data,
            eval_dataset=eval_data,
            processing_class=tokenizer,
            cp_size=cp_size,
            batching="tokens",  # one pack of --max-tokens per micro-batch, however many pairs it holds
            max_tokens=args.max_tokens,
            cp_config=cp_config_from_args(args),
        )
    trainer.train()
    evaluated = trainer.evaluate() if args.eval else {}
    metrics = trainer_metrics(trainer, world_size, cp_size)
    metrics.update(trl=trl_metrics(trainer), max_tokens=trainer.packing.max_tokens, max_length=args.max_length,
                   beta=args.beta, loss_type=args.loss_type, pairs=len(data), loss_label="DPO loss (mean over pairs)")
    metrics.update({name: value for name, value in evaluated.items() if name.startswith("eval_")})
    if args.output_dir:
        trainer.save_model(args.output_dir)
    if trainer.is_world_process_zero():
        shown = {name: evaluated[name] for name in ("eval_loss", "eval_rewards/accuracies") if name in evaluated}
        print(json.dumps({"losses": metrics["losses"], "tokens_per_second": round(metrics["tokens_per_second"], 1),
                          **shown}))
        if args.output_dir:
            write_outputs(Path(args.output_dir), metrics, f"DPO, dp={metrics['dp_size']} x cp={cp_size}")
    return 0


if __name__ == "__main__":
    with process_group_closed(), one_line_errors():
        sys.exit(main())

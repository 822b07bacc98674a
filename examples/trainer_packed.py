"""Train a causal LM on packed documents with block-diagonal CP through `transformers.Trainer`.

    torchrun --standalone --nproc-per-node 2 examples/trainer_packed.py --steps 20 --output-dir out/trainer_packed
    torchrun --standalone --nproc-per-node 4 examples/trainer_packed.py --cp-size 2      # CPU: dp=2 x cp=2
    accelerate launch --num_processes 8 examples/trainer_packed.py --cp-size 4         # GPUs: NCCL

Same defaults as `examples/train_packed.py` (the custom loop): a tiny Llama built from a
config (fp32, random init, seed `--seed`), the embedded corpus (`hf_blockdiag_cp.data.corpus`, its
units cut to at most `--max-tokens`), packs of `--max-tokens` tokens, `--packs-per-step` packs per
optimizer step over all DP replicas, AdamW (betas 0.9/0.95, no weight decay), constant learning
rate, clipping at 1.0, cp = number of processes.

What goes where (the Trainer part a user copies):

- model: `attn_implementation="blockdiag_cp"` (after `import hf_blockdiag_cp`).
- `BlockdiagCPTrainer(model=..., args=..., train_dataset=..., cp_size=..., max_tokens=...)`:
  `train_dataset` is a map-style dataset of documents with `input_ids` (optional `labels`);
  no `data_collator` (the Trainer packs and shards itself).
- `TrainingArguments`: `per_device_train_batch_size=1` (one pack per micro-batch),
  `gradient_accumulation_steps = packs per step / dp`, `use_cache=False` (the default),
  `dataloader_drop_last=True` for the same packs at any dp, `remove_unused_columns=False`,
  `use_cpu=True` on CPU hosts; for activation checkpointing `activation_checkpointing=True`
  with `activation_checkpointing_kwargs={"use_reentrant": False}`. Never set
  `parallelism_config` / `--parallelism_config_cp_size` (accelerate's own CP), label
  smoothing, or `compute_loss_func`.

Writes, with `--output-dir DIR`: `DIR/metrics.json` (`losses` per optimizer step as the
Trainer logged them, `tokens_per_second`, `cp_size`, `dp_size`, ...), `DIR/loss.png`, and the
final model (`DIR/model.safetensors`, `DIR/config.json`) to compare runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.integrations.demo import tiny_config
from hf_blockdiag_cp.integrations.scripts import (
    OneLineParser, add_cp_config_arguments, check_launch, check_ranges, checkpointing_arguments, cp_config_from_args,
    load_raw_dataset, loaded, one_line_errors, process_group_closed, trainer_metrics, write_outputs,
)
from hf_blockdiag_cp.integrations.trainer import BlockdiagCPTrainer


def add_schedule_arguments(p) -> None:
    """Steps, packs per step, CP size, seed, optimizer, checkpointing."""
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--packs-per-step", type=int, default=4, help="global batch: packs per optimizer step (split over DP)")
    p.add_argument("--cp-size", type=int, default=None, help="CP group size (default: number of processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant activation checkpointing")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="hub id or local path (default: a tiny Llama config, random init)")
    p.add_argument("--dataset", default=None, help="a datasets name or local data file(s) with `input_ids` or `text` "
                   "(text becomes byte tokens; default: the embedded stdlib corpus)")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per pack (a multiple of 2*cp)")
    add_schedule_arguments(p)
    add_cp_config_arguments(p)
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (packing and sharding run there)")
    p.add_argument("--eval", action="store_true", help="hold out the last --eval-docs documents; after training print "
                   "eval_loss (sharded evaluation under CP: token-weighted over every eval target)")
    p.add_argument("--eval-docs", type=int, default=64, help="documents held out by --eval")
    p.add_argument("--output-dir", default="out/trainer_packed", help="write metrics.json, loss.png and the final model here")
    args = p.parse_args(argv)
    check_ranges(p, args, positive=("max_tokens", "steps", "packs_per_step", "lr", "eval_docs"),
                 non_negative=("num_workers", "max_grad_norm"))
    return args


def build_model(args):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every layout
    kwargs = dict(attn_implementation=bdcp.ATTN_IMPLEMENTATION, dtype=torch.float32)
    if args.model is None:
        model = AutoModelForCausalLM.from_config(tiny_config("llama", corpus.VOCAB_SIZE, args.max_tokens), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)  # BlockdiagCPTrainer applies model patches
    if model.config.vocab_size < corpus.VOCAB_SIZE:
        raise ValueError(f"--model vocab_size={model.config.vocab_size} is smaller than the byte vocabulary ({corpus.VOCAB_SIZE})")
    model.config.use_cache = False  # training: no KV cache (BlockdiagCPCallback checks it)
    return model


def load_training_data(args):
    """A `datasets.Dataset` of documents with `input_ids` (byte tokens for text; id 0 = padding)."""
    if args.dataset is None:  # the demo cuts its corpus to the pack size: no split warning
        return corpus.load_corpus(max_length=args.max_tokens)
    raw = load_raw_dataset(args.dataset)
    if "input_ids" in raw.column_names:
        return raw.select_columns(["input_ids"] + (["labels"] if "labels" in raw.column_names else []))
    if "text" not in raw.column_names:
        raise ValueError(f"--dataset needs an `input_ids` or `text` column; columns: {raw.column_names}")
    data = raw.map(lambda b: {"input_ids": [corpus.encode_bytes(t or "").tolist() for t in b["text"]]},
                   batched=True, remove_columns=raw.column_names)
    data = data.filter(lambda ids: len(ids) > 0, input_columns="input_ids")
    if len(data) == 0:
        raise ValueError(f"every one of the {len(raw)} rows of column 'text' is empty, and empty documents are "
                         "dropped: no document is left")
    return data


def training_arguments(args, world_size: int, cp_size: int):
    from transformers import TrainingArguments

    dp_size = world_size // cp_size
    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not torch.cuda.is_available()
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=args.packs_per_step // dp_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        optim="sgd" if args.optimizer == "sgd" else "adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.95,
        weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        **checkpointing_arguments(args.gradient_checkpointing),
        dataloader_drop_last=True,
        dataloader_num_workers=args.num_workers,
        remove_unused_columns=False,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=use_cpu,
        seed=args.seed,
    )



def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = check_launch(args)  # before any collective or load: a bad argument ends every rank with one line
    cp_size = world_size if args.cp_size is None else args.cp_size
    train_data, eval_data = loaded("--dataset", load_training_data, args), None
    if args.eval:
        n = len(train_data)
        held_out = min(args.eval_docs, n - 1)
        train_data, eval_data = train_data.select(range(n - held_out)), train_data.select(range(n - held_out, n))
    trainer = BlockdiagCPTrainer(
        model=loaded("--model", build_model, args),
        args=training_arguments(args, world_size, cp_size),
        train_dataset=train_data,
        eval_dataset=eval_data,
        cp_size=cp_size,
        max_tokens=args.max_tokens,
        pad_token_id=corpus.PAD_TOKEN_ID,
        cp_config=cp_config_from_args(args),
    )
    trainer.train()
    metrics = trainer_metrics(trainer, trainer.args.world_size, cp_size)
    if args.eval:
        evaluated = trainer.evaluate()
        metrics.update(eval_loss=evaluated["eval_loss"], eval_tokens=evaluated["eval_tokens"])
        if trainer.is_world_process_zero():
            print(json.dumps({"eval_loss": evaluated["eval_loss"], "eval_tokens": evaluated["eval_tokens"]}))
    if args.output_dir:
        trainer.save_model(args.output_dir)
    report_run(trainer, args, metrics, "Trainer")
    return 0


def report_run(trainer, args, metrics: dict, what: str, **extra) -> None:
    """Rank 0: the losses and throughput (and `extra`) as one JSON line, and the outputs of `--output-dir`."""
    if trainer.is_world_process_zero():
        print(json.dumps({"losses": metrics["losses"], "tokens_per_second": round(metrics["tokens_per_second"], 1), **extra}))
        if args.output_dir:
            write_outputs(Path(args.output_dir), metrics, f"{what}, dp={metrics['dp_size']} x cp={metrics['cp_size']}")


if __name__ == "__main__":
    with process_group_closed(), one_line_errors():
        sys.exit(main())

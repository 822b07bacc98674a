"""Supervised fine-tuning with TRL's `SFTTrainer` on packed documents under block-diagonal CP.

    torchrun --standalone --nproc-per-node 2 examples/sft_trl.py --steps 20 --output-dir out/sft_trl
    torchrun --standalone --nproc-per-node 4 examples/sft_trl.py --cp-size 2 --eval     # CPU: dp=2 x cp=2
    accelerate launch --num_processes 8 examples/sft_trl.py --cp-size 4 --bf16 --attn-backend fa4 --fused-ce

Defaults: a tiny Llama built from a config (fp32, random init, seed `--seed`), a character-level
tokenizer built in the script and a generated prompt/completion dataset (sums: "What is 37 + 85?"
-> "122"), so it runs offline. TRL tokenizes it, masks the prompts with -100 (completion-only
loss, TRL's default for prompt/completion data) and packs the documents (strategy bfd) into
packs of `--max-length` tokens; `BlockdiagCPSFTTrainer` trains every pack sharded over the CP
group, exactly per document. Same optimizer and schedule as `examples/trainer_packed.py`.

What goes where (the part a user copies):

- model: `attn_implementation="blockdiag_cp"` (after `import hf_blockdiag_cp`).
- `SFTConfig`: `packing=True`, `max_length` = the pack size (a multiple of 2*cp),
  `per_device_train_batch_size=1`, `gradient_accumulation_steps` = packs per step / dp,
  `bf16` explicitly (TRL's default is True); never `parallelism_config` (accelerate's own CP).
- `BlockdiagCPSFTTrainer(model=..., args=..., train_dataset=..., processing_class=tokenizer,
  cp_size=..., cp_config=CPConfig(attn_backend=...))`, no `data_collator`.

Writes, with `--output-dir DIR`: `DIR/metrics.json` (`losses` per optimizer step as the Trainer
logged them, `tokens_per_second`, `cp_size`, `dp_size`, `eval_loss` with `--eval`, ...) and
`DIR/loss.png`.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.integrations.demo import char_tokenizer, tiny_config
from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy
from hf_blockdiag_cp.integrations.scripts import (
    OneLineParser, add_cp_config_arguments, check_launch, check_ranges, checkpointing_arguments, config_error,
    cp_config_from_args, dataset_error, layout_error, load_raw_dataset, loaded, one_line_errors, process_group_closed,
    tokenizer_error, trainer_metrics, write_outputs,
)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="hub id or local path, with its tokenizer (default: a tiny Llama "
                   "config, random init, and a character tokenizer)")
    p.add_argument("--dataset", default=None, help="a datasets name or a local json/jsonl/csv/parquet/txt file in a format "
                   "SFTTrainer takes (text, messages, prompt/completion, input_ids; default: generated sums)")
    p.add_argument("--examples", type=int, default=4000, help="generated prompt/completion examples (default dataset)")
    p.add_argument("--max-length", type=int, default=512, help="tokens per pack: SFTConfig.max_length (a multiple of 2*cp)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--packs-per-step", type=int, default=4, help="global batch: packs per optimizer step (split over DP)")
    p.add_argument("--cp-size", type=int, default=None, help="CP group size (default: number of processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    add_cp_config_arguments(p)
    p.add_argument("--fused-ce", action="store_true", help="Liger fused linear cross-entropy as the loss (CUDA with the "
                   "[liger] extra, else the stock loss stays and says so)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (padding and sharding run there)")
    p.add_argument("--eval", action="store_true", help="hold out --eval-examples examples; after training print "
                   "eval_loss (sharded evaluation: token-weighted over every completion target)")
    p.add_argument("--eval-examples", type=int, default=200, help="examples held out by --eval")
    p.add_argument("--output-dir", default="out/sft_trl", help="write metrics.json and loss.png here")
    args = p.parse_args(argv)
    check_ranges(p, args, positive=("examples", "max_length", "steps", "packs_per_step", "lr", "eval_examples"),
                 non_negative=("num_workers", "max_grad_norm"))
    return args


def argument_error(args, world_size: int) -> str | None:
    """Why `args` cannot run on `world_size` processes (sizes, then kernel, exchange and layout names,
    then a local `--dataset` file), or None."""
    return layout_error(args, world_size, pack_flag="max_length") or config_error(args) or dataset_error(args)


# --------------------------------------------------------------------------- tokenizer, model, data


def build_model_and_tokenizer(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    kwargs = dict(attn_implementation=bdcp.ATTN_IMPLEMENTATION, dtype=torch.float32)
    if args.model is None:
        tokenizer = char_tokenizer()
        model = AutoModelForCausalLM.from_config(tiny_config("llama", len(tokenizer), args.max_length), **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        reason = tokenizer_error(tokenizer)  # a folder without tokenizer files loads an empty one
        if reason is not None:
            raise ValueError(f"{args.model!r}: {reason}; add the tokenizer files to the model folder")
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)  # the trainer applies model patches
    model.config.use_cache = False
    if args.fused_ce:
        enable_fused_cross_entropy(model)  # before the trainer: TRL wraps the forward it finds
    return model, tokenizer


def sums(n: int, seed: int):
    """`n` generated prompt/completion examples: "What is a + b? " -> "a+b"."""
    from datasets import Dataset

    rng = random.Random(seed)
    pairs = [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"What is {a} + {b}? " for a, b in pairs],
                              "completion": [str(a + b) for a, b in pairs]})


def load_data(args):
    if args.dataset is None:
        return sums(args.examples, args.seed)
    return load_raw_dataset(args.dataset)


def sft_config(args, world_size: int, cp_size: int):
    """One pack per micro-batch, `--packs-per-step` packs per optimizer step over the DP replicas, AdamW
    (betas 0.9/0.95, no weight decay) or SGD at a constant rate; TRL packs (bfd) to `--max-length`."""
    from trl import SFTConfig

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true") or not torch.cuda.is_available()
    return SFTConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=1,
        gradient_accumulation_steps=args.packs_per_step // (world_size // cp_size), learning_rate=args.lr,
        lr_scheduler_type="constant", optim="sgd" if args.optimizer == "sgd" else "adamw_torch", adam_beta1=0.9,
        adam_beta2=0.95, weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        **checkpointing_arguments(args.gradient_checkpointing), dataloader_drop_last=True,
        dataloader_num_workers=args.num_workers, remove_unused_columns=False, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=use_cpu, seed=args.seed,
        packing=True, packing_strategy="bfd", max_length=args.max_length,
        bf16=args.bf16)  # explicit: TRL's default is True



def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = check_launch(args, argument_error)  # before any collective: a bad argument ends every rank with one line
    cp_size = world_size if args.cp_size is None else args.cp_size
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer

    data, eval_data = loaded("--dataset", load_data, args), None
    if args.eval:
        held_out = min(args.eval_examples, len(data) - 1)
        data, eval_data = data.select(range(len(data) - held_out)), data.select(range(len(data) - held_out, len(data)))
    model, tokenizer = loaded("--model", build_model_and_tokenizer, args)
    trainer = BlockdiagCPSFTTrainer(
        model=model,
        args=sft_config(args, world_size, cp_size),
        train_dataset=data,
        eval_dataset=eval_data,
        processing_class=tokenizer,
        cp_size=cp_size,
        cp_config=cp_config_from_args(args),
    )
    trainer.train()
    metrics = trainer_metrics(trainer, world_size, cp_size)
    if args.eval:
        evaluated = trainer.evaluate()
        metrics.update(eval_loss=evaluated["eval_loss"], eval_tokens=evaluated["eval_tokens"])
    if trainer.is_world_process_zero():
        shown = {"eval_loss": metrics["eval_loss"]} if args.eval else {}
        print(json.dumps({"losses": metrics["losses"], "tokens_per_second": round(metrics["tokens_per_second"], 1),
                          **shown}))
        if args.output_dir:
            write_outputs(Path(args.output_dir), metrics, f"SFT, dp={metrics['dp_size']} x cp={cp_size}")
    return 0


if __name__ == "__main__":
    with process_group_closed(), one_line_errors():
        sys.exit(main())

"""RL with TRL's `GRPOTrainer` whose log-probs run packed under block-diagonal CP.

    torchrun --standalone --nproc-per-node 2 examples/train_grpo.py --steps 5 --output-dir out/train_grpo
    torchrun --standalone --nproc-per-node 4 examples/train_grpo.py --cp-size 2         # CPU: dp=2 x cp=2
    accelerate launch --num_processes 8 examples/train_grpo.py --cp-size 4 --bf16 --attn-backend fa4

Defaults: a tiny Llama built from a config (`--tiny-arch qwen3_5` for the hybrid; fp32, random init,
seed `--seed`), a character-level tokenizer (`integrations.demo`), and prompts made from the
Python standard library (the first line of its top-level functions, from the embedded corpus), so it
runs offline. The reward is computed from the text: the share of vowels among the completion's
characters.
Generation is TRL's (the model's `generate`, outside any CP step; each rank samples completions
for its own prompts, as in TRL); then each CP group packs its ranks' prompt + completion rows,
shards the pack and scores it in one CP step, exactly per sequence (docs/usage.md, "RL").

What goes where (the part a user copies):

- the policy: a path or Hub id with `GRPOConfig(model_init_kwargs={"attn_implementation":
  "blockdiag_cp"})` (after `import hf_blockdiag_cp`); TRL loads the reference from the same path;
- `GRPOConfig`: TRL's own settings (`num_generations`, `max_completion_length`, `beta`, `loss_type`,
  `per_device_train_batch_size` = completions per rank and micro-batch, `bf16` explicitly); never
  `parallelism_config` (accelerate's own CP), `use_liger_kernel` or an entropy bonus;
- `BlockdiagCPGRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...,
  processing_class=tokenizer, cp_size=..., cp_config=CPConfig(attn_backend=...))`.

Writes, with `--output-dir DIR`: `DIR/metrics.json` (`losses` per optimizer step as the Trainer
logged them, `trl`: TRL's metrics per step (`reward`, `kl`, `entropy`, `completions/mean_length`,
...), `tokens_per_second`, `cp_size`, `dp_size`, `world_size`) and `DIR/loss.png`.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.integrations.demo import CHAR_SPECIAL_TOKENS, char_tokenizer, tiny_config
from hf_blockdiag_cp.integrations.scripts import (
    OneLineParser, add_cp_config_arguments, check_launch, check_ranges, checkpointing_arguments, config_error,
    cp_config_from_args, loaded, one_line_errors, process_group_closed, write_outputs,
)

VOWELS = "aeiou"  # the reward: their share among a completion's characters
TRL_METRICS = ("reward", "reward_std", "rewards/vowel_share/mean", "kl", "entropy", "completions/mean_length",
               "completions/clipped_ratio", "clip_ratio/region_mean", "num_tokens")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=256, help="prompts made from the stdlib")
    p.add_argument("--tiny-arch", default="llama", choices=("llama", "qwen3_5"), help="the tiny model's family")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--cp-size", type=int, default=None, help="CP group size (default: number of processes)")
    p.add_argument("--completions-per-rank", type=int, default=8, help="GRPOConfig.per_device_train_batch_size")
    p.add_argument("--num-generations", type=int, default=4, help="GRPOConfig.num_generations: completions per prompt")
    p.add_argument("--max-completion-length", type=int, default=32, help="GRPOConfig.max_completion_length")
    p.add_argument("--beta", type=float, default=0.04, help="GRPOConfig.beta: the KL term's weight (0: no reference)")
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (grpo, bnpo, dr_grpo, dapo, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="non-reentrant activation checkpointing")
    add_cp_config_arguments(p)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    p.add_argument("--output-dir", default="out/train_grpo", help="write metrics.json and loss.png here")
    args = p.parse_args(argv)
    check_ranges(p, args, positive=("prompts", "steps", "completions_per_rank", "num_generations",
                                    "max_completion_length", "lr"), non_negative=("beta", "max_grad_norm"))
    return args


def argument_error(args, world_size: int) -> str | None:
    """Why `args` cannot run on `world_size` processes, or None (checked before anything loads)."""
    cp = world_size if args.cp_size is None else args.cp_size
    if cp <= 0 or world_size % cp:
        return f"--cp-size {cp} must divide the number of processes ({world_size})"
    if (args.completions_per_rank * world_size) % args.num_generations:
        return (f"--completions-per-rank {args.completions_per_rank} x {world_size} processes must be a multiple of "
                f"--num-generations {args.num_generations} (TRL's generation batch holds whole groups)")
    return config_error(args)


def build_model_and_tokenizer(args, directory: str):
    """The initial policy (seeded: the same weights on every rank), saved in `directory` (TRL loads the
    policy and, with beta > 0, its reference from a path), and the character tokenizer."""
    from transformers import AutoModelForCausalLM

    tokenizer = char_tokenizer()
    torch.manual_seed(args.seed)
    config = tiny_config(args.tiny_arch, len(tokenizer), 2048)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    return directory, tokenizer


def stdlib_prompts(count: int, seed: int):
    """Up to `count` prompts: the first line of the stdlib's top-level functions whose characters the
    tokenizer has, shuffled by `seed`."""
    from datasets import Dataset

    characters = set(char_tokenizer().get_vocab())
    rows = []
    for doc in corpus.documents():
        line = doc.text.decode("utf-8", "replace").split("\n", 1)[0]
        special = any(t in line for t in CHAR_SPECIAL_TOKENS)
        if line.startswith("def ") and set(line) <= characters and not special:
            rows.append({"prompt": line + "\n"})
    if not rows:
        raise ValueError("the stdlib corpus gave no prompt")
    random.Random(seed).shuffle(rows)
    return Dataset.from_list(rows[:count])


def vowel_share(completions, **kwargs) -> list[float]:
    """The reward: the share of VOWELS among each completion's characters (the character tokenizer
    decodes with a space between tokens; spaces are not counted)."""
    rewards = []
    for text in completions:
        characters = text.replace(" ", "")
        rewards.append(sum(c in VOWELS for c in characters) / max(len(characters), 1))
    return rewards


def grpo_config(args, world_size: int):
    from trl import GRPOConfig

    use_cpu = not torch.cuda.is_available()
    return GRPOConfig(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.completions_per_rank,
        num_generations=args.num_generations, max_completion_length=args.max_completion_length, beta=args.beta,
        loss_type=args.loss_type, learning_rate=args.lr, lr_scheduler_type="constant",
        optim="sgd" if args.optimizer == "sgd" else "adamw_torch", max_grad_norm=args.max_grad_norm,
        **checkpointing_arguments(args.gradient_checkpointing), bf16=args.bf16, logging_steps=1, save_strategy="no",
        report_to="none", use_cpu=use_cpu, seed=args.seed, disable_tqdm=True,
        model_init_kwargs={"attn_implementation": bdcp.ATTN_IMPLEMENTATION, "dtype": "float32"})


def run_metrics(trainer, world_size: int, cp_size: int) -> dict:
    steps = [h for h in trainer.state.log_history if "loss" in h]
    final = next(h for h in reversed(trainer.state.log_history) if "train_runtime" in h)
    return {
        "losses": [h["loss"] for h in steps],
        "trl": {name: [h[name] for h in steps] for name in TRL_METRICS if all(name in h for h in steps)},
        "tokens_per_second": trainer.state.num_input_tokens_seen / final["train_runtime"],
        "cp_size": cp_size, "dp_size": world_size // cp_size, "world_size": world_size,
        "loss_label": "GRPO loss",
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    world_size = check_launch(args, argument_error)  # before any collective: a bad argument ends every rank with one line
    cp_size = world_size if args.cp_size is None else args.cp_size
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPGRPOTrainer

    prompts = loaded("--prompts", stdlib_prompts, args.prompts, args.seed)
    with tempfile.TemporaryDirectory() as directory:  # each rank its own copy of the same weights
        model, tokenizer = build_model_and_tokenizer(args, directory)
        trainer = BlockdiagCPGRPOTrainer(model=model, reward_funcs=vowel_share, args=grpo_config(args, world_size),
                                         train_dataset=prompts, processing_class=tokenizer, cp_size=cp_size,
                                         cp_config=cp_config_from_args(args))
    trainer.train()
    metrics = run_metrics(trainer, world_size, cp_size)
    if trainer.is_world_process_zero():
        print({"losses": metrics["losses"], "reward": metrics["trl"].get("reward")})
        if args.output_dir:
            write_outputs(Path(args.output_dir), metrics, f"GRPO, dp={metrics['dp_size']} x cp={cp_size}")
    return 0


if __name__ == "__main__":
    with process_group_closed(), one_line_errors():
        sys.exit(main())

"""Train a causal LM on packed documents with block-diagonal context parallelism (custom loop).

    torchrun --standalone --nproc-per-node 2 examples/train_packed.py --steps 20 --output-dir out/train_packed
    torchrun --standalone --nproc-per-node 4 examples/train_packed.py --cp-size 2           # CPU: dp=2 x cp=2
    accelerate launch --num_processes 8 examples/train_packed.py --cp-size 4 --bf16         # GPUs: NCCL
    torchrun --standalone --nproc-per-node 2 examples/train_packed.py --tiny-arch qwen3_5   # a tiny hybrid
    torchrun --standalone --nproc-per-node 2 examples/train_packed.py --tiny-arch nemotron_h  # Mamba2 hybrid
    torchrun --standalone --nproc-per-node 2 examples/train_packed.py --tiny-arch lfm2        # short-conv hybrid

Defaults: a tiny Llama built from a config (fp32, random init; `--tiny-arch qwen3_5`: a tiny
Qwen3.5 hybrid, `nemotron_h`: a tiny Nemotron-H Mamba2 hybrid, `lfm2`: a tiny LFM2 short-convolution
hybrid), trained offline on the embedded
corpus (`hf_blockdiag_cp.data.corpus`: top-level units of the Python standard library, byte
tokens; a unit longer than `--max-tokens` is cut into pack-sized pieces, each its own document),
cp = number of processes.

Loss (the same number for any dp x cp): per optimizer step, the token-weighted mean
cross-entropy over every target token of the step's `--packs-per-step` packs,

    loss_step = sum of token losses over the step's packs / number of target tokens N.

Each DP replica trains `packs_per_step / dp` of those packs by gradient accumulation; each
CP rank of a replica holds a shard of every pack. A rank backpropagates
`(its token-loss sum) * W / N` (W = dp * cp ranks, N all-reduced before the step), and DDP /
FSDP2 average gradients over the W ranks, so the update is the gradient of `loss_step`. The
logged value is the world sum of those per-rank losses divided by W, which is `loss_step`.
A single process computes exactly this sum over the same packs.

Data order: the packed sampler plans each epoch's packs identically on every rank and deals
pack i to replica i % dp; a step takes the next `packs_per_step` packs of that global order.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.data import packed_dataloader
from hf_blockdiag_cp.integrations.accelerate import gradient_sync, init_parallel, unwrap_model, wrap_model
from hf_blockdiag_cp.integrations.demo import TINY_ARCHS, tiny_config
from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy
from hf_blockdiag_cp.integrations.scripts import (
    OneLineParser, add_cp_config_arguments, check_launch, check_ranges, cp_config_from_args, load_raw_dataset, loaded,
    one_line_errors, process_group_closed, tokenizer_error, write_outputs,
)

IGNORE_INDEX = -100


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="hub id or local path (default: a tiny model from a config, random init)")
    p.add_argument("--tiny-arch", choices=TINY_ARCHS, default=None, help="architecture of the default tiny model: "
                   "llama (default), qwen3_5 (gated delta-rule + full-attention layers), nemotron_h "
                   "(Mamba2 + attention + MLP layers) or lfm2 (short gated convolution + full-attention layers)")
    p.add_argument("--random-init", action="store_true", help="with --model: build from its config, random weights")
    p.add_argument("--dataset", default=None, help="a datasets name, or local json/jsonl/csv/parquet/txt file(s) or folder "
                   "(default: the embedded stdlib corpus)")
    p.add_argument("--dataset-config", default=None, help="datasets configuration name")
    p.add_argument("--split", default="train")
    p.add_argument("--byte-tokens", action="store_true", help="tokenize text as bytes (id = byte + 1) even with --model")
    p.add_argument("--text-column", default="text", help="text column to tokenize when the dataset has no input_ids")
    p.add_argument("--max-tokens", type=int, default=1024, help="tokens per pack (a multiple of 2*cp)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--packs-per-step", type=int, default=4, help="global batch: packs per optimizer step (split over DP)")
    p.add_argument("--cp-size", type=int, default=None, help="CP group size (default: number of processes)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: plain SGD (makes gradient "
                   "scale errors visible in the losses; Adam and clipping hide them)")
    p.add_argument("--max-grad-norm", type=float, default=1.0, help="gradient clipping (0: off)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard over dp x cp instead of DDP")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 weights and optimizer)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    add_cp_config_arguments(p)
    p.add_argument("--fused-ce", action="store_true", help="Liger fused linear cross-entropy as the loss (no logits of "
                   "the pack length; CUDA with the [liger] extra, else the stock loss stays and says so)")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers (packing and sharding run there)")
    p.add_argument("--output-dir", default="out/train_packed", help="write metrics.json and loss.png here")
    args = p.parse_args(argv)
    check_ranges(p, args, positive=("max_tokens", "steps", "packs_per_step", "lr"),
                 non_negative=("num_workers", "max_grad_norm"))
    if args.random_init and args.model is None:
        p.error("--random-init needs --model (the default model is already randomly initialised)")
    if args.tiny_arch is not None and args.model is not None:
        p.error("--tiny-arch chooses the default tiny model; it cannot be combined with --model")
    args.tiny_arch = args.tiny_arch or "llama"
    return args


# --------------------------------------------------------------------------- model and data


def build_model(args, vocab_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(attn_implementation=bdcp.ATTN_IMPLEMENTATION, dtype=torch.float32)
    torch.manual_seed(args.seed)  # identical initial weights on every rank and in every layout
    if args.model is None:
        model = AutoModelForCausalLM.from_config(tiny_config(args.tiny_arch, vocab_size, args.max_tokens), **kwargs)
    elif args.random_init:
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(args.model), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    if model.config.vocab_size < vocab_size:
        raise ValueError(f"model vocab_size={model.config.vocab_size} is smaller than the data's token range ({vocab_size})")
    model.config.use_cache = False
    bdcp.apply_model_patches(model)  # per-family patches (e.g. Phi-3's RoPE from the global pack); idempotent
    if args.gradient_checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    return model.train()


def load_tokenizer(args):
    """The model's tokenizer when text must be tokenized for `--model`, else None (byte tokens)."""
    if args.model is None or args.byte_tokens:
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{args.model!r} has no loadable tokenizer ({exc}); pass --byte-tokens to train on bytes") from exc
    reason = tokenizer_error(tokenizer)  # a folder without tokenizer files loads an empty one
    if reason is not None:
        raise ValueError(f"{args.model!r}: {reason}; add the tokenizer files, or pass --byte-tokens to train on bytes")
    return tokenizer


def load_training_data(args, tokenizer=...):
    """`(dataset with input_ids, pad_token_id, token range)` for the chosen data and `tokenizer`
    (default: `load_tokenizer(args)`)."""
    import datasets

    if tokenizer is ...:
        tokenizer = load_tokenizer(args)
    if args.dataset is None and tokenizer is None:  # the demo cuts its corpus to the pack size: no split warning
        return corpus.load_corpus(max_length=args.max_tokens), corpus.PAD_TOKEN_ID, corpus.VOCAB_SIZE
    if args.dataset is None:
        raw = datasets.Dataset.from_dict({"text": [d.text.decode("utf-8", "replace") for d in corpus.documents()]})
        text_column = "text"
    else:
        raw = load_raw_dataset(args.dataset, args.split, args.dataset_config)
        text_column = args.text_column
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
    if len(raw) == 0:
        raise ValueError(f"{args.dataset!r} (split {args.split!r}) holds no row: nothing to train on")
    if "input_ids" in raw.column_names:  # already tokenized
        data = raw.select_columns(["input_ids"] + (["labels"] if "labels" in raw.column_names else []))
        vocab = len(tokenizer) if tokenizer is not None else max((max(ids) for ids in data["input_ids"] if ids), default=0) + 1
        return data, pad, vocab
    if text_column not in raw.column_names:
        raise ValueError(f"--text-column {text_column!r} is not a column of the dataset; columns: {raw.column_names}")
    if tokenizer is None:
        def encode(batch):
            return {"input_ids": [corpus.encode_bytes(t or "").tolist() for t in batch[text_column]]}
        pad, vocab = corpus.PAD_TOKEN_ID, corpus.VOCAB_SIZE
    else:
        def encode(batch):
            return {"input_ids": tokenizer([t or "" for t in batch[text_column]], add_special_tokens=False)["input_ids"]}
        vocab = len(tokenizer)
    data = raw.map(encode, batched=True, remove_columns=raw.column_names, keep_in_memory=True, desc="tokenizing")
    data = data.filter(lambda ids: len(ids) > 0, input_columns="input_ids", keep_in_memory=True)  # empty text: no document
    if len(data) == 0:
        raise ValueError(f"every one of the {len(raw)} texts of column {text_column!r} tokenized to no token, and "
                         "documents without a token are dropped: no document is left. Check --text-column and the "
                         "tokenizer")
    return data, pad, vocab


def step_batches(loader, micro_steps: int):
    """Lists of `micro_steps` local batches, one list per optimizer step, epoch after epoch.

    An epoch's incomplete last group is dropped, so the packs of every step are the same
    global packs for any dp (the sampler drops the incomplete last round of dp packs).
    """
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        group, yielded = [], False
        for batch in loader:
            group.append(batch)
            if len(group) == micro_steps:
                yield group
                group, yielded = [], True
        if not yielded:
            raise ValueError(f"the dataset gives fewer than {micro_steps} packs per replica in an epoch; lower --packs-per-step")
        epoch += 1


def to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def world_sum(values: list[float], device: torch.device, dtype=torch.float64) -> list[float]:
    t = torch.tensor(values, dtype=dtype, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


# --------------------------------------------------------------------------- training


def build_optimizer(args, model) -> torch.optim.Optimizer:
    """AdamW (betas 0.9/0.95, no weight decay) or plain SGD, as `--optimizer` says."""
    if args.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=args.lr)
    return torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)


def run_metrics(args, place, device, losses, real_tokens, elapsed, model, num_documents) -> dict:
    """What metrics.json records of a run (the same on every rank)."""
    packs = args.steps * args.packs_per_step
    return {
        "losses": losses,
        "tokens_per_second": real_tokens / elapsed,
        "cp_size": place.cp_size,
        "dp_size": place.dp_size,
        "world_size": place.world_size,
        "steps": args.steps,
        "packs_per_step": args.packs_per_step,
        "max_tokens": args.max_tokens,
        "packing_efficiency": real_tokens / (packs * args.max_tokens),
        "real_tokens": real_tokens,
        "wall_time_s": elapsed,
        "seed": args.seed,
        "lr": args.lr,
        "optimizer": args.optimizer,
        "engine": "single" if place.world_size == 1 else ("fsdp2" if args.fsdp else "ddp"),
        "device": device.type,
        "dtype": "bf16-autocast" if args.bf16 else "fp32",
        "model": args.model or f"tiny-{args.tiny_arch} (config)",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "num_documents": num_documents,
        "loss": "token-weighted mean cross-entropy over all target tokens of the step's packs",
    }


def train(args) -> dict:
    """Run `args.steps` optimizer steps on this rank; every rank returns the same metrics."""
    from tqdm.auto import tqdm

    setup = init_parallel(cp=args.cp_size)
    place, device = setup.dims, setup.device
    micro_steps = args.packs_per_step // place.dp_size
    mesh = place.build_mesh(device.type)  # one process: a mesh of one
    cp_mesh = mesh.cp
    config = cp_config_from_args(args)

    tokenizer = loaded("--model", load_tokenizer, args)  # its errors name --model, the data's --dataset
    dataset, pad_token_id, vocab = loaded("--dataset", load_training_data, args, tokenizer)
    loader = packed_dataloader(
        dataset, args.max_tokens, dp_size=place.dp_size, dp_rank=place.dp_rank, cp_size=place.cp_size,
        cp_rank=place.cp_rank, pad_token_id=pad_token_id, seed=args.seed, num_workers=args.num_workers, drop_last=True,
        cp_config=config,  # the collator shards each pack with the configured layout
    )
    model = loaded("--model", build_model, args, vocab).to(device)
    if args.fused_ce:
        enable_fused_cross_entropy(model)
    model = wrap_model(model, mesh, fsdp=args.fsdp)
    optimizer = build_optimizer(args, model)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)

    losses, real_tokens, started = [], 0, None
    bar = tqdm(total=args.steps, disable=not place.is_main, desc=f"dp={place.dp_size} cp={place.cp_size}", unit="step")
    batches = step_batches(loader, micro_steps)
    for step in range(1, args.steps + 1):
        micro = [to_device(b, device) for b in next(batches)]
        targets = sum(int((b["labels"] != IGNORE_INDEX).sum()) for b in micro)
        tokens = sum(int((b["document_ids"] > 0).sum()) for b in micro)
        n_targets, n_tokens = world_sum([targets, tokens], device)  # whole step, all replicas
        if started is None:
            started = time.perf_counter()
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(micro):
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(cp_mesh, None, batch, config=config, model=model)
            local["num_items_in_batch"] = max(n_targets, 1.0) / place.world_size  # loss = sum * W / N
            with gradient_sync(model, enabled=i == len(micro) - 1), train_ctx():
                with autocast:
                    loss = model(**local).loss
                loss.backward()
            loss_sum += loss.detach().double()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        (step_loss,) = world_sum([loss_sum.item()], device)
        step_loss /= place.world_size
        losses.append(step_loss)
        real_tokens += int(n_tokens)
        if not math.isfinite(step_loss):
            raise FloatingPointError(f"step {step}: loss is {step_loss}")
        if place.is_main:
            bar.update(1)
            bar.set_postfix(loss=f"{step_loss:.4f}")
            tqdm.write(f"step {step:4d}  loss {step_loss:.6f}")
    bar.close()
    elapsed = time.perf_counter() - started
    metrics = run_metrics(args, place, device, losses, real_tokens, elapsed, unwrap_model(model), len(dataset))
    if place.is_main:
        print(json.dumps({"losses": losses, "tokens_per_second": round(metrics["tokens_per_second"], 1)}))
        if args.output_dir:
            title = f"dp={place.dp_size} x cp={place.cp_size} ({metrics['engine']})"
            write_outputs(Path(args.output_dir), metrics, title)
    if dist.is_initialized():
        dist.barrier()
    return metrics


def main(argv=None) -> int:
    args = parse_args(argv)
    check_launch(args)  # before any collective: a bad argument ends every rank with one line
    with process_group_closed(), one_line_errors():
        train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

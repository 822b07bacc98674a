"""Models and the padded baseline of `bench model`: the default config of each `--arch`, the
stock / patched model pair, and the same documents unpacked and padded (`hf_padded`).

`--arch qwen3_5` is a ~1B Qwen3.5-style text hybrid: the released models' ratios scaled to
hidden 2048 (three gated delta-rule layers then one full-attention layer, repeated; linear
attention with twice as many value heads as key heads, key width hidden / 2, value width
hidden; full attention at head dim 256 with 4 query heads per KV head; MLP 3x hidden), with
the Llama config's vocabulary so the two architectures compare. `--arch nemotron_h` is a ~1.2B
Nemotron-H-style hybrid at the same hidden size: 24 layers, Mamba2 and MLP layers alternating with
one attention layer in four mixer layers (64 Mamba2 heads of 64 in 8 groups, state 128, 128-row
scan chunks; attention 16 heads of 128 on 4 KV heads; squared-ReLU MLP 4x hidden). `--arch lfm2` is
a ~1.3B LFM2-style hybrid (LFM2-1.2B's layout at the same vocabulary): 16 layers, 10 short gated
convolutions of kernel 3 and 6 attention layers (32 heads of 64 on 8 KV heads) at layers 2, 5, 8,
10, 12 and 14, SwiGLU MLP of 8192. Ours runs on
a deep copy with the model patches applied; the stock baselines run on the unpatched model, on
Transformers' own torch convolution, delta rule and Mamba2 scan unless `--stock-delta-rule
installed`, so that both sides run the same kernels (the patch's torch path calls those same
torch functions per document).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ..compat.transformers import enable_activation_checkpointing
from ..integrations.compile import compile_model
from ..integrations.memory import enable_checkpoint_offload, enable_tiled_mlp
from ..model_patches import apply_model_patches, patches_for
from ..model_patches.gated_delta import stock_torch_kernels

CONFIG_1B = dict(
    vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, max_position_embeddings=1 << 20, rope_theta=500000.0, tie_word_embeddings=True,
)
# Nemotron-H's pattern at 24 layers: (Mamba2, MLP) x 3 then (attention, MLP), three times
NEMOTRON_H_LAYERS = (["mamba", "mlp"] * 3 + ["attention", "mlp"]) * 3
LFM2_LAYERS = ["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]
CONFIGS = {
    "llama": ("LlamaConfig", CONFIG_1B),
    "qwen3_5": ("Qwen3_5TextConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, full_attention_interval=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=1 << 20,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=True,
    )),
    "nemotron_h": ("NemotronHConfig", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, layers_block_type=NEMOTRON_H_LAYERS,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
        ssm_state_size=128, conv_kernel=4, chunk_size=128, max_position_embeddings=1 << 20, tie_word_embeddings=True,
    )),
    "lfm2": ("Lfm2Config", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, block_auto_adjust_ff_dim=False, num_hidden_layers=16,
        layer_types=LFM2_LAYERS, num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3,
        max_position_embeddings=1 << 20, tie_word_embeddings=True,
    )),
}
# `--tiny`: the same architecture at toy sizes (CPU smoke runs of the script).
TINY = dict(vocab_size=101, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TINY_LINEAR = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
TINY_MAMBA2 = dict(mamba_num_heads=4, mamba_head_dim=8, n_groups=2, ssm_state_size=8, chunk_size=16)
# (block steps, rounds) per architecture when not given: the hybrids' stock token mixers are slow.
TIMING_DEFAULTS = {"llama": (3, 2), "qwen3_5": (3, 1), "nemotron_h": (3, 1), "lfm2": (3, 1)}


def build_config(args):
    """`--model`'s config, else `--arch`'s default (shrunk by `--tiny`); `--layers` applied, no cache."""
    import transformers

    if args.model:
        config = transformers.AutoConfig.from_pretrained(args.model)
        if args.layers:
            config.num_hidden_layers = args.layers
            if getattr(config, "layer_types", None):
                config.layer_types = config.layer_types[: args.layers]
    else:
        class_name, fields = CONFIGS[args.arch]
        fields = dict(fields, **(TINY if args.tiny else {}))
        if args.tiny and "linear_num_key_heads" in fields:
            fields.update(TINY_LINEAR)
        if args.tiny and "mamba_num_heads" in fields:
            fields.update(TINY_MAMBA2)
        if args.layers and "layers_block_type" in fields:  # NemotronH: its layer count is its pattern's
            fields["layers_block_type"] = fields["layers_block_type"][: args.layers]
        elif args.layers:
            fields["num_hidden_layers"] = args.layers
            if "layer_types" in fields:  # LFM2: the first layers of its pattern
                fields["layer_types"] = fields["layer_types"][: args.layers]
        config = getattr(transformers, class_name)(**fields)
    config.use_cache = False
    return config


@dataclass
class Models:
    """`stock`: the model as Transformers builds it (baselines); `ours`: the same weights with the
    model patches the architecture needs (the same object when it needs none; `patches` names
    them). `stock_kernels()` is the context the stock steps run in."""

    stock: torch.nn.Module
    ours: torch.nn.Module
    patches: tuple[str, ...]
    stock_kernels: Callable[[], contextlib.AbstractContextManager]


def build_models(args) -> Models:
    from transformers import AutoModelForCausalLM

    config = build_config(args)
    torch.manual_seed(0)
    with torch.device(args.device):  # initialised where it runs: a 1B model's CPU init costs a minute
        stock = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype), attn_implementation="sdpa")
    stock.to(args.device).train()
    ours, patches = stock, ()
    memory = getattr(args, "tiled_mlp", None) or getattr(args, "offload_checkpoints", False)
    compile_ours_only = args.compile != "none" and getattr(args, "eager_baselines", False)
    if patches_for(config) or memory or compile_ours_only:
        methods = list(args.methods) + list(args.fit_methods)
        ours = copy.deepcopy(stock) if any(not m.startswith("blockdiag_cp") for m in methods) else stock
        patches = apply_model_patches(ours)
    for model in {id(stock): stock, id(ours): ours}.values():
        if args.checkpointing:
            enable_activation_checkpointing(model, use_reentrant=False)
    if getattr(args, "tiled_mlp", None):
        enable_tiled_mlp(ours, args.tiled_mlp)
    if getattr(args, "offload_checkpoints", False):
        enable_checkpoint_offload(ours)
    if args.compile != "none":  # after the memory helpers: the compiled body runs inside their checkpoint
        for model in {id(stock): stock, id(ours): ours}.values():
            if model is ours or not compile_ours_only:
                compile_model(model, args.compile, backend=args.compile_backend)
    if args.stock_delta_rule == "torch":
        stock_kernels = functools.partial(stock_torch_kernels, stock)
    else:
        stock_kernels = contextlib.nullcontext
    return Models(stock, ours, patches, stock_kernels)


def padded_batches(lengths: list[int], input_ids: torch.Tensor, budget: int) -> tuple[list[dict], list[float], int]:
    """The pack's documents unpacked, longest first, right-padded into batches `[n, longest]` of at
    most `budget` padded tokens (0: one batch of every document), with attention_mask and labels
    (-100 on padding). Returns the batches, each batch's share of the pack's predicted tokens (so
    the weighted sum of their mean losses is the pack's mean) and the padded token count."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (budget <= 0 or (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= budget):
            groups[-1].append(i)
        else:
            groups.append([i])
    predicted = max(1, sum(n - 1 for n in lengths))
    batches, weights, padded = [], [], 0
    for group in groups:
        width = lengths[group[0]]
        ids = torch.zeros(len(group), width, dtype=input_ids.dtype, device=input_ids.device)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = input_ids[0, starts[i] : starts[i] + lengths[i]]
            mask[row, : lengths[i]] = 1
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
        weights.append(sum(lengths[i] - 1 for i in group) / predicted)
        padded += ids.numel()
    return batches, weights, padded


def padded_step(model, batches: list[dict], weights: list[float]) -> Callable[[], None]:
    """One fwd+bwd over every padded batch (gradients accumulated), as one training step."""

    def step():
        for batch, weight in zip(batches, weights):
            (model(**batch).loss * weight).backward()

    return step

"""The memory bound of one-GPU training of 8B-class models on long packs: what the weights, gradients,
optimizer state, checkpoints and the working set of one layer take, where, and the longest pack they
leave room for. Pure arithmetic from the real configs' shapes (parameters counted on the meta device,
no download, no GPU).

    python benchmarks/memory_bound.py                     # the markdown table of docs/performance.md
    python benchmarks/memory_bound.py --json /tmp/bound.json --gpu-gib 139 --host-gib 128

Models (`MODELS`, also built by benchmarks/long_pack.py): Llama-3.1-8B (hidden 4096, 32 layers, 32/8
heads of 128, MLP 14336, vocabulary 128256), Qwen3-8B (36 layers, MLP 12288, vocabulary 151936,
q/k norms) and a Qwen3.5-9B-class hybrid: `Qwen3_5TextConfig`'s defaults (hidden 4096, 32 layers, three
gated delta-rule layers then one gated full-attention layer; linear attention 16 key heads and 32 value
heads of 128, convolution 4; full attention 16/4 heads of 256, rotary on a quarter; MLP 12288;
vocabulary 248320; untied head: 8.95B parameters).

Modes (`MODES`): bytes per trainable parameter of weights / gradients / optimizer state and where they
live; bf16 compute everywhere, activation checkpointing of every decoder layer (its input kept).
  full-gpu          bf16 weights and gradients, fp32 AdamW moments, all on the GPU (12 B/param);
  full-gpu-bf16     `adamw_torch` on a bf16 model: its moments are bf16 too (8 B/param);
  fsdp2-offload     FSDP2 `CPUOffloadPolicy` through the Trainer with bf16=True: accelerate upcasts the
                    trainable weights to fp32 masters, so fp32 weights, gradients and moments on the host
                    (16 B/param); the GPU holds the bf16 copies of the units in flight;
  fsdp2-offload-bf16 the same on a bf16 model with bf16=False (8 B/param on the host);
  lora              PEFT LoRA r=16 on q/k/v/o and gate/up/down: the frozen bf16 base on the GPU, fp32
                    adapters with their gradients and moments (16 B per adapter parameter).

Per token (bytes): checkpoints = layers x hidden x 2 (one bf16 layer input per layer). The working set
of one layer (`layer_working_set`): the recomputed layer's saved activations plus the backward's
transients at its worst phase (MLP backward or token-mixer backward), with the MLP tiled
(`enable_tiled_mlp`: per-token MLP intermediates gone) and attention FA4-style (q, k, v, output and
log-sum-exp saved, fp32 dq/dk/dv accumulators; nothing [T, T]); the head chunked (Liger's fused linear
cross-entropy: a [T, hidden] gradient and one logits chunk of about [T, hidden] in fp32). Longest pack:
checkpoints on the GPU (GPU bytes per token = checkpoints + working set) or offloaded
(`enable_checkpoint_offload`: two layer inputs in flight on the GPU, every layer input in pinned host
memory), each limited by the GPU's and the host's free memory after their fixed parts; `pow2`: the same
when torch's caching host allocator rounds every pinned block up to a power of two (torch <= 2.11).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass

BF16, FP32 = 2, 4
GIB, KIB = 1 << 30, 1 << 10
TILED_MLP_TILE = 16384  # enable_tiled_mlp's tile in the long-pack runs (docs/performance.md)
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# name -> (transformers config class, its keyword arguments): the released models' shapes, random init.
MODELS = {
    "llama3_8b": ("LlamaConfig", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 21, rope_theta=500000.0,
        tie_word_embeddings=False)),
    "qwen3_8b": ("Qwen3Config", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=1 << 21, rope_theta=1000000.0,
        tie_word_embeddings=False)),
    "qwen3_5_9b": ("Qwen3_5TextConfig", dict(
        vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        max_position_embeddings=1 << 21,
        rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25),
        tie_word_embeddings=False)),
}


@dataclass(frozen=True)
class Mode:
    name: str
    weights: int  # bytes per trainable parameter
    grads: int
    optimizer: int
    states_on_host: bool  # weights, gradients and optimizer state on the host (FSDP2 CPUOffloadPolicy)
    lora: bool = False


MODES = (
    Mode("full-gpu", BF16, BF16, 2 * FP32, False),
    Mode("full-gpu-bf16", BF16, BF16, 2 * BF16, False),
    Mode("fsdp2-offload", FP32, FP32, 2 * FP32, True),
    Mode("fsdp2-offload-bf16", BF16, BF16, 2 * BF16, True),
    Mode("lora", FP32, FP32, 2 * FP32, False, lora=True),
)
# Usable bytes (what torch can allocate) and what the run leaves for anything else.
MACHINES = {"H200": 139, "H100": 78}  # GiB the CUDA allocator can take (141 GB and 80 GB cards)


def build_config(name: str, **overrides):
    import transformers

    cls, kwargs = MODELS[name]
    return getattr(transformers, cls)(**{**kwargs, **overrides})


def parameter_shapes(config) -> dict[str, tuple[int, ...]]:
    """name -> shape of every parameter of the causal LM built from `config` on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@dataclass
class Shapes:
    """What the arithmetic needs of one model."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    layer_kinds: list[str]
    params: int
    layer_params: int  # the largest decoder layer's
    mlp_params: int  # one layer's MLP
    head_params: int
    lora_params: int
    attn: dict  # q, kv widths, heads, qk_norm, gated, rotary dim
    linear: dict  # gated delta rule: k, v widths, value heads, head dims


def shapes_of(name: str) -> Shapes:
    config = build_config(name)
    shapes = parameter_shapes(config)
    numel = {n: math.prod(s) for n, s in shapes.items()}
    L = config.num_hidden_layers
    per_layer = [sum(v for n, v in numel.items() if f".layers.{i}." in n) for i in range(L)]
    lora = sum(LORA_RANK * (s[0] + s[1]) for n, s in shapes.items()
               if len(s) == 2 and n.split(".")[-2] in LORA_TARGETS)
    kinds = list(getattr(config, "layer_types", None) or ["full_attention"] * L)
    d = config.head_dim
    q = config.num_attention_heads * d
    gated = any(n.endswith("self_attn.q_proj.weight") and s[0] == 2 * q for n, s in shapes.items())
    rotary = int(d * (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0))
    attn = dict(q=q, kv=config.num_key_value_heads * d, heads=config.num_attention_heads, gated=gated, rotary=rotary,
                qk_norm=any(n.endswith("q_norm.weight") for n in shapes))
    linear = {}
    if "linear_attention" in kinds:
        linear = dict(k=config.linear_num_key_heads * config.linear_key_head_dim,
                      v=config.linear_num_value_heads * config.linear_value_head_dim,
                      heads=config.linear_num_value_heads, dk=config.linear_key_head_dim, dv=config.linear_value_head_dim)
    return Shapes(config.hidden_size, L, config.intermediate_size, config.vocab_size, kinds, sum(numel.values()),
                  max(per_layer), 3 * config.hidden_size * config.intermediate_size,
                  numel.get("lm_head.weight", 0), lora, attn, linear)


# --------------------------------------------------------------------------- per token


def mixer_bytes(s: Shapes, kind: str, lora: bool) -> tuple[float, float]:
    """(saved, backward transients) per token of one token mixer (attention or gated delta rule)."""
    E, H = BF16, s.hidden
    if kind == "linear_attention":
        k, v, lin = s.linear["k"], s.linear["v"], s.linear
        qkv = 2 * k + v
        # projections' output (the convolution's input), the convolution's output (SiLU's input), z,
        # fp32 gates and betas, fla's l2-normalised q and k, its output, the gated norm's output
        saved = E * (qkv + qkv + v + 2 * k + v + v) + FP32 * 2 * lin["heads"]
        state = lin["heads"] * lin["dk"] * lin["dv"] / 64  # chunk states per token (64-token chunks)
        transient = E * (2 * qkv + v) + state * (E + FP32)  # dqkv and the conv's, d(output); states and fp32 d(states)
        adapters = 0
    else:
        a = s.attn
        q, kv = a["q"], a["kv"]
        saved = E * (q + 2 * kv) + E * q + FP32 * a["heads"]  # the kernel's q, k, v, output; log-sum-exp
        saved += E * (q + kv) if a["qk_norm"] else 0  # q/k norms keep their inputs
        saved += E * 2 * q if a["gated"] else 0  # the output gate and its sigmoid
        transient = E * q + (E + FP32) * (q + 2 * kv)  # d(output); dq, dk, dv and their fp32 accumulators
        adapters = E * (3 * H + q)  # PEFT LoRA under autocast: each adapter keeps its own cast of its input
    return saved + (adapters if lora else 0), transient


def layer_working_set(s: Shapes, tiled: bool = True, lora: bool = False) -> dict[str, float]:
    """Bytes per token alive while one recomputed decoder layer runs its backward (its worst phase and
    layer kind), with the layer's input (the checkpoint) and the input gradient it returns counted."""
    E, H, I = BF16, s.hidden, s.intermediate
    common = 4 * E * H  # the layer input, the first norm's output, the residual sum, the second norm's output
    mlp_saved = 0 if tiled else 4 * E * I  # gate, up, act(gate), act(gate)*up
    mlp_grads = 2 * E * H if tiled else 3 * E * I  # tiled: the input gradient's tiles and their concatenation
    mlp_adapters = 0 if tiled or not lora else E * (2 * H + I)
    worst = {}
    for kind in sorted(set(s.layer_kinds)):
        saved, transient = mixer_bytes(s, kind, lora)
        mlp_phase = common + saved + mlp_saved + mlp_adapters + E * H + mlp_grads
        mixer_phase = common - 2 * E * H + saved + E * H + transient + E * H  # h, x2 freed; grad_h; grad_x
        worst[kind] = max(mlp_phase, mixer_phase)
    return worst


def pack_wide_bytes(s: Shapes) -> float:
    """Per token, alive the whole step: the rotary cos/sin, ids, labels, positions and the step's plan."""
    return BF16 * 2 * s.attn["rotary"] + 8 * 8


def head_working_set(s: Shapes) -> float:
    """Per token at the chunked head: the last hidden states, the final norm's output, their gradient and
    Liger's logits chunk (about [T, hidden] in fp32: it cuts T into vocab / hidden chunks)."""
    return 3 * BF16 * s.hidden + FP32 * s.hidden


# --------------------------------------------------------------------------- fixed parts and the bound


def fixed_bytes(s: Shapes, mode: Mode, tiled: bool = True) -> dict[str, float]:
    """Bytes of weights, gradients and optimizer state on the GPU and on the host, whatever the pack."""
    trainable = s.lora_params if mode.lora else s.params
    states = trainable * (mode.weights + mode.grads + mode.optimizer)
    tiled_sums = FP32 * s.mlp_params if tiled else 0  # the tiled MLP sums its weight gradients in fp32
    if mode.states_on_host:
        # FSDP2: the bf16 copies of two decoder-layer units (one prefetched) and one unit's gradient, the
        # head kept unsharded from its forward to its backward and its gradient
        gpu = BF16 * (3 * s.layer_params + 2 * s.head_params)
        host = states
    else:
        gpu = states + (BF16 * s.params if mode.lora else 0)
        host = 0.0
    return {"gpu": gpu + tiled_sums, "host": host}


def longest(free_gpu: float, free_host: float, gpu_per_token: float, host_per_token: float, layers: int = 1,
            pow2: bool = False) -> int:
    """Most tokens (a multiple of 1024) for which both the GPU and the host have room."""
    if free_gpu <= 0 or free_host < 0:
        return 0
    t = free_gpu / gpu_per_token
    if host_per_token:
        t = min(t, free_host / host_per_token)
        if pow2:  # each layer's pinned block rounded up to a power of two
            per_layer = free_host / layers
            t = min(t, 2 ** math.floor(math.log2(per_layer)) / (host_per_token / layers)) if per_layer > 0 else 0
    return int(t) // 1024 * 1024


def split_longest(free_gpu: float, free_host: float, gpu_per_token: float, checkpoints: float) -> int:
    """Most tokens with the checkpoints split between the GPU and the host (some layers' inputs offloaded,
    the rest kept): the machine's bound, T <= (free GPU + free host) / (checkpoints + GPU per token)."""
    if free_gpu <= 0 or free_host < 0:
        return 0
    t = min((free_gpu + free_host) / (checkpoints + gpu_per_token), free_gpu / gpu_per_token)
    return int(t) // 1024 * 1024


def bound_rows(names, gpu_gib: dict, host_gib: float, gpu_reserve_gib: float, host_reserve_gib: float) -> list[dict]:
    rows = []
    for name in names:
        s = shapes_of(name)
        checkpoints = s.layers * BF16 * s.hidden
        for mode in MODES:
            work = max(max(layer_working_set(s, lora=mode.lora).values()), head_working_set(s)) + pack_wide_bytes(s)
            fixed = fixed_bytes(s, mode)
            row = {"model": name, "mode": mode.name, "params_b": s.params / 1e9,
                   "trainable_b": (s.lora_params if mode.lora else s.params) / 1e9,
                   "gpu_fixed_gib": fixed["gpu"] / GIB, "host_fixed_gib": fixed["host"] / GIB,
                   "ckpt_kib_per_token": checkpoints / KIB, "work_kib_per_token": work / KIB}
            free_host = (host_gib - host_reserve_gib) * GIB - fixed["host"]
            for gpu, cap in gpu_gib.items():
                free_gpu = (cap - gpu_reserve_gib) * GIB - fixed["gpu"]
                ok = free_host >= 0
                row[f"{gpu}_ckpt_gpu"] = longest(free_gpu, free_host, checkpoints + work, 0) if ok else 0
                in_flight = 2 * BF16 * s.hidden
                row[f"{gpu}_ckpt_host"] = longest(free_gpu, free_host, in_flight + work, checkpoints) if ok else 0
                row[f"{gpu}_ckpt_host_pow2"] = longest(free_gpu, free_host, in_flight + work, checkpoints, s.layers,
                                                       pow2=True) if ok else 0
                row[f"{gpu}_split"] = max(row[f"{gpu}_ckpt_gpu"], row[f"{gpu}_ckpt_host"],
                                          split_longest(free_gpu, free_host, in_flight + work, checkpoints) if ok else 0)
            rows.append(row)
    return rows


def _k(tokens: int) -> str:
    return f"{tokens // 1024:,}K" if tokens else "no room"


def markdown(rows: list[dict], gpus) -> str:
    head = ["model", "mode", "params (trainable), B", "GPU fixed GiB", "host fixed GiB", "checkpoints KiB/token",
            "working set KiB/token"] + [f"{g}: checkpoints on GPU / offloaded (pow2) / split" for g in gpus]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["model"], r["mode"], f"{r['params_b']:.2f} ({r['trainable_b']:.3g})", f"{r['gpu_fixed_gib']:.1f}",
                 f"{r['host_fixed_gib']:.1f}", f"{r['ckpt_kib_per_token']:.0f}", f"{r['work_kib_per_token']:.0f}"]
        cells += [f"{_k(r[f'{g}_ckpt_gpu'])} / {_k(r[f'{g}_ckpt_host'])} ({_k(r[f'{g}_ckpt_host_pow2'])}) / "
                  f"**{_k(r[f'{g}_split'])}**" for g in gpus]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--gpu-gib", type=float, nargs="*", default=None,
                   help="usable GiB per machine, in the order of MACHINES (default: 139 for H200, 78 for H100)")
    p.add_argument("--host-gib", type=float, default=128.0, help="host memory (GiB)")
    p.add_argument("--gpu-reserve-gib", type=float, default=3.0, help="CUDA context, workspaces, fragmentation")
    p.add_argument("--host-reserve-gib", type=float, default=8.0, help="the OS, Python, the CUDA runtime's host side")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args()
    gpus = dict(MACHINES) if not args.gpu_gib else dict(zip(MACHINES, args.gpu_gib))
    rows = bound_rows(args.models, gpus, args.host_gib, args.gpu_reserve_gib, args.host_reserve_gib)
    llama = shapes_of("llama3_8b")
    assert llama.layers * BF16 * llama.hidden == 256 * KIB, "Llama-3.1-8B keeps 256 KiB of checkpoints per token"
    print(markdown(rows, list(gpus)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"assumptions": {**vars(args), "gpus": gpus, "modes": [asdict(m) for m in MODES]}, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()

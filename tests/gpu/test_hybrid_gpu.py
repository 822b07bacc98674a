"""Token-mixer hybrids in bf16 on one GPU (I1), per parameter group, over seeds: the gated delta rule
(Qwen3.5, Qwen3-Next, Qwen3.5-MoE text), Mamba2 (NemotronH, GraniteMoeHybrid), LFM2's short gated
convolution and Kimi Linear's KDA.

For every seed (model, with Transformers' own initialisation, and documents), three runs of the same pack are measured against the stock model
in fp32 on each document unpacked (eager attention, Transformers' torch convolution and delta rule,
no TF32): the stock model in bf16 on each document unpacked (same kernels), and ours under CP in bf16
(attention `auto`: FA4 where installed; token mixers fla or torch; activation checkpointing). The
errors are relative norms of the gradient of each parameter group: the linear layers' decay
parameters (A_log, dt_bias, a handful of numbers whose gradient is a long cancelling sum), the rest of
the linear layers, attention, MLP and the rest. Per group, the median over `SEEDS` of ours/stock (the
two errors of one seed) must stay within 1.5x, and the loss within 1e-2 (docs/testing.md, "The reference").
The pack holds short documents (cp = 1 sees only these apart) and 1,500- and 700-token documents that
straddle ranks at G = 2 and 4. `pytest -s` prints every group's medians.

Also the diagnosis of docs/models.md ("bf16"): at cp = 1 the attention kernel (FA4 against dense) and
the mixer kernels (fla against torch) each keep every group within the same bound.
"""

from __future__ import annotations

import copy
import importlib
import os
import statistics

import pytest
import torch
import transformers

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.model_patches.gated_delta import stock_torch_kernels
from hf_blockdiag_cp.planning import PAIR_COUNT, document_ids_from_lengths
from helpers.bf16_parity import GRAD_FACTOR, LOSS_TOL, cp_loss_and_grads
from helpers.model_zoo import build_hybrid_pair
from helpers.reference import make_docs, reference_loss_and_grads, rel_err

# A GPU by default. `BDCP_BF16_DEVICE=cpu` runs the cp = 1 kernel check on the CPU with the reference
# kernels (dense attention, torch mixers), and `BDCP_BF16_SEEDS` sets the number of seeds: the CPU
# evidence of docs/models.md ("bf16") that the decay parameters' error is noise, not a bias.
DEVICE = os.environ.get("BDCP_BF16_DEVICE", "cuda")
SEEDS = tuple(range(int(os.environ.get("BDCP_BF16_SEEDS", "5"))))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")]
# Full attention at head dim 64 (FA4 verified there); linear layers with 2 key heads of 128 and
# 4 value heads of 128 (fla verified there): head-parallel only at G = 2, state passing at any G.
GPU_SIZES = dict(
    hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, initializer_range=0.02,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
)
# Every expert chosen: top-k routing is discontinuous, and a near-tie that bf16 rounding flips
# changes one token's output by O(1) in either bf16 run, which would swamp the rounding errors
# compared here. The routing weights and the MoE code path stay.
GPU_MOE_SIZES = dict(num_experts=4, num_experts_per_tok=4, moe_intermediate_size=128, shared_expert_intermediate_size=128)
DOC_LENGTHS = (1, 40, 1500, 1, 33, 700, 12, 9)  # at G = 4 (576 rows each) the 1,500-token document spans 3 ranks
# A pack held out of the bound's tuning, where one check of NemotronH at G = 2 (one random initialisation)
# saw a single parameter at 3.0x the stock error while the median parameter stood at 0.99x
HELD_OUT_LENGTHS = (600, 1200, 200)
PADDING = 6
GROUPS = ("decay", "linear_attn", "self_attn", "mlp", "other")


# Mamba2 hybrids: 4 heads of 64 in 2 groups, state 128 (NemotronH's, where fla's scan is verified: the
# `auto` variants run it), scan chunks of 64 rows; every expert chosen
GPU_MAMBA2_SIZES = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=64, initializer_range=0.02,
                        sizes=dict(heads=4, head_dim=64, groups=2, state=128, conv=4, chunk=64))
MAMBA2_GPU_FAMILIES = ("nemotron_h", "granitemoehybrid")
# LFM2: attention 4 heads of 64; Kimi Linear: 2 KDA heads of 128, MLA with query/key head dim 64 and value 64
GPU_CONV_KDA_SIZES = {
    "lfm2": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.02),
    "kimi_linear": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=4,
                        qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=64, kv_lora_rank=64, linear_num_heads=2,
                        linear_head_dim=128, initializer_range=0.02, num_experts=4, num_experts_per_tok=4,
                        moe_intermediate_size=128),
}


def gpu_sizes(family: str) -> dict:
    if family in GPU_CONV_KDA_SIZES:
        return GPU_CONV_KDA_SIZES[family]
    if family == "qwen3_5":
        return dict(GPU_SIZES, intermediate_size=512)
    if family == "granitemoehybrid":
        return dict(GPU_MAMBA2_SIZES, num_local_experts=4, num_experts_per_tok=4, shared_intermediate_size=256)
    if family in MAMBA2_GPU_FAMILIES:
        return GPU_MAMBA2_SIZES
    sizes = dict(GPU_SIZES, **GPU_MOE_SIZES)
    if family == "qwen3_5_moe":
        sizes["linear_num_value_heads"] = 2  # one value head per key head, as in model_zoo
    return sizes


_MAMBA2_PARTS = (".in_proj.", ".conv1d.", ".norm.", ".out_proj.")  # NemotronH's `mixer` of a Mamba2 layer
_ATTENTION_PARTS = (".q_proj.", ".k_proj.", ".v_proj.", ".o_proj.")  # NemotronH's `mixer` of an attention layer


def group_of(name: str) -> str:
    """The parameter group of `name`: the token mixers' decay parameters (A_log, dt_bias; Mamba2's D)
    and the rest of the mixers (gated delta rule `linear_attn`, Mamba2 `mamba` or NemotronH's Mamba2
    `mixer`, LFM2's `conv`), attention (Kimi Linear's KDA layers too: they are its `self_attn`), MLP,
    the rest (LFM2's `feed_forward` MLP among it)."""
    if name.endswith((".A_log", ".dt_bias", ".D")):
        return "decay"
    if ".linear_attn." in name or ".mamba." in name or ".conv." in name or (".mixer." in name and any(p in name for p in _MAMBA2_PARTS)):
        return "linear_attn"
    if ".self_attn." in name or (".mixer." in name and any(p in name for p in _ATTENTION_PARTS)):
        return "self_attn"
    if ".mlp." in name or ".mixer.up_proj." in name or ".mixer.down_proj." in name:
        return "mlp"
    return "other"


def group_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Relative error of each parameter group's flattened gradient against the reference's."""
    out = {}
    for group in GROUPS:
        names = [n for n in reference if group_of(n) == group]
        if names:
            flat = torch.cat([grads[n].float().reshape(-1).cpu() for n in names])
            out[group] = rel_err(flat, torch.cat([reference[n].float().reshape(-1).cpu() for n in names]))
    return out


def parameter_errors(grads: dict, reference: dict) -> dict[str, float]:
    """Relative error of each parameter's gradient against the reference's."""
    return {n: rel_err(grads[n].float().reshape(-1).cpu(), r.float().reshape(-1).cpu()) for n, r in reference.items()}


def hybrid_pack(seed: int, lengths=DOC_LENGTHS):
    docs = make_docs(lengths, seed=seed)
    ids = torch.cat(docs + [torch.zeros(PADDING, dtype=torch.long)])[None]
    labels = ids.clone()
    labels[0, ids.shape[1] - PADDING :] = -100
    return docs, {"input_ids": ids, "labels": labels, "document_ids": document_ids_from_lengths(lengths, ids.shape[1])[None]}


def hybrid_seeds_case(rank, world_size, group, family, variants, lengths=DOC_LENGTHS):
    """For each seed: the stock bf16 model's and each variant's (attn_backend, mixer_backend, mixer
    transport, layout) group errors, loss error and per-parameter errors (key `params`); and what each
    variant's step ran."""
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # an fp32 reference (matmuls, and the stock convolution)
    torch.backends.cudnn.allow_tf32 = False
    out = {"stock": []} | {v: [] for v in variants}
    ran = {}
    for seed in SEEDS:
        ref32, model = build_hybrid_pair(family, seed=seed, stock_decays=True, **gpu_sizes(family))
        docs, batch = hybrid_pack(seed, lengths)
        docs = [d.to(DEVICE) for d in docs]
        with stock_torch_kernels(ref32):
            loss32, grads32 = reference_loss_and_grads(ref32.to(DEVICE), docs)
            loss_s, grads_s = reference_loss_and_grads(copy.deepcopy(ref32).to(torch.bfloat16), docs)
        out["stock"].append(dict(group_errors(grads_s, grads32), loss=rel_err(loss_s.float().cpu(), loss32.cpu()),
                                 params=parameter_errors(grads_s, grads32)))
        model = model.to(DEVICE, torch.bfloat16)
        for variant in variants:
            attn, mixer, transport, layout = variant
            config = bdcp.CPConfig(attn_backend=attn, kv_exchange="allgather", layout=layout, kernel_cost=PAIR_COUNT,
                                   mixer_backend=mixer, mixer_transport=transport)
            loss, grads, step = cp_loss_and_grads(model, batch, group, world_size, config, checkpointing=True, device=DEVICE)
            out[variant].append(dict(group_errors(grads, grads32), loss=rel_err(loss.float().cpu(), loss32.cpu()),
                                     params=parameter_errors(grads, grads32)))
            ran[variant] = step.choices.describe()
    return out, ran


def _require_family(family: str) -> None:
    """Skip (not fail) where the installed Transformers has no modeling module for `family`."""
    try:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError as exc:
        pytest.skip(f"transformers {transformers.__version__} has no {family} model ({exc})")


def _medians(per_seed: list[dict]) -> dict[str, float]:
    return {key: statistics.median(e[key] for e in per_seed) for key in per_seed[0] if key != "params"}


def _worst_parameter(per_seed: list[dict], stock_seeds: list[dict]) -> str:
    """The parameter whose median over seeds of ours/stock is the largest, with its group and each seed's
    ratio: what a single-seed spike in one parameter is, next to its group's median."""
    ratios = {n: [o["params"][n] / max(s["params"][n], 1e-30) for o, s in zip(per_seed, stock_seeds)]
              for n in stock_seeds[0]["params"]}
    name = max(ratios, key=lambda n: statistics.median(ratios[n]))
    return (f"worst parameter {name} ({group_of(name)}): median {statistics.median(ratios[name]):.2f}x, per seed "
            + ", ".join(f"{r:.2f}x" for r in ratios[name]) + "; largest single-seed ratio of any parameter: "
            + "{:.2f}x ({})".format(*max((max(r), n) for n, r in ratios.items())))


def _check(results, what, record_property) -> None:
    """Each group's bound applies to the median over seeds of ours/stock per seed: a seed fixes the
    model and the documents, and with them how far a group's gradient cancels (the decay group's
    error spans 1.5e-3 to 1.5e-1 across seeds for either model), so the pair's ratio divides that out
    and the median is robust to the heavy tail, where a ratio of two medians over 5 seeds swung from
    0.5x to 2.7x (docs/models.md, "bf16"). A bias shows as ours the larger in nearly every seed."""
    per_variant, ran = results[0]  # every rank holds the same means over the group
    stock_seeds = per_variant["stock"]
    stock = _medians(stock_seeds)
    failures = []
    for variant, per_seed in per_variant.items():
        if variant == "stock":
            continue
        ours = _medians(per_seed)
        groups = [g for g in GROUPS if g in ours]
        ratio = {g: statistics.median(o[g] / s[g] for o, s in zip(per_seed, stock_seeds)) for g in groups}
        worse = {g: sum(o[g] > s[g] for o, s in zip(per_seed, stock_seeds)) for g in groups}
        cells = ", ".join(f"{g} {ratio[g]:.2f}x (medians {ours[g]:.2e}/{stock[g]:.2e}, larger in {worse[g]}/{len(SEEDS)})"
                          for g in groups)
        line = f"{what} {variant}: median over {len(SEEDS)} seeds of ours/stock: {cells}; loss {ours['loss']:.1e} | {ran[variant]}"
        line += "\n  " + _worst_parameter(per_seed, stock_seeds)
        if "decay" in ours:  # the spread that tells noise from a bias, seed by seed
            line += "\n  decay per seed ours/stock: " + ", ".join(
                f"{o['decay']:.1e}/{s['decay']:.1e}" for o, s in zip(per_seed, stock_seeds))
        print(line)
        record_property(f"{what} {variant}", line)
        failures += [f"{variant} {g}: {ratio[g]:.2f}x > {GRAD_FACTOR}x" for g in groups if ratio[g] > GRAD_FACTOR]
        if ours["loss"] > LOSS_TOL:
            failures.append(f"{variant} loss: {ours['loss']:.2e}")
    assert failures == []


def _variants(world_size: int, family: str) -> list[tuple[str, str, str, str]]:
    """At G = 2 the families with a head-parallel mixer run it by name (qwen3_5 also state passing):
    `auto` prices gloo's bytes at gloo's rate and would pass states; G = 4 passes states (2 key heads)."""
    layout = "balanced" if world_size == 4 else "contiguous"
    transports = ["auto"]
    if world_size == 2 and family in ("qwen3_5", "qwen3_next", "qwen3_5_moe", "kimi_linear"):
        transports = ["states", "heads"] if family == "qwen3_5" else ["heads"]
    return [("auto", mixer, transport, layout) for transport in transports for mixer in ("auto", "torch")]


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "qwen3_5_moe", *MAMBA2_GPU_FAMILIES, *GPU_CONV_KDA_SIZES])
def test_hybrid_bf16_parity_per_parameter_group(gloo, record_property, family, world_size):
    _require_family(family)
    results = gloo(world_size).run(hybrid_seeds_case, timeout=900, family=family, variants=_variants(world_size, family))
    _check(results, f"{family} G={world_size}", record_property)


def test_nemotron_h_held_out_pack_per_group(gloo, record_property):
    """NemotronH (state 128, head dim 64: fla's scan) at G = 2 on the held-out pack [600, 1200, 200], over
    `SEEDS`: every group within the bound, and the worst parameter named with its ratio per seed."""
    _require_family("nemotron_h")
    results = gloo(2).run(hybrid_seeds_case, timeout=900, family="nemotron_h", variants=_variants(2, "nemotron_h"),
                          lengths=HELD_OUT_LENGTHS)
    _check(results, "nemotron_h G=2 held-out pack", record_property)


def test_attention_and_mixer_kernels_keep_every_group_at_the_stock_error(gloo, record_property):
    """cp = 1, each fast kernel alone against the reference kernels (dense attention, torch mixers);
    on the CPU the reference kernels only."""
    variants = [("dense", "torch", "auto", "contiguous"), ("auto", "torch", "auto", "contiguous"),
                ("dense", "auto", "auto", "contiguous")]
    if DEVICE == "cpu":
        variants = variants[:1]
    results = gloo(1).run(hybrid_seeds_case, timeout=900, family="qwen3_5", variants=variants)
    _check(results, "qwen3_5 G=1 kernels", record_property)

"""Tiny configs of the model families covered by the model tests (`test_model_parity.py`,
`test_model_features.py`), built from configs only (no downloads), and a per-document reference
that also takes per-document extra inputs (3-D mRoPE positions for Qwen2-VL).

Each config switches on the feature the family is there to test, at a size where the feature
changes the result: windows smaller than a shard, a softcap small enough that tanh bends the
scores, random sinks, Dv != Dk, non-default Granite multipliers, LongRoPE whose original
context is shorter than the documents.
"""

from __future__ import annotations

import copy

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    DeepseekV3Config,
    Gemma2Config,
    GptOssConfig,
    GraniteConfig,
    MistralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen2Config,
    Qwen2VLConfig,
    Qwen3Config,
)

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp import model_patches
from helpers.reference import COMMON_CONFIG, VOCAB, reference_loss_and_grads  # noqa: F401 (re-exported)

WINDOW = 3  # smaller than every shard in the packs used here
LONGROPE_ORIGINAL_CONTEXT = 8

_BASE = dict(
    COMMON_CONFIG,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # large enough that attention features (softcap, sinks, RoPE factors) move the result
)
_BOTH_LAYER_KINDS = ["sliding_attention", "full_attention"]


def tiny_config(family: str):
    b = dict(_BASE)
    if family == "mistral":
        return MistralConfig(**b, sliding_window=WINDOW)
    if family == "qwen2":  # layer 0 full, layer 1 sliding
        return Qwen2Config(**b, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "qwen3":
        return Qwen3Config(**b, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    if family == "gemma2":
        return Gemma2Config(
            **b, sliding_window=WINDOW, layer_types=_BOTH_LAYER_KINDS, attn_logit_softcapping=0.5,
            final_logit_softcapping=5.0, query_pre_attn_scalar=6,
        )
    if family == "gpt_oss":
        b["intermediate_size"] = 32
        return GptOssConfig(
            **b, sliding_window=WINDOW, layer_types=_BOTH_LAYER_KINDS, num_local_experts=4, num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    if family == "deepseek_v3":  # MLA: Dk = 8 + 4 = 12, Dv = 6; K/V pre-expanded to every head
        for key in ("head_dim", "num_key_value_heads"):
            b.pop(key)
        return DeepseekV3Config(
            **b, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
            qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
        )
    if family == "granite":
        return GraniteConfig(
            **b, attention_multiplier=0.3, embedding_multiplier=2.5, residual_multiplier=0.6, logits_scaling=3.0
        )
    if family == "olmo2":
        return Olmo2Config(**b)
    if family == "phi3":
        b.pop("head_dim")  # Phi-3 derives it: 32 / 4 = 8, so 4 rotary factors
        return Phi3Config(
            **b, original_max_position_embeddings=LONGROPE_ORIGINAL_CONTEXT,
            rope_parameters={
                "rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 4.0],
                "long_factor": [3.0, 7.0, 13.0, 31.0], "original_max_position_embeddings": LONGROPE_ORIGINAL_CONTEXT,
            },
        )
    if family in ("qwen2_vl", "qwen2_vl_image"):
        text = {k: v for k, v in b.items() if k not in ("tie_word_embeddings",)}
        return Qwen2VLConfig(
            text_config=dict(text, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]}),
            initializer_range=0.1,
            vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=2,
                               temporal_patch_size=1, spatial_merge_size=1, in_channels=3),
            tie_word_embeddings=False, image_token_id=VOCAB - 1, video_token_id=VOCAB - 2,
        )
    if family in MOE_FAMILIES:
        return moe_config(family)
    raise ValueError(family)


# Mixture-of-experts families with the router auxiliary loss on (model_patches/router_aux_loss.py); the
# coefficient large enough that the auxiliary loss moves the loss and the router's gradient well past 1e-4.
MOE_FAMILIES = ("qwen3_moe", "olmoe", "mixtral")
ROUTER_AUX_COEF = 0.5


def moe_config(family: str):
    """A tiny MoE config: 4 experts, 2 per token, `output_router_logits=True`, `router_aux_loss_coef` 0.5."""
    import transformers

    b = dict(_BASE, output_router_logits=True, router_aux_loss_coef=ROUTER_AUX_COEF, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**b, num_experts=4, moe_intermediate_size=16)
    if family == "olmoe":
        return transformers.OlmoeConfig(**b, num_experts=4)
    return transformers.MixtralConfig(**b, num_local_experts=4)


def build_pair(family: str, seed: int = 0):
    """(reference eager model, patched blockdiag_cp model) with identical weights."""
    torch.manual_seed(seed)
    config = tiny_config(family)
    if family.startswith("qwen2_vl"):
        ref = AutoModelForImageTextToText.from_config(config, attn_implementation="eager", dtype=torch.float32)
    else:
        ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("sinks"):  # GPT-OSS initialises sinks to one value; make every head differ
                p.copy_(torch.randn_like(p))
    ref.train()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(bdcp.ATTN_IMPLEMENTATION)
    model_patches.apply_model_patches(model)
    return ref, model


def mrope_positions(length: int, offset: int = 0) -> torch.Tensor:
    """Distinct 3-D positions [3, 1, n] for a text document: t, h, w advance at different rates,
    so a shard that took the wrong rows of any axis would change the result."""
    t = torch.arange(length)
    return torch.stack([t, t // 2, (t * 3) // 2])[:, None, :] + offset


IMAGE_TOKEN = VOCAB - 1
IMAGE_GRID = (1, 2, 2)  # one frame of 2x2 patches (patch 2, no merge): 4 image tokens, pixel rows of 3*1*2*2


def vl_image_docs(seed: int = 5):
    """Documents text-image-text: (input ids, mm_token_type_ids, pixel_values) per document."""
    g = torch.Generator().manual_seed(seed)
    docs = []
    for before, after in ((2, 3), (1, 6), (4, 2), (3, 3)):
        ids = torch.cat([torch.randint(3, 90, (before,), generator=g), torch.full((4,), IMAGE_TOKEN),
                         torch.randint(3, 90, (after,), generator=g)])
        docs.append((ids, (ids == IMAGE_TOKEN).int(), torch.randn(4, 12, generator=g)))
    return docs


# --------------------------------------------------------------------------- gated delta-rule hybrids

HYBRID_FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe", "olmo_hybrid")
CONV_FAMILIES = ("lfm2", "lfm2_moe")  # short gated convolution (model_patches/lfm2.py)
# KDA: the delta rule with a decay per key channel. Bailing-Hybrid came to Transformers after 5.17 (the
# floor): its cases run where the installed release has it.
KDA_FAMILIES = ("kimi_linear",) + (("bailing_hybrid",) if hasattr(transformers, "BailingHybridConfig") else ())
HYBRID_LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
HYBRID_KEY_HEADS = 2  # head-parallel CP only at G = 2; state passing at every G


def tiny_hybrid_config(family: str, **overrides):
    """4 layers (2 gated delta-rule + 2 full attention), 2 key heads: Dk 4 != Dv 6, and 2 value
    heads per key head (qwen3_5, qwen3_next) or 1 (qwen3_5_moe)."""
    from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

    if family in MAMBA2_FAMILIES:
        return tiny_mamba2_config(family, **overrides)
    if family in MAMBA1_FAMILIES:
        return tiny_mamba1_config(family, **overrides)
    if family in LIGHTNING_FAMILIES:
        return tiny_lightning_config(family, **overrides)
    b = dict(
        _BASE, num_hidden_layers=4, layer_types=HYBRID_LAYERS, linear_conv_kernel_dim=4, linear_key_head_dim=4,
        linear_value_head_dim=6, linear_num_key_heads=HYBRID_KEY_HEADS, linear_num_value_heads=2 * HYBRID_KEY_HEADS,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if family in CONV_FAMILIES + KDA_FAMILIES:
        return _tiny_mixer_config(family, **overrides)
    elif family == "olmo_hybrid":  # beta doubled (linear_allow_neg_eigval), as OLMo-Hybrid's default
        from transformers import OlmoHybridConfig

        config = OlmoHybridConfig(**b, linear_allow_neg_eigval=True)
    elif family == "qwen3_5":
        config = Qwen3_5TextConfig(**b)
    elif family == "qwen3_next":
        config = Qwen3NextConfig(**b, **moe)
    elif family == "qwen3_5_moe":
        b.pop("intermediate_size")
        config = Qwen3_5MoeTextConfig(**dict(b, linear_num_value_heads=HYBRID_KEY_HEADS), **moe)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _tiny_mixer_config(family: str, **overrides):
    """LFM2 (-MoE): 4 layers, conv / attention alternating, kernel 4 (3 rows of halo) with a bias.
    Kimi Linear, Bailing-Hybrid: 4 layers, KDA / MLA attention alternating, 2 KDA heads of dim 8,
    a sparse MoE after the first layer; Bailing-Hybrid with its default bounded ("safe") gate.
    `overrides` go to the config's constructor (its derived sizes follow them)."""
    import transformers  # each config looked up when used: older Transformers lack Bailing-Hybrid

    b = dict(_BASE, num_hidden_layers=4)
    if family in CONV_FAMILIES:
        b.pop("head_dim")
        conv = dict(layer_types=["conv", "full_attention", "conv", "full_attention"], conv_L_cache=4, conv_bias=True)
        if family == "lfm2":
            return transformers.Lfm2Config(**{**b, **conv, "block_auto_adjust_ff_dim": False, **overrides})
        moe = dict(moe_intermediate_size=16, num_dense_layers=1, num_experts=4, num_experts_per_tok=2)
        return transformers.Lfm2MoeConfig(**{**b, **conv, **moe, **overrides})
    for key in ("head_dim", "num_key_value_heads"):
        b.pop(key)
    mla = dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
               v_head_dim=6, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
               layer_types=HYBRID_LAYERS, mlp_layer_types=["dense", "sparse", "sparse", "sparse"], linear_num_heads=2,
               linear_head_dim=8, linear_conv_kernel_dim=4)
    if family == "kimi_linear":
        return transformers.KimiLinearConfig(**{**b, **mla, **overrides})
    return transformers.BailingHybridConfig(**{**b, **mla, "head_dim": 12, "num_nextn_predict_layers": 0, **overrides})


def slow_decays(model) -> None:
    """Decay rates A = exp(A_log) in [0.05, 1] instead of Transformers' [0.01, 16]: a state then lasts for
    many tokens, so a state lost or leaked at a document or rank boundary shows in every later row, and
    the fp32 log-decay sums of a 64-token chunk stay small enough that the A_log / dt_bias gradients
    are not cancellation noise (at A = 16 they differ by 1e-4 between two exact fp32 computations)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 1.0).log())


def build_hybrid_pair(family: str, seed: int = 0, stock_decays: bool = False, **overrides):
    """(stock eager model, blockdiag_cp model with the gated delta-rule patch) with identical weights;
    `slow_decays` unless `stock_decays` (Transformers' initialisation)."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(tiny_hybrid_config(family, **overrides), attn_implementation="eager", dtype=torch.float32)
    if not stock_decays:
        slow_decays(ref)
    ref.train()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(bdcp.ATTN_IMPLEMENTATION)
    model_patches.apply_model_patches(model)
    return ref, model


def tiny_hybrid_vl_model():
    """A tiny Qwen3.5 vision-language model (text stack as `tiny_hybrid_config("qwen3_5")`) under blockdiag_cp."""
    from transformers import Qwen3_5Config

    text = tiny_hybrid_config("qwen3_5").to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0], "partial_rotary_factor": 0.25}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, temporal_patch_size=1,
                  spatial_merge_size=1, in_channels=3, out_hidden_size=32)
    config = Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN)
    return AutoModelForImageTextToText.from_config(config, attn_implementation=bdcp.ATTN_IMPLEMENTATION)


# --------------------------------------------------------------------------- Mamba2 (SSD) hybrids

MAMBA2_FAMILIES = ("nemotron_h", "granitemoehybrid", "bamba", "falcon_h1", "zamba2", "mamba2")
MAMBA2_SIZES = dict(heads=4, head_dim=8, groups=2, state=8, conv=4, chunk=16)  # 2 heads per group of B, C


def tiny_mamba2_config(family: str, sizes: dict | None = None, **overrides):
    """Mamba2 layers of `sizes` (`MAMBA2_SIZES`: 4 heads of dim 8 in 2 groups, state 8, kernel 4,
    scan chunks of 16 rows, so a document of 20 rows crosses two), with attention layers between
    them where the family has them (Zamba2: its shared block; FalconH1: attention beside the mixer
    in every layer, and its μP multipliers away from 1); `overrides` go to the config's constructor."""
    import transformers

    m = sizes or MAMBA2_SIZES
    b = dict(_BASE, num_hidden_layers=4)
    mamba = dict(mamba_n_heads=m["heads"], mamba_d_head=m["head_dim"], mamba_n_groups=m["groups"], mamba_d_state=m["state"],
                 mamba_d_conv=m["conv"], mamba_chunk_size=m["chunk"], mamba_expand=1)
    if family == "nemotron_h":
        b.pop("num_hidden_layers")
        name, kwargs = "NemotronHConfig", dict(
            b, layers_block_type=["mamba", "attention", "mamba", "mlp"], mamba_num_heads=m["heads"],
            mamba_head_dim=m["head_dim"], n_groups=m["groups"], ssm_state_size=m["state"], conv_kernel=m["conv"],
            chunk_size=m["chunk"], expand=1,
        )
    elif family == "granitemoehybrid":
        b.pop("head_dim")
        name, kwargs = "GraniteMoeHybridConfig", dict(
            b, **mamba, layer_types=["mamba", "attention", "mamba", "attention"], num_local_experts=4,
            num_experts_per_tok=2, shared_intermediate_size=16, embedding_multiplier=2.0, residual_multiplier=0.7,
            attention_multiplier=0.3, logits_scaling=2.0,
        )
    elif family == "bamba":
        b.pop("head_dim")
        name, kwargs = "BambaConfig", dict(b, **mamba, attn_layer_indices=[1, 3])
    elif family == "falcon_h1":
        name, kwargs = "FalconH1Config", dict(
            b, num_hidden_layers=2, **mamba, mamba_d_ssm=m["heads"] * m["head_dim"],
            ssm_multipliers=[1.5, 0.5, 1.2, 0.8, 1.1], ssm_in_multiplier=1.3, ssm_out_multiplier=0.9,
        )
    elif family == "zamba2":
        b.pop("head_dim")
        name, kwargs = "Zamba2Config", dict(
            b, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"], n_mamba_heads=m["heads"],
            mamba_ngroups=m["groups"], mamba_d_state=m["state"], mamba_d_conv=m["conv"], chunk_size=m["chunk"],
            mamba_expand=1, num_mem_blocks=1, adapter_rank=4,
        )
    elif family == "mamba2":
        name, kwargs = "Mamba2Config", dict(
            vocab_size=VOCAB, hidden_size=b["hidden_size"], num_hidden_layers=2, num_heads=m["heads"],
            head_dim=m["head_dim"], n_groups=m["groups"], state_size=m["state"], conv_kernel=m["conv"],
            chunk_size=m["chunk"], expand=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, initializer_range=b["initializer_range"],
        )
    else:
        raise ValueError(family)
    return getattr(transformers, name)(**dict(kwargs, **overrides))


# --------------------------------------------------------------------------- Mamba1 (selective scan) models

MAMBA1_FAMILIES = ("jamba", "falcon_mamba", "mamba")


def tiny_mamba1_config(family: str, **overrides):
    """Mamba1 layers of 64 channels (expand 2), state 8, kernel 4, time-step rank 4; Jamba with
    attention and a sparse MoE in every other layer; `overrides` go to the config's constructor."""
    import transformers

    mamba = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2, conv_kernel=4,
                 time_step_rank=4, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 initializer_range=_BASE["initializer_range"])
    if family == "mamba":
        name, kwargs = "MambaConfig", mamba
    elif family == "falcon_mamba":
        name, kwargs = "FalconMambaConfig", mamba
    elif family == "jamba":
        b = dict(_BASE, num_hidden_layers=4)
        b.pop("head_dim")
        name, kwargs = "JambaConfig", dict(
            b, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
            num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        )
    else:
        raise ValueError(family)
    return getattr(transformers, name)(**dict(kwargs, **overrides))



def check_stock_outside_a_step(family: str, generate: bool = True) -> None:
    """Outside a CP step, without packing information, the patched hybrid is the stock model: its
    forward and (`generate`) its cached greedy generation give the same logits and tokens."""
    ref, model = build_hybrid_pair(family)
    model.set_attn_implementation("eager")
    ids = torch.randint(3, 90, (2, 9), generator=torch.Generator().manual_seed(0))
    ref.eval(), model.eval()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)
        if generate:
            expected = ref.generate(ids, max_new_tokens=4, do_sample=False)
            assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)


def two_document_row() -> dict:
    """One packed row of two documents (5 and 7 tokens) for a cp = 1 step."""
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}


def step_mixers(family: str) -> str:
    """What the patched hybrid's token mixers ran (`StepChoices.mixers`) in one cp = 1 step of
    `two_document_row` with the torch kernels."""
    _, model = build_hybrid_pair(family)
    config = bdcp.CPConfig(mixer_backend="torch")
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, two_document_row(), config=config)
    with train_ctx() as step:
        model(**local).loss.backward()
    return step.choices.mixers


# --------------------------------------------------------------------------- lightning attention (MiniMax)

LIGHTNING_FAMILIES = ("minimax",)
LIGHTNING_BLOCK = 16  # rows per block of the lightning attention: the long pack's documents cross many


def tiny_lightning_config(family: str, **overrides):
    """MiniMax: 4 layers, lightning / full attention alternating, 4 heads of dim 8, blocks of 16 rows;
    its decays (fixed buffers, per head and layer) from 0.78 to 0.999 per row, so a state lasts for
    many tokens. Every layer's MLP is a sparse MoE of 2 experts, both chosen for every token, so no
    routing can flip between two exact computations."""
    import transformers

    if family != "minimax":
        raise ValueError(family)
    b = dict(_BASE, num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
             block_size=LIGHTNING_BLOCK, num_local_experts=2, num_experts_per_tok=2)
    return transformers.MiniMaxConfig(**dict(b, **overrides))

"""FlashAttention-4 and fused linear cross-entropy on the GPU (skipped without CUDA, flash-attn-4
or liger-kernel).

- `fa4` bf16 parity (the criterion in docs/testing.md) at cp = 1 and G = 2, 4 (gloo with CUDA
  tensors on one GPU) for every feature the kernel takes: plain causal with GQA, a sliding
  window, softcap + window (Gemma2), sinks + window (GPT-OSS), Dk 192 / Dv 128 (DeepSeek MLA);
- `fa4` is refused at head dims it was not verified on, and `auto` skips it there;
- Liger's fused linear cross-entropy under CP: the same loss and gradients as the stock loss
  on the same step, and as the fp32 unpacked reference, with no logits returned.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, Gemma2Config, GptOssConfig, LlamaConfig, MistralConfig

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.kernels import choose_kernel, unsupported_reason
from helpers.packs import make_pack
from helpers.reference import VOCAB, mean_over_group, reference_loss_and_grads, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BASE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, attention_dropout=0.0,
            tie_word_embeddings=False, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2)
BOTH = ["sliding_attention", "full_attention"]


def fa4_config(family: str):
    if family == "llama":
        return LlamaConfig(**BASE)
    if family == "mistral":
        return MistralConfig(**BASE, sliding_window=3)
    if family == "gemma2":
        return Gemma2Config(**BASE, sliding_window=3, layer_types=BOTH, attn_logit_softcapping=0.5,
                            final_logit_softcapping=5.0, query_pre_attn_scalar=64)
    if family == "gpt_oss":
        return GptOssConfig(**{**BASE, "intermediate_size": 64}, sliding_window=3, layer_types=BOTH, num_local_experts=4,
                            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if family == "deepseek_v3":  # MLA: Dk = 128 + 64 = 192, Dv = 128
        b = {k: v for k, v in BASE.items() if k not in ("head_dim", "num_key_value_heads")}
        return DeepseekV3Config(**b, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                                num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
                                first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=32, qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128)
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "gemma2", "gpt_oss", "deepseek_v3")


def _need(name: str):
    reason = unsupported_reason(name, torch.device("cuda"), torch.bfloat16, 64, 64)
    if reason is not None:
        pytest.skip(reason)


def _models(family: str):
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(fa4_config(family), attn_implementation="eager", dtype=torch.float32).cuda()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(bdcp.ATTN_IMPLEMENTATION)
    bdcp.apply_model_patches(model)
    return ref.train(), model.train()


def _cp_step(model, batch, group, world_size, config):
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    model.zero_grad(set_to_none=True)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    with train_ctx():
        out = model(**local)
        out.loss.backward()
    grads = {n: mean_over_group(p.grad if p.grad is not None else torch.zeros_like(p), group, world_size)
             for n, p in model.named_parameters()}
    return out, mean_over_group(out.loss, group, world_size), grads


def _flat(grads, names):
    return torch.cat([grads[n].float().reshape(-1).cpu() for n in names])


def fa4_parity_case(rank, world_size, group, layout):
    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    out = {}
    for family in FAMILIES:
        ref32, model = _models(family)
        enable_activation_checkpointing(model, use_reentrant=False)
        docs, batch = make_pack(layout, world_size)
        docs = [d.cuda() for d in docs]
        loss32, grads32 = reference_loss_and_grads(ref32, docs)
        loss16, grads16 = reference_loss_and_grads(copy.deepcopy(ref32).to(torch.bfloat16), docs)
        _, loss_cp, grads_cp = _cp_step(model.to(torch.bfloat16), batch, group, world_size, bdcp.CPConfig("fa4"))
        names = list(grads32)
        out[family] = {
            "stock_grad_err": rel_err(_flat(grads16, names), _flat(grads32, names)),
            "cp_grad_err": rel_err(_flat(grads_cp, names), _flat(grads32, names)),
            "cp_loss_err": rel_err(loss_cp.cpu(), loss32.cpu()),
        }
    return out


@pytest.mark.parametrize("world_size,layout", [(1, "straddle"), (1, "single_tokens"), (2, "straddle"), (2, "padding_rank"),
                                               (4, "span_all"), (4, "padding_rank")])
def test_fa4_bf16_parity(gloo, world_size, layout):
    _need("fa4")
    for rank, per_family in enumerate(gloo(world_size).run(fa4_parity_case, timeout=900, layout=layout)):
        for family, e in per_family.items():
            assert e["cp_grad_err"] <= 1.5 * e["stock_grad_err"], f"rank {rank} {family}: {e}"
            assert e["cp_loss_err"] <= 1e-2, f"rank {rank} {family}: {e}"


def test_fa4_refuses_unverified_head_dims_and_auto_skips_it():
    _need("fa4")
    cuda = torch.device("cuda")
    for dims in ((16, 16), (32, 32), (96, 96), (128, 64)):
        with pytest.raises(ValueError, match=r"attn_backend='fa4'.*verified on a GPU only"):
            choose_kernel("fa4", cuda, torch.bfloat16, *dims)
        assert choose_kernel("auto", cuda, torch.bfloat16, *dims).name != "fa4"
    assert choose_kernel("auto", cuda, torch.bfloat16, 128, 128).name == "fa4"
    assert choose_kernel("auto", cuda, torch.bfloat16, 192, 128).name == "fa4"
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        choose_kernel("fa4", cuda, torch.float32, 64, 64)


def fused_ce_case(rank, world_size, group, layout):
    from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref32, stock = _models("llama")
    fused = copy.deepcopy(stock)
    assert enable_fused_cross_entropy(fused)
    docs, batch = make_pack(layout, world_size)
    loss32, grads32 = reference_loss_and_grads(ref32, [d.cuda() for d in docs])
    config = bdcp.CPConfig("dense")  # fp32 and exact: the loss is what differs
    _, loss_s, grads_s = _cp_step(stock, batch, group, world_size, config)
    out_f, loss_f, grads_f = _cp_step(fused, batch, group, world_size, config)
    names = list(grads32)
    return {
        "logits_returned": out_f.logits is not None,
        "fused_vs_stock_loss": rel_err(loss_f.cpu(), loss_s.cpu()),
        "fused_vs_stock_grad": max(rel_err(grads_f[n].cpu(), grads_s[n].cpu()) for n in names),
        "fused_vs_reference_loss": rel_err(loss_f.cpu(), loss32.cpu()),
        "fused_vs_reference_grad": max(rel_err(grads_f[n].cpu(), grads32[n].cpu()) for n in names),
    }


@pytest.mark.parametrize("world_size,layout", [(1, "straddle"), (2, "straddle"), (2, "padding_rank")])
def test_fused_cross_entropy_matches_the_stock_loss(gloo, world_size, layout):
    from hf_blockdiag_cp.integrations.liger import fused_cross_entropy_unavailable

    reason = fused_cross_entropy_unavailable()
    if reason is not None:
        pytest.skip(reason)
    for rank, e in enumerate(gloo(world_size).run(fused_ce_case, timeout=600, layout=layout)):
        assert not e["logits_returned"], f"rank {rank}: the fused loss returned logits"
        for key in ("fused_vs_stock_loss", "fused_vs_stock_grad", "fused_vs_reference_loss", "fused_vs_reference_grad"):
            assert e[key] <= 1e-4, f"rank {rank} {key}: {e}"

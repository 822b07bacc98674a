"""`BlockdiagCPSFTTrainer` on the GPU with FlashAttention-4 and Liger's fused cross-entropy
(skipped without CUDA, trl, flash-attn-4 or liger-kernel).

Twenty optimizer steps of packed SFT (TRL's bfd packs of 256 tokens, pre-tokenized documents,
bf16 weights, `attn_backend="fa4"`, Liger's fused cross-entropy by `enable_fused_cross_entropy`) at cp = 1 and at G = 2 (gloo with
CUDA tensors on one GPU, every rank on GPU 0). The reference is TRL's stock `SFTTrainer` with the
stock fp32 `sdpa` model on the same packs; the yardstick is the same stock trainer in bf16. Each
step's loss of ours, at either cp, must be within 1.5x the stock bf16 run's worst deviation from
fp32 (the criterion of docs/testing.md, "The reference").
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

import hf_blockdiag_cp as bdcp  # noqa: E402
from hf_blockdiag_cp.kernels import unsupported_reason  # noqa: E402
from helpers.sft import char_tokenizer, sft_config, sft_dataset  # noqa: E402
from helpers.trainer import accelerate_env, quiet, tiny_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

STEPS = 20
GPU_DIMS = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # fa4-verified head dim


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def sft_run_case(rank, world_size, group, ours: bool, dtype: str):
    """Per-step training losses of one run: ours (fa4 + Liger) or TRL's stock SFTTrainer (sdpa)."""
    from transformers.models.llama import modeling_llama
    from trl import SFTTrainer

    from hf_blockdiag_cp.integrations.liger import enable_fused_cross_entropy
    from hf_blockdiag_cp.integrations.trl import BlockdiagCPSFTTrainer

    torch.cuda.set_device(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    stock_llama = dict(vars(modeling_llama))  # Liger patches modeling_llama globally
    try:
        with accelerate_env(rank, world_size, local_rank=0) as out:
            model = tiny_model("blockdiag_cp" if ours else "sdpa", **GPU_DIMS).to("cuda", getattr(torch, dtype))
            args = sft_config(out, use_cpu=False, max_steps=STEPS, gradient_accumulation_steps=1, learning_rate=0.05,
                              ddp_backend="gloo" if world_size > 1 else None)
            data = sft_dataset("tokens")
            if ours:
                assert enable_fused_cross_entropy(model), "Liger's fused cross-entropy was not installed"
                trainer = BlockdiagCPSFTTrainer(model=model, args=args, train_dataset=data, processing_class=char_tokenizer(),
                                                cp_size=world_size, cp_config=bdcp.CPConfig(attn_backend="fa4"),
                                                cp_mesh=group if world_size > 1 else None)
            else:
                trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=char_tokenizer())
            quiet(trainer).train()
            return _losses(trainer)
    finally:
        vars(modeling_llama).update(stock_llama)


def test_trl_sft_with_fa4_and_liger_matches_cp1_and_the_stock_model(gloo):
    from hf_blockdiag_cp.integrations.liger import fused_cross_entropy_unavailable

    for reason in (fused_cross_entropy_unavailable(), unsupported_reason("fa4", torch.device("cuda"), torch.bfloat16, 64, 64)):
        if reason is not None:
            pytest.skip(reason)
    (ref32,) = gloo(1).run(sft_run_case, timeout=600, ours=False, dtype="float32")
    (stock16,) = gloo(1).run(sft_run_case, timeout=600, ours=False, dtype="bfloat16")
    (ours1,) = gloo(1).run(sft_run_case, timeout=600, ours=True, dtype="bfloat16")
    ours2 = gloo(2).run(sft_run_case, timeout=600, ours=True, dtype="bfloat16")
    assert len(ref32) == len(stock16) == len(ours1) == STEPS and ref32[-1] < ref32[0]
    scale = max(abs(s - r) for s, r in zip(stock16, ref32))
    print(f"\nfp32 stock {ref32[0]:.4f} -> {ref32[-1]:.4f}; worst step deviation from it: stock bf16 {scale:.2e}, "
          f"ours cp=1 {max(abs(a - r) for a, r in zip(ours1, ref32)):.2e}, "
          f"ours cp=2 {max(abs(a - r) for a, r in zip(ours2[0], ref32)):.2e}, "
          f"cp=2 vs cp=1 {max(abs(a - b) for a, b in zip(ours2[0], ours1)):.2e}")
    for name, losses in [("cp=1", ours1)] + [(f"cp=2 rank {r}", run) for r, run in enumerate(ours2)]:
        worst = max(abs(a - r) for a, r in zip(losses, ref32))
        assert worst <= 1.5 * scale, f"ours {name}: worst step loss deviation {worst:.2e} > 1.5x stock bf16's {scale:.2e}"

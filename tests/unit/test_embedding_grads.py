"""The input embedding's weight gradient summed in float32 and rounded once (`kernels.embedding`).

Against a float64 `index_add_` of the same bf16 gradient rows: every element is the exact sum rounded
once to bf16 (within half a bf16 ulp, plus float32's summation error), with tokens repeated hundreds of
times, where a sum kept in bf16 is off by many ulps. The forward and every path that keeps the stock
call (float32, frozen, `max_norm`) are the stock embedding's to the bit; the class change keeps a
subclass's own forward (Gemma 3's scaled embedding) and reaches the models a CP step prepares.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_blockdiag_cp.kernels.embedding import Fp32GradEmbedding, fp32_embedding_grads, fp32_grad_embedding

pytestmark = pytest.mark.unit
VOCAB, HIDDEN, TOKENS = 16, 32, 6000


def _case(seed: int, padding_idx: int | None = None):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=g)
    weight = torch.randn(VOCAB, HIDDEN, generator=g).bfloat16().requires_grad_()
    grad = (torch.randn(2, TOKENS // 2, HIDDEN, generator=g) * 1e-2).bfloat16()
    exact = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, HIDDEN).double())
    if padding_idx is not None:
        exact[padding_idx] = 0
    magnitude = torch.zeros(VOCAB, HIDDEN, dtype=torch.float64).index_add_(0, ids.reshape(-1), grad.reshape(-1, HIDDEN).double().abs())
    return ids, weight, grad, exact, magnitude


@pytest.mark.parametrize("padding_idx", [None, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_is_the_exact_sum_rounded_once(seed, padding_idx):
    ids, weight, grad, exact, magnitude = _case(seed, padding_idx)
    out = fp32_grad_embedding(ids, weight, padding_idx)
    assert torch.equal(out, F.embedding(ids, weight.detach(), padding_idx))
    out.backward(grad)
    assert weight.grad.dtype == torch.bfloat16
    error = (weight.grad.double() - exact).abs()
    bound = 2.0**-8 * exact.abs() + 2.0**-22 * magnitude  # one bf16 rounding + float32 summation
    assert (error <= bound).all(), f"max excess {(error - bound).max().item():.3e}"
    if padding_idx is not None:
        assert not weight.grad[padding_idx].any()


def test_stock_path_where_nothing_is_gained():
    ids, weight, grad, _, _ = _case(2)
    weight32 = weight.detach().float().requires_grad_()
    fp32_grad_embedding(ids, weight32).backward(grad.float())
    stock = weight.detach().float().requires_grad_()
    F.embedding(ids, stock).backward(grad.float())
    assert torch.equal(weight32.grad, stock.grad)
    frozen = weight.detach()
    assert not fp32_grad_embedding(ids, frozen).requires_grad
    module = torch.nn.Embedding(VOCAB, HIDDEN, max_norm=1.0).bfloat16()
    reference = torch.nn.Embedding(VOCAB, HIDDEN, max_norm=1.0).bfloat16()
    reference.load_state_dict(module.state_dict())
    fp32_embedding_grads(module)
    assert torch.equal(module(ids), reference(ids))  # max_norm renormalises the rows in place: the stock call


def test_class_change_keeps_the_subclass_forward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    ids, _, grad, exact, magnitude = _case(3)
    module = Gemma3TextScaledWordEmbedding(VOCAB, HIDDEN, padding_idx=0, embed_scale=4.0).bfloat16()
    stock_out = module(ids)
    assert fp32_embedding_grads(module) and fp32_embedding_grads(module)  # idempotent
    assert isinstance(module, Gemma3TextScaledWordEmbedding) and isinstance(module, Fp32GradEmbedding)
    assert type(module).__name__ == "Gemma3TextScaledWordEmbedding"
    out = module(ids)
    assert torch.equal(out, stock_out)
    out.backward(grad)
    exact = 4.0 * exact
    exact[0] = 0
    error = (module.weight.grad.double() - exact).abs()
    assert (error <= 2.0**-8 * exact.abs() + 2.0**-20 * magnitude).all()
    assert not fp32_embedding_grads(torch.nn.Linear(2, 2))


def test_a_prepared_model_sums_its_embedding_gradient_in_fp32():
    from transformers import AutoModelForCausalLM

    from helpers.reference import tiny_config
    from hf_blockdiag_cp.step.model_support import prepare_model

    model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.bfloat16)
    prepare_model(model)
    assert isinstance(model.get_input_embeddings(), Fp32GradEmbedding)
    assert not isinstance(model.get_output_embeddings(), Fp32GradEmbedding)

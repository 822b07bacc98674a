"""The optional flash-attn and Transformer Engine kernels on a CUDA machine with the package
installed: the real kernel against the dense one in bf16 (skipped without CUDA or the package).
The CPU stand-in tests are in unit/test_kernels_optional.py."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.kernels import get_kernel, unsupported_reason
from hf_blockdiag_cp.kernels.attention.dense import dense_attention
from hf_blockdiag_cp.planning import plan_layout
from hf_blockdiag_cp.step import build_step



def _gpu_case(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if unsupported_reason(name, torch.device("cuda"), torch.bfloat16, 64, 64) is not None:
        pytest.skip(unsupported_reason(name, torch.device("cuda"), torch.bfloat16, 64, 64))
    device = torch.device("cuda")
    layout = plan_layout([300, 1000, 77, 500, 1], 2)
    errors = []
    for rank in range(2):
        step = build_step(layout, rank, None, device, name, "allgather")
        gen = torch.Generator(device=device).manual_seed(rank)
        shape_q, shape_k = (layout.local_len, 8, 64), (step.rank_plan.num_keys, 2, 64)
        q = torch.randn(shape_q, generator=gen, device=device, dtype=torch.float64)
        k = torch.randn(shape_k, generator=gen, device=device, dtype=torch.float64)
        v = torch.randn(shape_k, generator=gen, device=device, dtype=torch.float64)
        want = dense_attention(q, k, v, step, scale=0.125, sliding_window=None)
        got = get_kernel(name).fn(q.bfloat16(), k.bfloat16(), v.bfloat16(), step, scale=0.125, sliding_window=None)
        errors.append(float((got.double() - want).abs().max()))
    assert max(errors) < 3e-2, errors


@pytest.mark.parametrize("name", ["flash", "te"])
def test_real_kernel_on_gpu(name):
    _gpu_case(name)

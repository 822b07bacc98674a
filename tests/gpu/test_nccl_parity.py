"""The parity matrix of tests/multiprocess/test_cp_parity_matrix.py on NCCL, one process per GPU
(skipped with fewer than two GPUs): every kernel that runs on this GPU x exchange x layout, in
bf16, on the named packs and a pack of real document lengths. bf16 criterion (docs/testing.md,
"The reference"): CP's gradient error against the fp32 per-document reference is at most 1.5x the
stock bf16 model's own error, and its loss error at most 1e-2."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.kernels import kernel_names, unsupported_reason
from helpers.cp_parity import LAYOUTS, PACKS, matrix_modes, parity_matrix_case
from helpers.dist_pool import GlooPool

HEAD_DIM = 64  # a head dim every kernel was verified on (fa4 refuses 16)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(GPUS < 2, reason="needs two or more CUDA devices (one process per GPU)")]


def runnable_kernels() -> list[str]:
    cuda = torch.device("cuda", 0)
    return [k for k in kernel_names() if unsupported_reason(k, cuda, torch.bfloat16, HEAD_DIM, HEAD_DIM) is None]


@pytest.mark.parametrize("world_size", sorted({2, min(GPUS, 8)}) if GPUS >= 2 else [2])
def test_every_kernel_exchange_and_layout_on_nccl(world_size):
    kernels = runnable_kernels()
    pool = GlooPool(world_size, backend="nccl")
    try:
        rows = pool.run(parity_matrix_case, timeout=1800, kernels=kernels, device="cuda", dtype="bfloat16",
                        head_dim=HEAD_DIM, real_tokens_per_rank=1024)[0]
    finally:
        pool.close()
    packs = (*PACKS, "real_lengths")
    assert [(r["pack"], r["kernel"], r["exchange"], r["overlap"], r["layout"]) for r in rows] == [
        (p, k, x, o, lay) for p in packs for k in kernels for x, o in matrix_modes(world_size, k) for lay in LAYOUTS]
    for r in rows:
        assert r["grad_err"] <= 1.5 * r["stock_grad_err"] and r["loss_err"] <= 1e-2, r
    assert any(r["padding_ranks"] >= 1 for r in rows if r["pack"] == "padding_rank" and r["layout"] == "contiguous")

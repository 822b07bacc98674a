"""On CUDA the flex kernel trains: softcap and sinks, forward and backward, against the dense
kernel (FlexAttention has no CPU backward; the CPU forward is in unit/test_model_features.py).
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from hf_blockdiag_cp.attention import AttentionFeatures, local_attention
from hf_blockdiag_cp.step import build_step
from helpers.kernel_inputs import kernel_inputs
from helpers.reference import rel_err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (FlexAttention has no CPU backward)")
@pytest.mark.parametrize("softcap,use_sinks", [(0.7, False), (None, True), (0.7, True)])
def test_flex_features_forward_and_backward_cuda(softcap, use_sinks):
    """On CUDA the flex kernel trains: outputs and gradients of q, k, v and the sinks equal the dense kernel's."""
    layout, q, k, v, sinks = kernel_inputs(2, dk=16, dv=32)  # compiled flex needs head dims >= 16
    device = torch.device("cuda")
    leaves = [t.float().to(device).requires_grad_() for t in (q, k, v, sinks)]
    rows = layout.slot_positions.reshape(-1).to(device)
    results = {}
    for backend in ("dense", "flex"):
        grads, outs = [torch.zeros_like(t) for t in leaves], []
        for rank in range(2):
            step = build_step(layout, rank, None, device, backend, "allgather")
            mine = layout.slot_positions[rank].to(device)
            lv = [t.detach().clone().requires_grad_() for t in leaves]
            features = AttentionFeatures(softcap, lv[3] if use_sinks else None)
            out = local_attention(step, lv[0][mine], lv[1][rows], lv[2][rows], scale=0.4, sliding_window=3, features=features)
            out.square().sum().backward()
            outs.append(out.detach())
            for acc, t in zip(grads, lv):
                if t.grad is not None:
                    acc += t.grad
        results[backend] = (outs, grads)
    for a, b in zip(results["flex"][0], results["dense"][0]):
        assert rel_err(a, b) < 1e-4
    for name, a, b in zip(("q", "k", "v", "sinks"), results["flex"][1], results["dense"][1]):
        assert rel_err(a, b) < 1e-4, name

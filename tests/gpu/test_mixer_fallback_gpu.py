"""On a GPU, `mixer_backend="auto"` falling back to a torch mixer kernel says why each fast kernel was
refused (fla not installed, or not verified for the call), once per run. Runs with or without fla;
skipped without CUDA."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_blockdiag_cp.kernels import MixerDims
from hf_blockdiag_cp.kernels.mixers.registry import mixer_refusals
from hf_blockdiag_cp.mixers.context import MixerContext
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_torch_fallback_on_the_gpu_names_every_refusal_once(caplog):
    dims = MixerDims(24, 40)  # a state and head dim no fast SSD scan was verified for
    x = torch.zeros(12, 4, device="cuda", dtype=torch.bfloat16)
    refusals = {name: reason for name, reason in mixer_refusals("ssd_scan", x.device, x.dtype, dims).items()
                if name != "torch"}
    assert refusals and all(reason is not None for reason in refusals.values()), refusals
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        for _ in range(2):  # a second step (a new context) warns no more
            context = MixerContext.from_runs(MixerRuns(torch.tensor([0, 5, 12]), torch.tensor([True, True])))
            assert context.kernel("ssd_scan", x, dims).name == "torch"
    messages = [r.getMessage() for r in caplog.records if "torch ssd_scan kernel" in r.getMessage()]
    assert len(messages) == 1, messages
    for name, reason in refusals.items():
        assert f"{name}: {reason}" in messages[0]

"""Model patches stay bound when Transformers re-kernelizes a loaded model on `train()` / `eval()`.

With the `kernels` package installed, Transformers (5.25) loads models with Hub kernels on and
re-kernelizes the layers it marks for them whenever the mode changes, dropping any forward bound
on such a layer: a patched gated delta-rule layer would then run its stock forward inside a CP
step (documents mixed, silently). The Trainer calls `model.train()` at every step. Transformers
5.25 depends on `kernels`; with an older release and no `kernels` nothing re-kernelizes, and the
test is skipped."""

from __future__ import annotations

import pytest
import torch

from helpers.model_zoo import tiny_hybrid_config
from hf_blockdiag_cp import apply_model_patches


def test_a_loaded_hybrids_patched_layers_keep_their_forward_through_mode_changes(tmp_path):
    pytest.importorskip("kernels", reason="Transformers re-kernelizes layers only with the kernels package")
    from transformers import AutoModelForCausalLM

    config = tiny_hybrid_config("qwen3_5")
    config.use_cache = False
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="blockdiag_cp", dtype=torch.float32)
    apply_model_patches(model)
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    assert layers, "the tiny Qwen3.5 has no gated delta-rule layer"
    bound = {id(m): m.__dict__.get("forward") for m in layers}
    assert all(f is not None for f in bound.values()), "apply_model_patches bound no forward"
    for mode in (True, False, True):
        model.train(mode)
        for m in layers:
            forward = m.__dict__.get("forward")
            assert forward is not None and forward.__func__ is bound[id(m)].__func__, (
                f"model.train({mode}) dropped the patched forward of {type(m).__name__}")
    assert all(type(m).__name__ == "Qwen3_5GatedDeltaNet" for m in layers)

"""The tiny Llama the Trainer tests train (the parity config of helpers/reference.py, no cache)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import hf_blockdiag_cp  # noqa: F401 - registers "blockdiag_cp"
from helpers.reference import tiny_config


def tiny_model(attn: str = "blockdiag_cp", **overrides):
    torch.manual_seed(0)
    config = tiny_config("llama", **{"use_cache": False, **overrides})
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32)

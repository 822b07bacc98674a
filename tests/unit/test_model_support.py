"""`configured_model` finds the module that holds the config through the wrappers a user puts around a
model (a DDP-style `.module`, `torch.compile`), so the shard step's `model=` applies the patches to
the real model whatever wraps it, and stops at a module without a config."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

from hf_blockdiag_cp.step.model_support import configured_model


class _Wrapper(torch.nn.Module):
    """Holds its model as `.module`, as DistributedDataParallel does."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module


def test_configured_model_looks_through_wrappers_to_a_falsy_module():
    inner = torch.nn.ModuleList()  # no children: len() is 0, so the module itself is falsy
    inner.config = LlamaConfig()
    assert not inner
    assert configured_model(inner) is inner
    assert configured_model(_Wrapper(inner)) is inner
    assert configured_model(torch.compile(_Wrapper(inner))) is inner


def test_configured_model_is_none_without_a_config():
    assert configured_model(_Wrapper(torch.nn.Linear(2, 2))) is None
    assert configured_model(torch.compile(torch.nn.Linear(2, 2))) is None

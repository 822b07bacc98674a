"""The one hook through which attention asks the model patches whether a model can train under CP.

The package root registers `hf_blockdiag_cp.model_patches.check_attention_module` here
(`register_model_check`); the attention entry point calls it once per step and module class.
The patches sit above attention (they use the step state), so attention reaches them only
through this hook.
"""

from __future__ import annotations

from typing import Callable

import torch

_MODEL_CHECK: Callable[[torch.nn.Module], None] | None = None


def register_model_check(check: Callable[[torch.nn.Module], None]) -> None:
    """Install `check(attention_module)`, which raises if the owning model cannot train exactly under CP."""
    global _MODEL_CHECK
    _MODEL_CHECK = check


def check_model_support(step, module: torch.nn.Module) -> None:
    """Raise (once per step and module class) if this model type bypasses the interface or lacks its patch."""
    if _MODEL_CHECK is None:
        raise RuntimeError(
            "blockdiag_cp: no model check is registered; `import hf_blockdiag_cp` (which registers the model patches' check) "
            "before running a CP step"
        )
    step.cached(("model_support", type(module)), lambda: _MODEL_CHECK(module) or True)

"""The registry of model patches, keyed by `model_type`, and the checks that use it.

A patch exists for a model family that trains wrongly under `blockdiag_cp` through the
attention interface alone (see each family module for why). `apply_model_patches(model)`
installs what a model needs, idempotently, and logs each patch it applies once (INFO, the
`hf_blockdiag_cp` loggers). The library calls it wherever it sees the model: the shard step's
`model=` (`make_cp_blockdiag_batch_and_ctx`, through `step.model_support`), accelerate's
`wrap_model`, the Trainer and the TRL trainer; a user may call it too.

Nothing is left to memory: the step refuses a model type known to bypass the interface
(SSM / linear-attention hybrids, see `unsupported`) before its first collective, and at the first
attention call of every CP step `check_attention_module` raises for such a type or for a model
that needs a patch nobody applied (a model the step was not given).
"""

from __future__ import annotations

import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .unsupported import UNSUPPORTED_MODEL_TYPES

# Set on every submodule of a patched model: the names of the patches applied to it.
PATCHED_ATTR = "_blockdiag_cp_patches"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelPatch:
    """One family's patch. `needed(config)` says whether this model instance needs it
    (Phi-3 only with a dynamic RoPE); `apply(model)` installs it on that instance."""

    name: str
    model_types: tuple[str, ...]
    needed: Callable[[Any], bool]
    apply: Callable[[torch.nn.Module], None]
    why: str
    any_model_type: bool = False  # also consider models of other types (config-driven patches)


PATCHES: dict[str, ModelPatch] = {}
_CONFIG_DRIVEN: list[ModelPatch] = []


def register_patch(patch: ModelPatch) -> ModelPatch:
    for model_type in patch.model_types:
        if model_type in PATCHES and PATCHES[model_type] is not patch:
            raise ValueError(f"model_type {model_type!r} already has the patch {PATCHES[model_type].name!r}")
        PATCHES[model_type] = patch
    if patch.any_model_type:
        _CONFIG_DRIVEN.append(patch)
    return patch


_KERNEL_FREE: dict[type, type] = {}


def _never(module) -> bool:
    return False


def bind_forward(module: torch.nn.Module, forward: Callable) -> None:
    """Bind `forward` as `module`'s forward, and keep it there: a layer that Transformers marks for
    Hub kernels (`kernel_layer_name`) is re-kernelized on every `train()` / `eval()` when the
    `kernels` package is installed, which drops a forward bound on the instance (the stock one would
    then run inside a CP step). Such a module gets a subclass of its class (same name) whose
    `kernel_condition` refuses kernelization."""
    cls = type(module)
    if hasattr(cls, "kernel_layer_name"):
        if cls not in _KERNEL_FREE:
            _KERNEL_FREE[cls] = type(cls.__name__, (cls,), {"kernel_condition": staticmethod(_never),
                                                             "__module__": cls.__module__,
                                                             "__qualname__": cls.__qualname__})
        module.__class__ = _KERNEL_FREE[cls]
    module.forward = types.MethodType(forward, module)


def config_model_types(config) -> list[str]:
    """The model types a config speaks for: its own and those of its sub-configs (text, vision ...)."""
    types = []
    model_type = getattr(config, "model_type", None)
    if model_type:
        types.append(model_type)
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        sub_type = getattr(sub, "model_type", None)
        if sub_type and sub_type not in types:
            types.append(sub_type)
    return types


def _unsupported_error(model_type: str) -> NotImplementedError:
    return NotImplementedError(
        f"blockdiag_cp: model_type {model_type!r} is not supported: {UNSUPPORTED_MODEL_TYPES[model_type]}. "
        "Its token mixing does not go through Transformers' AttentionInterface, so under context parallelism "
        "it would mix documents and shards silently. No patch exists in model_patches for it."
    )


def patches_for(config) -> list[ModelPatch]:
    """Patches this config needs, each once; raise for a model type known to bypass the interface."""
    found: list[ModelPatch] = []
    for model_type in config_model_types(config):
        patch = PATCHES.get(model_type)
        if model_type in UNSUPPORTED_MODEL_TYPES and patch is None:
            raise _unsupported_error(model_type)
        if patch is not None and patch not in found and patch.needed(config):
            found.append(patch)
    for patch in _CONFIG_DRIVEN:
        if patch not in found and patch.needed(config):
            found.append(patch)
    return found


def apply_model_patches(model: torch.nn.Module) -> tuple[str, ...]:
    """Install every patch `model` needs (idempotent) and return their names; log each one applied.

    Raises NotImplementedError for model types known to bypass the attention interface. When
    nothing is missing it touches nothing (the shard step calls it every step).
    """
    config = getattr(model, "config", None)
    if config is None:
        raise TypeError(f"apply_model_patches needs a Transformers model with a .config; got {type(model).__name__}")
    applied = set(getattr(model, PATCHED_ATTR, ()))
    missing = [patch for patch in patches_for(config) if patch.name not in applied]
    if not missing and hasattr(model, PATCHED_ATTR):
        return tuple(sorted(applied))
    for patch in missing:
        patch.apply(model)
        applied.add(patch.name)
        logger.info("blockdiag_cp: applied the model patch %r to %s (%s)", patch.name, type(model).__name__, patch.why)
    names = frozenset(applied)
    for module in model.modules():
        object.__setattr__(module, PATCHED_ATTR, names)
    return tuple(sorted(names))


def check_attention_module(module: torch.nn.Module) -> None:
    """Raise if the model owning this attention module cannot train exactly under CP as it is."""
    config = getattr(module, "config", None)
    if config is None:
        return
    applied = getattr(module, PATCHED_ATTR, frozenset())
    missing = [p.name for p in patches_for(config) if p.name not in applied]
    if missing:
        raise RuntimeError(
            f"blockdiag_cp: this {getattr(config, 'model_type', type(module).__name__)} model needs the model patch(es) "
            f"{', '.join(missing)} for exact CP training, and they were not applied. Call "
            "hf_blockdiag_cp.apply_model_patches(model) once after loading the model."
        )

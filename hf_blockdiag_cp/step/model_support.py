"""The hook through which the step and attention reach the model patches, which sit above them.

The package root registers `hf_blockdiag_cp.model_patches`' two entry points here
(`register_model_support`): `prepare` installs what a model needs (`apply_model_patches`:
idempotent, raises NotImplementedError for a model type that bypasses the attention interface)
and `check` refuses, per attention module, a model that would train wrongly as it is. The step
prepares the model it is given (`make_cp_blockdiag_batch_and_ctx(model=...)`) before its
consensus, so a refused type raises on every rank at the first step even where no attention
call runs; attention checks each module class once per step (`check_model_support`) for models
that reach a step without being named.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..compat.torch import compiled_module
from ..kernels.embedding import fp32_embedding_grads


@dataclass(frozen=True)
class ModelSupport:
    """The model patches' entry points: `prepare(model)` and `check(attention_module)`."""

    prepare: Callable[[torch.nn.Module], Any]
    check: Callable[[torch.nn.Module], None]


_SUPPORT: ModelSupport | None = None


def register_model_support(support: ModelSupport) -> None:
    """Install the model patches' entry points (the package root does, on import)."""
    global _SUPPORT
    _SUPPORT = support


def _support() -> ModelSupport:
    if _SUPPORT is None:
        raise RuntimeError(
            "blockdiag_cp: no model support is registered; `import hf_blockdiag_cp` (which registers the model "
            "patches) before running a CP step"
        )
    return _SUPPORT


def configured_model(model) -> Any:
    """The module that holds `model`'s config: `model` itself, or the one inside a DDP (`module`) or
    `torch.compile` wrapper; None when there is none."""
    for _ in range(8):  # wrappers nest a few deep at most (DDP around a compiled model ...)
        if getattr(model, "config", None) is not None:
            return model
        inner = getattr(model, "module", None)
        if inner is None:  # not `or`: a module with no children has len() 0 and is falsy
            inner = compiled_module(model)
        if inner is None:
            return None
        model = inner
    return None


def input_embedding_rows(model) -> int | None:
    """Rows of `model`'s input embeddings (`get_input_embeddings().num_embeddings`: the token ids it
    accepts), through DDP / compile wrappers; None for a model without them (nothing to check).
    Where an embedding is split over tensor-parallel ranks, the largest of its row count, its weight's
    (global) rows and `config.vocab_size` counts: a check may miss, never refuse a valid id."""
    inner = configured_model(model)
    embeddings = _input_embeddings(inner)
    rows = getattr(embeddings, "num_embeddings", None)
    if isinstance(rows, bool) or not isinstance(rows, int):
        return None
    weight = getattr(embeddings, "weight", None)
    vocab = getattr(getattr(inner, "config", None), "vocab_size", None)
    more = [getattr(weight, "shape", (0,))[0], vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else 0]
    return max(rows, *more)


def prepare_model(model) -> None:
    """Install the patches `model` needs (each once: the registry's call is idempotent and cheap when
    nothing is missing); raise NotImplementedError for a model type the library refuses; sum the input
    embedding's weight gradient in float32 (`kernels.embedding`: a shard's few indices would otherwise
    take CUDA's half-precision accumulation). A module without a config (not a Transformers model) is
    left alone."""
    inner = configured_model(model)
    if inner is not None:
        _support().prepare(inner)
        fp32_embedding_grads(_input_embeddings(inner))


def _input_embeddings(inner):
    """`inner.get_input_embeddings()`, or None where the model has none."""
    get = getattr(inner, "get_input_embeddings", None)
    try:
        return None if get is None else get()
    except (NotImplementedError, AttributeError):
        return None


def check_model_support(step, module: torch.nn.Module) -> None:
    """Raise (once per step and module class) if this model type bypasses the interface or lacks its patch."""
    support = _support()
    step.cached(("model_support", type(module)), lambda: support.check(module) or True)

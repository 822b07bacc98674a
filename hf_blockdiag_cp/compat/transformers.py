"""Transformers internals that have no public equivalent (checked with transformers 5.17, 5.24 and 5.25,
`tests/unit/test_compat.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from packaging.version import Version

TESTED = "transformers 5.17 to 5.25"


def attn_implementation(config) -> str | None:
    """The attention implementation a model config selects (`config._attn_implementation`; the public
    side is only the setter, `PreTrainedModel.set_attn_implementation`), None without one."""
    return getattr(config, "_attn_implementation", None)


def checkpoint_function(layer: torch.nn.Module) -> Callable | None:
    """The checkpoint function activation checkpointing gave `layer` (a `functools.partial` of
    `torch.utils.checkpoint.checkpoint` with its keywords), None if it has none."""
    return getattr(layer, "_gradient_checkpointing_func", None)


def set_checkpoint_function(layer: torch.nn.Module, function: Callable) -> None:
    """Make `layer` checkpoint its forward with `function(forward, *args)` (same call as the stock one)."""
    layer._gradient_checkpointing_func = function


def enable_activation_checkpointing(model, **checkpoint_kwargs) -> None:
    """Transformers' activation checkpointing of `model`'s layers, `checkpoint_kwargs` going to
    `torch.utils.checkpoint.checkpoint`: `activation_checkpointing_enable` where the installed release
    has it (its older name, `gradient_checkpointing_enable`, warns there and goes in v6), else the old one."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=checkpoint_kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs)


def checkpointing_call() -> str:
    """How to enable non-reentrant activation checkpointing with the installed Transformers (for messages)."""
    import transformers

    if hasattr(transformers.PreTrainedModel, "activation_checkpointing_enable"):
        return "model.activation_checkpointing_enable(activation_checkpointing_kwargs={'use_reentrant': False})"
    return "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False})"


def trainer_reads_loss_scaling_flag() -> bool:
    """Whether `Trainer.training_step` reads `loss_is_scaled_for_ga` (public from transformers 5.19).
    Earlier releases decide from `model_accepts_loss_kwargs` and `compute_loss_func` alone, and TRL's
    trainers on them turn a set flag into a placeholder `compute_loss_func`."""
    import transformers  # at the call: importing some of its submodules replaces `transformers` in sys.modules

    return Version(transformers.__version__) >= Version("5.19.0")


# The first release whose `PreTrainedModel._expand_parallel_plan` and three-argument
# `apply_tensor_parallelism` the tensor-parallel path uses (5.17 to 5.22 have neither).
TP_MIN_TRANSFORMERS = "5.23.0"


def causal_lm_loss() -> Callable:
    """Transformers' stock causal-LM loss, `loss.loss_utils.ForCausalLMLoss`: what a causal LM's
    `loss_function` is unless its config names another `loss_type` or the loss was replaced."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss


def tensor_parallel_supported() -> bool:
    """Whether the installed Transformers has what `expanded_tp_plan` and `apply_tensor_parallel` call."""
    import transformers

    return Version(transformers.__version__) >= Version(TP_MIN_TRANSFORMERS)


def expanded_tp_plan(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """`plan` with its wildcard module names expanded over `model` (`PreTrainedModel._expand_parallel_plan`;
    the public path, `from_pretrained(tp_plan=...)`, builds its own device mesh)."""
    import transformers

    expand = getattr(model, "_expand_parallel_plan", None)
    if expand is None and isinstance(model, transformers.PreTrainedModel) and not tensor_parallel_supported():
        raise ImportError(f"tensor parallelism needs transformers >= {TP_MIN_TRANSFORMERS} (PreTrainedModel."
                          f"_expand_parallel_plan); transformers {transformers.__version__} is installed: use tp=1")
    if expand is None:
        raise TypeError(f"{type(model).__name__} is not a Transformers PreTrainedModel with a parallel plan")
    return expand(plan)

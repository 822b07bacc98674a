"""`torch.compile` for models on `blockdiag_cp`: the whole model or each decoder layer, with or
without activation checkpointing (docs/performance.md, "torch.compile").

What compiles: everything but the attention call of a CP step. That call
(`attention.entry.step_attention`: checks, K/V exchange, kernel) is a graph break, so the step's
plan, routes, caches and process group never enter a graph or its guards, and a new pack of the
same length runs the same compiled code. Plain `model.compile()` or `layer.compile()` for every
decoder layer is enough without activation checkpointing.

With activation checkpointing, dynamo traces `torch.utils.checkpoint` as one higher-order op,
which cannot hold a graph break: the checkpointed layers would then run eagerly (and `checkpoint`
keeps dynamo off everything it calls). `compile_model` and `compile_checkpointed_layers` give each
checkpointed layer a checkpoint function (`CompiledCheckpointBody`) that runs the checkpoint
eagerly, a graph break in a compiled caller, and the layer body inside it, forward and
recompute, compiled on its own.
"""

from __future__ import annotations

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

from ..compat.transformers import checkpoint_function, set_checkpoint_function

REGIONS = ("model", "layers")


def _run(function, *args):
    """The checkpointed body: HF passes `partial(layer.forward, layer, **kwargs)` and the tensors."""
    return function(*args)


class CompiledCheckpointBody:
    """A layer's checkpoint function (`compat.transformers.checkpoint_function`) whose body runs compiled.

    `checkpoint_func` is the function Transformers installed (a `functools.partial` of
    `torch.utils.checkpoint.checkpoint`); its keyword arguments stay readable as `keywords` (the
    Trainer's setup checks read `use_reentrant` there)."""

    def __init__(self, checkpoint_func, body):
        self.checkpoint_func = checkpoint_func
        self.body = body

    @property
    def keywords(self) -> dict:
        return dict(getattr(self.checkpoint_func, "keywords", None) or {})

    @torch.compiler.disable
    def __call__(self, function, *args, **kwargs):
        return self.checkpoint_func(self.body, function, *args, **kwargs)


def _check_compile_kwargs(compile_kwargs: dict) -> None:
    if compile_kwargs.get("fullgraph"):
        raise ValueError(
            "torch.compile fullgraph=True cannot hold the graph break at blockdiag_cp's attention call (exchange + "
            "kernel run eagerly); compile with fullgraph=False"
        )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost `GradientCheckpointingLayer`s of `model`: its decoder layers (and a vision tower's blocks)."""
    layers, inside = [], set()
    for name, module in model.named_modules():
        if isinstance(module, GradientCheckpointingLayer) and not any(name.startswith(p + ".") for p in inside):
            layers.append(module)
            inside.add(name)
    return layers


def compile_checkpointed_layers(model: torch.nn.Module, **compile_kwargs) -> int:
    """Compile the body of every checkpointed layer of `model` with `torch.compile(**compile_kwargs)`
    inside its (eager) checkpoint; returns how many layers checkpoint. Call it after enabling
    activation checkpointing (which installs a fresh checkpoint function) and again after any
    re-enable; calling it twice replaces the earlier compiled body."""
    _check_compile_kwargs(compile_kwargs)
    body = None
    count = 0
    for module in model.modules():
        func = checkpoint_function(module)
        if not getattr(module, "gradient_checkpointing", False) or func is None:
            continue
        if body is None:
            body = torch.compile(_run, **compile_kwargs)
        if isinstance(func, CompiledCheckpointBody):
            func = func.checkpoint_func
        set_checkpoint_function(module, CompiledCheckpointBody(func, body))
        count += 1
    return count


def compile_model(model: torch.nn.Module, regions: str = "layers", **compile_kwargs) -> torch.nn.Module:
    """`torch.compile` `model` in place: `regions="model"` compiles its forward as a whole,
    `"layers"` each decoder layer (regional compilation: one compile reused by every layer of a
    class). Checkpointed layers get their body compiled inside the checkpoint (see the module
    docstring). Returns `model`."""
    if regions not in REGIONS:
        raise ValueError(f"regions must be one of {REGIONS}; got {regions!r}")
    _check_compile_kwargs(compile_kwargs)
    compile_checkpointed_layers(model, **compile_kwargs)
    if regions == "model":
        model.compile(**compile_kwargs)
        return model
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"compile_model: {type(model).__name__} has no Transformers decoder layer (GradientCheckpointingLayer) "
            "to compile; use regions='model'"
        )
    for layer in layers:
        layer.compile(**compile_kwargs)
    return model

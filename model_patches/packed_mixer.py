"""What every recurrent token-mixer patch does around its mixer, and its one declaration.

A family module declares its patch with `register_mixer_patch`: the model types, the config's layer
types that hold such a mixer, how to recognise the layer, what the token mixer reads of it
(`mixer_layer`), the mixer (`mix`), and the rows forward between the stock projections (`forward`).
Everything else is here: when the packed path runs, which context it runs in, the check that the
family's own torch function exists, and how the patched forward is installed.

A patched mixer layer (gated delta rule, KDA, short gated convolution, Mamba) runs its stock forward
outside a CP step unless the caller passes `cu_seq_lens_q` (a packed row without CP), and always
when a cache holds earlier state (generation). Otherwise it takes one packed row `[1, L, D]`,
keyword arguments only, zeroes the rows a 2-D attention mask marks as padding as the stock
forward does, and mixes per document in the step's `MixerContext`.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hf_blockdiag_cp.mixers import MixerContext
from hf_blockdiag_cp.planning.mixer_plan import MixerRuns
from hf_blockdiag_cp.step.state import STEP_KWARG, active_step

from .registry import ModelPatch, bind_forward, register_patch

ATTENTION_FREE_ATTR = "_blockdiag_cp_attention_free"  # set on the mixers of a model without attention layers
# the class names of the patched mixer layers (the last five: Mamba1's and Mamba2's in their families)
_MIXER_CLASSES = ("GatedDeltaNet", "DeltaAttention", "ShortConv", "Mamba2Mixer", "BambaMixer", "FalconH1Mixer",
                  "MambaMixer", "MambaLayer")


def has_previous_state(module, cache) -> bool:
    """Whether `cache` holds this layer's state from earlier tokens (Transformers' generic query)."""
    if cache is None:
        return False
    state = getattr(cache, "has_previous_state", False)
    return bool(state(module.layer_idx) if callable(state) else state)


def family_function(module, name: str):
    """Transformers' torch function `name` of the module's family (its chunked rule or scan), never a
    hub / fla replacement."""
    fn = getattr(sys.modules[type(module).__module__], name, None)
    if fn is None:
        raise RuntimeError(f"model_patches: {type(module).__module__} has no {name}")
    return inspect.unwrap(fn)


def layer_name(module) -> str:
    """How messages and plans name a mixer layer: its class and index."""
    return f"{type(module).__name__} (layer {module.layer_idx})"


def packed_rows(module, hidden_states: torch.Tensor, args, kwargs, cached_state=has_previous_state):
    """`(step or None, rows [L, D])` when the packed path runs, None when the stock forward must."""
    step = kwargs.get(STEP_KWARG) or active_step()
    cache = kwargs.get("cache", kwargs.get("cache_params"))
    if step is None and kwargs.get("cu_seq_lens_q") is None:
        return None
    if step is not None and getattr(module, ATTENTION_FREE_ATTR, False):
        step.attention_free = True  # no attention call comes in this model's step
    if cached_state(module, cache):
        if step is None:
            return None
        raise ValueError(f"blockdiag_cp: {type(module).__name__} cannot continue from a cache inside a CP step")
    if args or hidden_states.shape[0] != 1:
        raise ValueError(
            f"blockdiag_cp: packed {type(module).__name__} takes one packed row, hidden_states [1, L, D] and keyword "
            f"arguments; got shape {tuple(hidden_states.shape)} and {len(args)} positional arguments"
        )
    mask = kwargs.get("attention_mask")
    if mask is not None and mask.ndim == 2:
        hidden_states = (hidden_states * mask[:, :, None]).to(hidden_states.dtype)
    return step, hidden_states[0]


def mixer_context(module, step, kwargs, rows: int) -> MixerContext:
    """The step's context, or one packed row's documents from `cu_seq_lens_q` outside a step."""
    if step is None:
        return MixerContext.from_runs(MixerRuns.documents(kwargs["cu_seq_lens_q"], rows))
    if rows != step.local_len:
        raise ValueError(
            f"blockdiag_cp: {type(module).__name__} got {rows} rows in a CP step whose shards hold {step.local_len}; "
            "feed the local batch returned by make_cp_blockdiag_batch_and_ctx"
        )
    return MixerContext.from_step(step)


@torch.compiler.disable
def mix_documents(patch: "MixerPatch", module, step, kwargs, rows: int, *inputs) -> torch.Tensor:
    """`patch.mix(patch.mixer_layer(module), *inputs, context)`: the token mixer over the pack's documents
    in the step's context (`mixer_context`). Eager, a graph break under `torch.compile`, so the pack's
    runs and the step stay out of compiled graphs (no recompile per pack)."""
    return patch.mix(patch.mixer_layer(module), *inputs, mixer_context(module, step, kwargs, rows))


@dataclass(frozen=True)
class MixerPatch:
    """One family's token-mixer patch (`register_mixer_patch` says what each field is)."""

    name: str
    model_types: tuple[str, ...]
    layer_types: tuple[str, ...]
    is_layer: Callable[[torch.nn.Module], bool]
    layer: str
    mixer_layer: Callable[[torch.nn.Module], Any]
    mix: Callable[..., torch.Tensor]
    forward: Callable[..., Any]
    why: str
    torch_function: str | None = None
    cached_state: Callable[[torch.nn.Module, Any], bool] = has_previous_state
    prepare: Callable[[torch.nn.Module], None] | None = None

    @property
    def family(self) -> str:
        """The family module that declared the patch (where `is_layer` lives)."""
        return self.is_layer.__module__.rsplit(".", 1)[-1]

    def needed(self, config) -> bool:
        """Whether the (text) config has such layers (no layer types: assume so)."""
        layer_types = getattr(getattr(config, "text_config", None) or config, "layer_types", None)
        return layer_types is None or any(t in self.layer_types for t in layer_types)

    def check(self, module) -> None:
        """Raise now, at install, if the family's own torch function is missing."""
        if self.torch_function is not None:
            family_function(module, self.torch_function)

    def packed_forward(self, module, hidden_states, *args, **kwargs):
        """The patched forward: `forward(module, rows [L, D], mix, kwargs)` where the packed path runs (`packed_rows`),
        `mix(*inputs)` the mixer over the documents; the stock forward elsewhere."""
        entry = packed_rows(module, hidden_states, args, kwargs, self.cached_state)
        if entry is None:
            return type(module).forward(module, hidden_states, *args, **kwargs)
        step, rows = entry
        return self.forward(module, rows, lambda *inputs: mix_documents(self, module, step, kwargs, rows.shape[0], *inputs),
                            kwargs)

    def apply(self, model: torch.nn.Module) -> None:
        if self.prepare is not None:
            self.prepare(model)
        install(model, self.is_layer, self.packed_forward, f"model_patches.{self.family}: no {self.layer}",
                check=self.check)


def register_mixer_patch(
    name: str, model_types: tuple[str, ...], *, layer_types: tuple[str, ...], is_layer, layer: str, mixer_layer, mix,
    forward, why: str, torch_function: str | None = None, cached_state=has_previous_state, prepare=None,
) -> MixerPatch:
    """Declare a family's token-mixer patch and register it for `model_types`.

    `layer_types`: the `config.layer_types` entries that hold such a mixer; `is_layer(module)` finds the
    layers (`layer` names them when none is found); `mixer_layer(module)` is what the mixer reads of one
    (its parameters, not copies); `mix(mixer_layer, *inputs, context)` the token mixer of
    `hf_blockdiag_cp.mixers`; `forward(module, rows [L, D], mix, kwargs) -> output` the layer's forward on
    one packed row (`kwargs`: the layer's), calling `mix(*inputs)` between the stock projections. `torch_function`: the family's
    torch function the torch kernels take, checked at install; `cached_state(module, cache)`: whether a
    cache holds the layer's earlier state (generation: stock outside a step, refused inside one);
    `prepare(model)`: anything else the model needs before the layers are patched."""
    patch = MixerPatch(name, tuple(model_types), tuple(layer_types), is_layer, layer, mixer_layer, mix, forward, why,
                       torch_function, cached_state, prepare)
    register_patch(ModelPatch(name=name, model_types=patch.model_types, needed=patch.needed, apply=patch.apply, why=why))
    return patch


def install(model: torch.nn.Module, is_layer: Callable[[torch.nn.Module], bool], forward: Callable,
            missing: str, check: Callable[[torch.nn.Module], object] | None = None) -> None:
    """Bind `forward` on every module of `model` that `is_layer` accepts (after `check(module)`, which
    raises now rather than at the first step); none found raises "`missing` found in <model class>"
    (a patch of this model's type that finds nothing to patch must not pass silently). In a model
    whose layers are all token mixers (Mamba, Mamba2) the mixers tell the step that no attention
    call comes."""
    layer_types = getattr(getattr(model, "config", None), "layer_types", None)
    attention_free = bool(layer_types) and all(t == "linear_attention" for t in layer_types)
    patched = 0
    for module in model.modules():
        if is_layer(module):
            if check is not None:
                check(module)
            bind_forward(module, forward)
            setattr(module, ATTENTION_FREE_ATTR, attention_free)
            patched += 1
    if patched == 0:
        raise RuntimeError(f"{missing} found in {type(model).__name__}")


@contextlib.contextmanager
def stock_torch_kernels(model: torch.nn.Module):
    """Run the stock (unpatched) model's token-mixer layers (gated delta rule, KDA, short convolution,
    Mamba1, Mamba2) on Transformers' own torch convolution, chunked rules and scans even where
    flash-linear-attention, causal-conv1d or mamba-ssm is installed (Transformers swaps those in at
    import): a stock baseline or reference then uses the same kernels as the patch's torch path.
    No-op for a model without such layers."""
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith(_MIXER_CLASSES)}
    names = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention", "causal_conv1d_fn", "causal_conv1d_update",
             "mamba2_chunk_scan", "mamba2_split_conv1d_scan_combined", "mamba2_selective_state_update",
             "mamba_selective_scan", "mamba_inner_fn", "mamba_selective_state_update")
    saved = [(mod, name, getattr(mod, name)) for mod in modules for name in names if hasattr(mod, name)]
    for mod, name, fn in saved:
        setattr(mod, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)

"""cp = 1 packed attention for modules that call `F.scaled_dot_product_attention` themselves.

Some attention modules (custom or remote-code models) never go through Transformers'
AttentionInterface: they call `torch.nn.functional.scaled_dot_product_attention(q, k, v,
is_causal=True)` on the whole packed row, which lets documents attend to each other. These
hooks make such calls block-causal on one rank without touching the model's code:

    hooks = attach_cp1_packed_varlen_hooks(model)    # once
    enable_cp1_packed_varlen(document_ids, "auto")   # before every packed forward
    loss = model(**batch).loss
    loss.backward()                                  # recompute stays packed

Scope: `F.scaled_dot_product_attention` is replaced only while a hooked attention module's
forward runs (forward pre-hook in, forward hook with `always_call=True` out, so it is restored
even when the forward raises), and the replacement routes only causal, mask-free calls made
from such a forward; everything else goes to the original SDPA. Hooks sit on the attention
modules themselves, inside any checkpoint wrapper, so activation-checkpoint recompute
(which re-runs the inner module during backward) takes the packed path again. The packing
state survives backward and is cleared at the next outer (model) forward: call
`enable_cp1_packed_varlen` before every packed forward.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from ..kernels import canonical_kernel_name
from ..planning import Layout, plan_layout, validate_document_ids
from ..step import CPStep, build_step
from .entry import blockdiag_attention


# --------------------------------------------------------------------------- packing state


@dataclass
class _PackedState:
    """One packed batch: its document ids, the kernel choice, and its cp = 1 plan per device."""

    backend: str
    layout: Layout
    steps: dict = field(default_factory=dict)
    outer_forwards: int = 0

    @property
    def seq_len(self) -> int:
        return self.layout.original_seq_len

    def step_for(self, device: torch.device) -> CPStep:
        step = self.steps.get(device)
        if step is None:  # plan moved to the device once, reused by every layer and by recompute
            step = self.steps[device] = build_step(self.layout, 0, None, device, self.backend, "allgather")
        return step


_STATE: _PackedState | None = None


def enable_cp1_packed_varlen(doc_ids: torch.Tensor, backend: str = "auto") -> None:
    """Make hooked attention block-causal over `doc_ids` ([S] or [1,S], 1-based, 0 = padding)
    with kernel `backend` (any `attn_backend` spelling; `auto` = varlen on CUDA in half
    precision, else the first kernel that can run). Holds until the next outer forward after
    the one it is used for, or `disable_cp1_packed_varlen()`."""
    global _STATE
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a tensor of document ids; got {type(doc_ids).__name__}")
    if doc_ids.ndim == 2 and doc_ids.shape[0] != 1:
        raise ValueError(f"doc_ids must be [S] or [1,S] (one packed row); got shape {tuple(doc_ids.shape)}")
    if doc_ids.ndim not in (1, 2) or doc_ids.dtype.is_floating_point:
        raise ValueError(f"doc_ids must be an integer tensor [S] or [1,S]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    ids = doc_ids.reshape(-1).long().cpu()
    validate_document_ids(ids, "doc_ids")
    _STATE = _PackedState(backend=canonical_kernel_name(backend), layout=plan_layout(ids, 1))


def disable_cp1_packed_varlen() -> None:
    """Back to stock SDPA in hooked modules."""
    global _STATE
    _STATE = None


def cp1_packed_varlen_backend() -> str | None:
    """The canonical kernel name requested by `enable_cp1_packed_varlen`, or None when disabled."""
    return None if _STATE is None else _STATE.backend


# --------------------------------------------------------------------------- the scoped swap

_lock = threading.Lock()
_swap_depth = 0  # hooked forwards in progress, all threads
_original_sdpa: Callable | None = None  # F.scaled_dot_product_attention before the outermost of them
_thread = threading.local()  # .depth: hooked forwards in progress in this thread


def _enter(module, args):
    global _swap_depth, _original_sdpa
    with _lock:
        if _swap_depth == 0:
            _original_sdpa = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = packed_sdpa
        _swap_depth += 1
    _thread.depth = getattr(_thread, "depth", 0) + 1


def _exit(module, args, output):
    global _swap_depth, _original_sdpa
    _thread.depth -= 1
    with _lock:
        _swap_depth -= 1
        if _swap_depth == 0:
            F.scaled_dot_product_attention = _original_sdpa
            _original_sdpa = None


def _outer_forward(module, args):
    """Model forward: the state set for the previous forward (and its backward) is spent."""
    global _STATE
    state = _STATE
    if state is None:
        return
    if state.outer_forwards >= 1:
        _STATE = None
    else:
        state.outer_forwards += 1


def packed_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, **kwargs):
    """What hooked attention forwards see as `F.scaled_dot_product_attention`."""
    original = _original_sdpa or torch._C._nn.scaled_dot_product_attention
    state = _STATE
    if state is None or getattr(_thread, "depth", 0) == 0 or not is_causal:
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa, **kwargs)
    if attn_mask is not None:
        raise ValueError(
            "cp1 packed attention: a causal SDPA call came with its own attn_mask; the packed path builds the "
            "per-document mask from doc_ids itself. Call it with attn_mask=None, is_causal=True, or disable the "
            "packed path (disable_cp1_packed_varlen) for this model"
        )
    if dropout_p:
        raise NotImplementedError(f"cp1 packed attention: dropout_p={dropout_p} is not supported; use 0 (or eval mode)")
    if query.ndim != 4 or query.shape[0] != 1:
        raise ValueError(f"cp1 packed attention needs query [1,H,S,D] (one packed row); got {tuple(query.shape)}")
    seq_len = query.shape[2]
    if seq_len != state.seq_len or key.shape[2] != seq_len:
        raise ValueError(
            f"cp1 packed attention: query has {seq_len} and key {key.shape[2]} positions, but doc_ids given to "
            f"enable_cp1_packed_varlen hold {state.seq_len}; call it with this batch's document ids"
        )
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"cp1 packed attention: {query.shape[1]} query heads and {key.shape[1]} key heads need enable_gqa=True"
        )
    step = state.step_for(query.device)
    pad = step.local_len - seq_len  # the cp = 1 plan pads to an even length
    if pad:
        query, key, value = (F.pad(t, (0, 0, 0, pad)) for t in (query, key, value))
    out = blockdiag_attention(step, query, key, value, scale=scale, sliding_window=None)
    return out[:, :seq_len].transpose(1, 2)


# --------------------------------------------------------------------------- attaching


def _is_attention_module(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return name.endswith("attention") or name.endswith("attn")


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    """The module a checkpoint wrapper recomputes (hooks there fire again during backward)."""
    while hasattr(module, "_checkpoint_wrapped_module"):
        module = module._checkpoint_wrapped_module
    return module


@dataclass
class Cp1PackedHooks:
    """Handles of the installed hooks; `remove()` detaches them."""

    attention_modules: list
    handles: list

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def attach_cp1_packed_varlen_hooks(
    model: torch.nn.Module,
    modules: Iterable[torch.nn.Module] | None = None,
    module_filter: Callable[[torch.nn.Module], bool] | None = None,
) -> Cp1PackedHooks:
    """Hook the attention modules of `model` (default: classes named `*Attention` / `*Attn`, or
    the given `modules`, or those passing `module_filter`), and `model`'s own forward, which
    clears a spent packing state. Raises if no attention module is found."""
    if modules is None:
        keep = module_filter or _is_attention_module
        modules = [m for m in model.modules() if keep(m) and not hasattr(m, "_checkpoint_wrapped_module")]
    targets = []
    for m in modules:
        inner = _inner(m)
        if all(inner is not t for t in targets):
            targets.append(inner)
    if not targets:
        raise ValueError(
            f"attach_cp1_packed_varlen_hooks: no attention module found in {type(model).__name__}; pass modules= "
            "or module_filter= to name the modules whose forward calls F.scaled_dot_product_attention"
        )
    handles = [model.register_forward_pre_hook(_outer_forward)]
    for m in targets:
        handles.append(m.register_forward_pre_hook(_enter))
        handles.append(m.register_forward_hook(_exit, always_call=True))
    return Cp1PackedHooks(targets, handles)

"""cp = 1 packed attention for modules that call `scaled_dot_product_attention` themselves.

Some attention modules (custom or remote-code models) never go through Transformers'
AttentionInterface: they call SDPA with `is_causal=True` on the whole packed row, which lets
documents attend to each other. These hooks make such calls per document on one rank without
touching the model's code (usage and rules: docs/models.md, "cp = 1"):

    hooks = attach_cp1_packed_varlen_hooks(model)  # once
    hooks.enable(document_ids, "auto")             # before every packed forward
    loss = model(**batch).loss
    loss.backward()                                # recompute stays packed

Exact or loud: while a pack is armed, every SDPA call inside a hooked forward runs per document
or raises naming the module. A `TorchFunctionMode`, entered only while a hooked forward runs,
catches the calls however SDPA was bound; each hooks object holds its own pack.

Not under `torch.compile`: dynamo would trace the hooks, the mode and the pack into the graphs
(one recompile per pack, thread ids as constants). An armed pack met while dynamo traces a hooked
forward or one of its SDPA calls raises; compiled regions that hold no hooked module (e.g. the
MLPs) are fine. Models on `attn_implementation="blockdiag_cp"` compile (`integrations.compile`).
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..compat.torch import checkpoint_wrapped_module, forbid_in_graph, unwrapped_name
from ..kernels import canonical_kernel_name
from ..planning import Layout, plan_layout, validate_document_ids
from ..step import CPStep, build_step
from .dispatch import blockdiag_attention

# The function every spelling of SDPA reaches: the builtin that torch.nn.functional exports.
_SDPA = F.scaled_dot_product_attention


# --------------------------------------------------------------------------- one pack


@dataclass
class _PackedState:
    """One armed pack: its kernel, its cp = 1 plan, the plan on each device, outer forwards seen."""

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


def _plan(doc_ids: torch.Tensor, backend: str) -> tuple[str, Layout]:
    """Check `doc_ids` ([S] or [1,S], 1-based, 0 = padding) and `backend`; the cp = 1 layout."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a tensor of document ids; got {type(doc_ids).__name__}")
    if doc_ids.ndim == 2 and doc_ids.shape[0] != 1:
        raise ValueError(f"doc_ids must be [S] or [1,S] (one packed row); got shape {tuple(doc_ids.shape)}")
    if doc_ids.ndim not in (1, 2) or doc_ids.dtype.is_floating_point:
        raise ValueError(f"doc_ids must be an integer tensor [S] or [1,S]; got {doc_ids.dtype} {tuple(doc_ids.shape)}")
    ids = doc_ids.reshape(-1).long().cpu()
    validate_document_ids(ids, "doc_ids")
    return canonical_kernel_name(backend), plan_layout(ids, 1)


class _CompileRefusal:
    """Called only while dynamo traces hooked code with a pack armed: `forbid_in_graph` makes dynamo
    raise (a plain raise would only be a graph break, then the hook would run eagerly), naming this."""

    def __repr__(self) -> str:
        return (
            "cp1 packed attention hooks (attach_cp1_packed_varlen_hooks) with a pack armed, inside a "
            "torch.compile region: the hooks do not support torch.compile. Compile only modules without hooked "
            "attention, or load the model with attn_implementation='blockdiag_cp', which compiles"
        )

    def __call__(self):
        raise RuntimeError(repr(self))


_REFUSE_UNDER_COMPILE = forbid_in_graph(_CompileRefusal())


# --------------------------------------------------------------------------- one SDPA call


class _SdpaCall(NamedTuple):
    """The arguments of one SDPA call, bound as the builtin binds them (positional or keyword)."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False


def _shape(t) -> str:
    return f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def _unsupported(call: _SdpaCall, seq_len: int) -> str | None:
    """What `call` does that the packed path cannot do exactly, or None."""
    q, k, v = call.query, call.key, call.value
    if call.attn_mask is not None:
        return (f"an explicit attn_mask of shape {_shape(call.attn_mask)}; the packed path builds the per-document "
                "causal mask from doc_ids itself, so call SDPA with attn_mask=None, is_causal=True")
    if not call.is_causal:
        return "is_causal=False (bidirectional attention); only causal self-attention can run per document"
    if call.dropout_p:
        return f"dropout_p={call.dropout_p}; attention dropout is not supported (set it to 0 or use eval mode)"
    if not all(isinstance(t, torch.Tensor) and t.ndim == 4 and t.shape[0] == 1 for t in (q, k, v)):
        return (f"query {_shape(q)}, key {_shape(k)}, value {_shape(v)}; the packed path needs "
                "[1, heads, seq, head_dim] tensors (one packed row)")
    if q.shape[2] != seq_len or k.shape[2] != seq_len or v.shape[2] != seq_len:
        return (f"query/key/value of {q.shape[2]}/{k.shape[2]}/{v.shape[2]} positions, but the armed doc_ids "
                f"hold {seq_len}; arm this batch's document ids")
    if k.shape[1] != v.shape[1] or q.shape[1] % k.shape[1] or (q.shape[1] != k.shape[1] and not call.enable_gqa):
        return (f"{q.shape[1]} query heads, {k.shape[1]} key heads and {v.shape[1]} value heads; key and value "
                "heads must match and divide the query heads, with enable_gqa=True when they differ")
    return None


def _packed_attention(state: _PackedState, call: _SdpaCall) -> torch.Tensor:
    """Per-document causal attention of one packed row, laid out as SDPA returns it ([1,H,S,D])."""
    q, k, v = call.query, call.key, call.value
    seq_len = q.shape[2]
    step = state.step_for(q.device)
    pad = step.local_len - seq_len  # the cp = 1 plan pads to an even length
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    out = blockdiag_attention(step, q, k, v, scale=call.scale, sliding_window=None)
    return out[:, :seq_len].transpose(1, 2)


class _PackedSdpaMode(TorchFunctionMode):
    """Routes SDPA calls to their hooks object; every other function runs as it would."""

    def __init__(self, hooks: Cp1PackedHooks):
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.hooks._sdpa(args, kwargs)
        return func(*args, **kwargs)


# --------------------------------------------------------------------------- the hooks object


@dataclass(eq=False)
class _Frame:
    """A hooked forward in progress: its module, the mode it entered (outermost only), SDPA calls, and
    the exception being handled when it started (a forward may run inside an `except` block)."""

    module: torch.nn.Module
    mode: _PackedSdpaMode | None
    calls: int = 0
    handling: BaseException | None = field(default_factory=lambda: sys.exc_info()[1])


_LIVE: weakref.WeakSet = weakref.WeakSet()  # hooks objects not removed yet; no pack lives here


class Cp1PackedHooks:
    """The hooks on one model's attention modules and the pack they run (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, attention_modules: list[torch.nn.Module]):
        names = {id(m): unwrapped_name(n) for n, m in model.named_modules()}
        self.attention_modules = list(attention_modules)
        self._labels = {id(m): f"{names[id(m)] or '<root>'} ({type(m).__name__})" if id(m) in names
                        else type(m).__name__ for m in self.attention_modules}
        self._state: _PackedState | None = None
        self._frames: dict[int, list[_Frame]] = {}  # thread id -> hooked forwards in progress there
        self._handles = [model.register_forward_pre_hook(self._outer_forward)]
        for m in self.attention_modules:
            self._handles.append(m.register_forward_pre_hook(self._enter))
            self._handles.append(m.register_forward_hook(self._exit, always_call=True))
        _LIVE.add(self)

    def enable(self, doc_ids: torch.Tensor, backend: str = "auto") -> None:
        """Arm the pack `doc_ids` ([S] or [1,S], 1-based, 0 = padding) with kernel `backend` (any
        `attn_backend` spelling; `auto`: the first kernel in the `auto` order that can run the
        layer). Holds through this forward's backward, until the model's next forward or
        `disable()`."""
        self._arm(*_plan(doc_ids, backend))

    def _arm(self, backend: str, layout: Layout) -> None:
        self._state = _PackedState(backend, layout)

    def disable(self) -> None:
        """Disarm: hooked modules run stock SDPA."""
        self._state = None

    @property
    def backend(self) -> str | None:
        """The canonical kernel name armed, or None."""
        return None if self._state is None else self._state.backend

    def remove(self) -> None:
        """Detach every hook and disarm."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._state = None
        _LIVE.discard(self)

    def __reduce__(self):
        # A copy (copy.deepcopy(model), pickling) must not share this object's handles or pack: it
        # becomes a detached, unarmed hooks object, so the copied model runs stock SDPA until
        # attach_cp1_packed_varlen_hooks is called on it.
        return (_detached_hooks, ())

    # ---- hooks

    def _refuse_under_compile(self) -> None:
        if self._state is not None and torch.compiler.is_compiling():
            _REFUSE_UNDER_COMPILE()

    def _outer_forward(self, module, args) -> None:
        """Model forward: the pack armed for the previous forward (and its backward) is spent."""
        self._refuse_under_compile()
        state = self._state
        if state is not None:
            if state.outer_forwards >= 1:
                self._state = None
            else:
                state.outer_forwards += 1

    def _enter(self, module, args) -> None:
        self._refuse_under_compile()
        frames = self._frames.get(threading.get_ident())
        if frames is None:
            if self._state is None:
                return  # nothing armed: no mode, stock SDPA
            mode = _PackedSdpaMode(self)
            mode.__enter__()
            self._frames[threading.get_ident()] = frames = []
            frames.append(_Frame(module, mode))
        else:
            frames.append(_Frame(module, None))

    def _exit(self, module, args, output) -> None:
        tid = threading.get_ident()
        frames = self._frames.get(tid)
        if not frames or frames[-1].module is not module:
            return  # its pre-hook did not push a frame (unarmed, or an earlier pre-hook raised)
        frame = frames.pop()
        if frames:
            frames[-1].calls += frame.calls
        else:
            del self._frames[tid]
            frame.mode.__exit__(None, None, None)
        # Module._call_impl runs always_call hooks inside its `except`: skip the check when the forward raised.
        raised = sys.exc_info()[1] is not frame.handling
        if frame.calls == 0 and self._state is not None and not raised:
            raise RuntimeError(
                f"cp1 packed attention: {self._labels[id(module)]} ran its forward with a pack armed but made no "
                "scaled_dot_product_attention call, so its attention (eager, flash_attn, ...) was not made per "
                "document. Use attn_implementation='sdpa', or leave it out (modules= / module_filter=)"
            )

    def _sdpa(self, args, kwargs) -> torch.Tensor:
        """An SDPA call made inside a hooked forward (our mode is off the stack while this runs)."""
        self._refuse_under_compile()
        frames = self._frames.get(threading.get_ident())
        state = self._state
        if state is None or not frames:
            return _SDPA(*args, **kwargs)
        call = _SdpaCall(*args, **kwargs)
        frames[-1].calls += 1
        problem = _unsupported(call, state.seq_len)
        if problem is not None:
            raise ValueError(
                f"cp1 packed attention: {self._labels[id(frames[-1].module)]} called scaled_dot_product_attention "
                f"with {problem}. Otherwise leave this module out of the hooks (modules= / module_filter=) or disarm them"
            )
        return _packed_attention(state, call)


def _detached_hooks() -> Cp1PackedHooks:
    """What a copy of a hooks object becomes: hooks on no module, never armed (not in `_LIVE`)."""
    hooks = Cp1PackedHooks.__new__(Cp1PackedHooks)
    hooks.attention_modules, hooks._labels, hooks._state, hooks._frames, hooks._handles = [], {}, None, {}, []
    return hooks


# --------------------------------------------------------------------------- attaching and arming


def _is_attention_module(module: torch.nn.Module) -> bool:
    name = type(module).__name__.lower()
    return name.endswith("attention") or name.endswith("attn")


def _inner(module: torch.nn.Module) -> torch.nn.Module:
    """The module a checkpoint wrapper recomputes (hooks there fire again during backward)."""
    while (wrapped := checkpoint_wrapped_module(module)) is not None:
        module = wrapped
    return module


def attach_cp1_packed_varlen_hooks(
    model: torch.nn.Module,
    modules: Iterable[torch.nn.Module] | None = None,
    module_filter: Callable[[torch.nn.Module], bool] | None = None,
) -> Cp1PackedHooks:
    """Hook the attention modules of `model` (default: classes named `*Attention` / `*Attn`, or
    the given `modules`, or those passing `module_filter`), and `model`'s own forward, which
    clears a spent pack. Returns the hooks object, unarmed. Raises if no attention module is
    found or one is already hooked."""
    if modules is None:
        keep = module_filter or _is_attention_module
        modules = [m for m in model.modules() if keep(m) and checkpoint_wrapped_module(m) is None]
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
    hooked = {id(m) for hooks in _LIVE for m in hooks.attention_modules}
    taken = [type(m).__name__ for m in targets if id(m) in hooked]
    if taken:
        raise ValueError(
            f"attach_cp1_packed_varlen_hooks: {', '.join(taken)} already hooked by another Cp1PackedHooks; "
            "call its remove() first"
        )
    return Cp1PackedHooks(model, targets)


def _hooks_of(model: torch.nn.Module | None) -> list[Cp1PackedHooks]:
    """The live hooks objects, or those hooking a module of `model`."""
    live = list(_LIVE)
    if model is None:
        return live
    inside = {id(m) for m in model.modules()}
    return [hooks for hooks in live if any(id(m) in inside for m in hooks.attention_modules)]


def enable_cp1_packed_varlen(doc_ids: torch.Tensor, backend: str = "auto", model: torch.nn.Module | None = None) -> None:
    """`Cp1PackedHooks.enable` on every live hooks object, or only on those hooking `model`; each
    gets its own copy of the pack. Raises if there is none."""
    found = _hooks_of(model)
    if not found:
        where = "" if model is None else f" on {type(model).__name__}"
        raise ValueError(f"enable_cp1_packed_varlen: no cp1 hooks attached{where}; call attach_cp1_packed_varlen_hooks first")
    planned = _plan(doc_ids, backend)
    for hooks in found:
        hooks._arm(*planned)


def disable_cp1_packed_varlen(model: torch.nn.Module | None = None) -> None:
    """Disarm every live hooks object, or those hooking `model`: back to stock SDPA."""
    for hooks in _hooks_of(model):
        hooks.disable()


def cp1_packed_varlen_backend(model: torch.nn.Module | None = None) -> str | None:
    """The kernel armed on the hooks of `model` (on any live hooks when None); None when none is
    armed. Raises when hooks armed with different kernels are asked for together."""
    armed = {hooks.backend for hooks in _hooks_of(model)} - {None}
    if len(armed) > 1:
        raise ValueError(f"cp1_packed_varlen_backend: hooks armed with different kernels {sorted(armed)}; pass model=")
    return next(iter(armed), None)

"""Memory for long packs: a sequence-tiled MLP and host offload of checkpointed layer inputs.

With activation checkpointing, a long pack's memory is dominated by (a) every decoder layer's
input, kept for its recompute (tokens × hidden × layers), and (b) the intermediates of the one
MLP being recomputed and differentiated (tokens × intermediate × a few). Both helpers work on
any Transformers model, at any cp (the MLP and the layer input are per token, so the CP shard
changes nothing), under DDP and FSDP2:

- `enable_tiled_mlp(model, tile_tokens)`: every decoder layer's `mlp` runs over the sequence in
  tiles of `tile_tokens` rows, forward without keeping intermediates, backward recomputing one
  tile at a time. Cost: one more MLP forward per layer and step.
- `enable_checkpoint_offload(model)`: each checkpointed layer's input goes to pinned host memory
  on a side stream while the layer runs, and comes back (prefetched one layer ahead) for its
  recompute. Needs non-reentrant activation checkpointing, enabled first.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils.checkpoint import checkpoint

from ..compat.transformers import checkpoint_function, checkpointing_call, set_checkpoint_function


def _mlp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m.mlp for m in model.modules() if isinstance(getattr(m, "mlp", None), torch.nn.Module)]


class _TiledMLPFunction(torch.autograd.Function):
    """`forward_fn` over row tiles of `x [..., S, H]`; parameter gradients summed over tiles in fp32."""

    @staticmethod
    def forward(ctx, forward_fn, tile_tokens, name, x, *params):
        ctx.forward_fn, ctx.tile_tokens, ctx.params = forward_fn, tile_tokens, params
        ctx.autocast = (x.device.type, torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type))
        ctx.save_for_backward(x)
        outs = []
        for tile in x.split(tile_tokens, dim=-2):
            out = forward_fn(tile)
            if not isinstance(out, torch.Tensor) or out.shape != tile.shape:
                raise TypeError(f"enable_tiled_mlp: {name} returned {type(out).__name__} "
                                f"{tuple(getattr(out, 'shape', ()))}; expected a tensor of its input's shape "
                                f"{tuple(tile.shape)} (mixture-of-experts blocks with router outputs are not tiled)")
            outs.append(out)
        return torch.cat(outs, dim=-2)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.params if p.requires_grad]
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in params]
        grad_x = []
        device_type, enabled, dtype = ctx.autocast
        for tile, grad_tile in zip(x.split(ctx.tile_tokens, dim=-2), grad.split(ctx.tile_tokens, dim=-2)):
            tile = tile.detach().requires_grad_(x.requires_grad)
            with torch.enable_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
                out = ctx.forward_fn(tile)
            inputs = ([tile] if x.requires_grad else []) + params
            grads = torch.autograd.grad(out, inputs, grad_tile, allow_unused=True)
            if x.requires_grad:
                grad_x.append(grads[0])
                grads = grads[1:]
            for total, g in zip(sums, grads):
                if g is not None:
                    total += g
        by_param = {id(p): s.to(p.dtype) for p, s in zip(params, sums)}
        grad_params = [by_param.get(id(p)) for p in ctx.params]
        return (None, None, None, torch.cat(grad_x, dim=-2) if grad_x else None, *grad_params)


def _tiled_forward(module: torch.nn.Module, forward_fn, tile_tokens: int, name: str, x, *args, **kwargs):
    if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2 or x.shape[-2] <= tile_tokens:
        return forward_fn(x, *args, **kwargs)
    if not torch.is_grad_enabled():
        return torch.cat([forward_fn(tile) for tile in x.split(tile_tokens, dim=-2)], dim=-2)
    return _TiledMLPFunction.apply(forward_fn, tile_tokens, name, x, *module.parameters())


def enable_tiled_mlp(model: torch.nn.Module, tile_tokens: int = 8192) -> int:
    """Run every decoder layer's `mlp` over the sequence in tiles of `tile_tokens` rows (exact:
    the MLP is per token). Idempotent; returns the number of MLPs tiled."""
    if not isinstance(tile_tokens, int) or tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens!r} must be a positive int")
    mlps = _mlp_modules(model)
    if not mlps:
        raise ValueError(f"enable_tiled_mlp: {type(model).__name__} has no module with an `mlp` submodule")
    for mlp in mlps:
        stock = getattr(mlp, "_bdcp_stock_forward", mlp.forward)
        mlp._bdcp_stock_forward = stock
        name = f"{type(mlp).__name__}"
        mlp.forward = functools.partial(_tiled_forward, mlp, stock, tile_tokens, name)
    return len(mlps)


# --------------------------------------------------------------------------- checkpoint offload


class _OffloadedInput:
    """A checkpointed layer's input: on the device while the layer runs forward, then in pinned
    host memory, fetched back on a side stream one layer ahead of each recompute.

    The host copy lives as long as the checkpoint's graph (which alone holds this object): a second
    backward through the same graph (`retain_graph=True`) recomputes from it again, and the backward
    that frees the graph frees it."""

    def __init__(self, x: torch.Tensor, offload: "CheckpointOffload"):
        self.device, self.requires_grad, self.offload = x.device, x.requires_grad, offload
        self.live: torch.Tensor | None = x
        self.host: torch.Tensor | None = None
        self.fetched: tuple[torch.Tensor, object] | None = None
        self.copied = None  # event of the device-to-host copy
        stream = offload.stream(x.device)
        if stream is None:  # already in host memory: keep a private copy (the layer's input may be freed)
            self.host = x.detach().clone()
            return
        stream.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(stream):
            self.host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            self.host.copy_(x.detach(), non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record(stream)
        x.record_stream(stream)  # the allocator keeps x's memory until the copy is done

    def release(self) -> None:
        self.live = None

    def prefetch(self) -> None:
        stream = self.offload.stream(self.device)
        if stream is None or self.fetched is not None or self.host is None:
            return
        with torch.cuda.stream(stream):
            x = self.host.to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.fetched = (x, done)

    def get(self) -> torch.Tensor:
        if self.live is not None:  # the forward pass
            return self.live
        self.offload.prefetch_before(self)
        if self.offload.stream(self.device) is None:
            x = self.host
        else:
            self.prefetch()
            x, done = self.fetched
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            x.record_stream(current)
        self.fetched = None  # the device copy goes with this recompute; the host copy stays for another backward
        return x.detach().requires_grad_(self.requires_grad)


class CheckpointOffload:
    """The checkpoint function `enable_checkpoint_offload` installs on each checkpointed layer."""

    def __init__(self, checkpoint_kwargs: dict):
        self.checkpoint_kwargs = dict(checkpoint_kwargs)
        self.entries: list[weakref.ref] = []
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def prefetch_before(self, entry: _OffloadedInput) -> None:
        """Start fetching the input of the layer that runs before `entry`'s (the next recompute)."""
        self.entries = [r for r in self.entries if r() is not None]
        live = [r() for r in self.entries]
        index = next((i for i, e in enumerate(live) if e is entry), None)
        if index:
            live[index - 1].prefetch()

    @property
    def keywords(self) -> dict:
        """The checkpoint's keyword arguments (the Trainer's setup checks read `use_reentrant` here)."""
        return dict(self.checkpoint_kwargs)

    def __call__(self, function, *args):
        """`checkpoint(function, *args)` with the first tensor of `args` (the layer's input) offloaded.
        The first tensor, not the first argument: `compile_model`'s wrapper passes the layer's
        function ahead of it."""
        index = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        if index is None:
            return checkpoint(function, *args, **self.checkpoint_kwargs)
        hidden_states = args[index]
        entry = _OffloadedInput(hidden_states, self)
        self.entries.append(weakref.ref(entry))
        anchor = hidden_states.new_empty(0)  # lets checkpoint see the device (RNG state) without holding the input

        def run(e, _anchor, *rest):
            return function(*rest[:index], e.get(), *rest[index:])

        out = checkpoint(run, entry, anchor, *args[:index], *args[index + 1:], **self.checkpoint_kwargs)
        entry.release()
        return out


def offloaded_layers(model: torch.nn.Module) -> int:
    """How many of `model`'s layers offload their checkpointed input (`enable_checkpoint_offload`)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    functions = [checkpoint_function(m) for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    return sum(isinstance(getattr(f, "checkpoint_func", f), CheckpointOffload) for f in functions)


def check_offload_kept(model: torch.nn.Module, args) -> None:
    """Raise if `model` offloads checkpointed layer inputs and the TrainingArguments `args` turn activation
    checkpointing on: the Trainer enables it again when training starts, which puts the stock checkpoint
    back on every layer and drops the offload, silently."""
    field = "activation_checkpointing" if hasattr(args, "activation_checkpointing") else "gradient_checkpointing"
    if not getattr(args, field, False) or not offloaded_layers(model):
        return
    raise ValueError(
        f"the model offloads its checkpointed layer inputs (enable_checkpoint_offload) and {type(args).__name__}."
        f"{field} is True; expected False: the Trainer would enable checkpointing again when training starts and "
        f"drop the offload. Enable checkpointing on the model ({checkpointing_call()}), then the offload, and leave "
        f"{field} unset"
    )


def enable_checkpoint_offload(model: torch.nn.Module) -> int:
    """Offload each checkpointed layer's input to pinned host memory for its recompute(s).
    Call after enabling non-reentrant activation checkpointing (`model.activation_checkpointing_enable(
    activation_checkpointing_kwargs={"use_reentrant": False})`, before transformers 5.23
    `gradient_checkpointing_enable`). Idempotent; returns the number of layers offloaded."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing]
    if not layers:
        raise ValueError(f"enable_checkpoint_offload: no layer checkpoints; call {checkpointing_call()} first")
    offload = None
    for layer in layers:
        outer = checkpoint_function(layer)
        func = getattr(outer, "checkpoint_func", outer)  # compile_model's wrapper keeps the function it wraps
        if isinstance(func, CheckpointOffload):
            continue
        keywords = dict(getattr(func, "keywords", None) or {})
        if getattr(func, "func", None) is not checkpoint or keywords.get("use_reentrant", True) is not False:
            raise ValueError(f"enable_checkpoint_offload: {type(layer).__name__} checkpoints with {func!r}; expected "
                             "torch.utils.checkpoint.checkpoint with use_reentrant=False (Transformers' own "
                             "activation_checkpointing_enable(offload=True) wraps it: use that offload or this one)")
        offload = offload or CheckpointOffload(keywords)
        if outer is func:
            set_checkpoint_function(layer, offload)
        else:
            outer.checkpoint_func = offload
    return len(layers)

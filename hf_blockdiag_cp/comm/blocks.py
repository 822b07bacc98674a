"""Differentiable collectives over equal blocks: `all_to_all_blocks` (block i to rank i) and
`all_gather_blocks` (every rank's block to every rank).

An all-to-all with equal splits is its own adjoint, so its backward runs the same collective on
the gradient; an all-gather's adjoint is a reduce-scatter (sum). Buffers handed to a collective
are allocated contiguous explicitly: gloo writes contiguous bytes into whatever it is given, and
`all_gather`'s own backward keeps the strides of incoming gradients (docs/design.md). Every
collective runs through `failure.guarded` and holds its group weakly (`group.group_ref`); an
optional `ExchangeMeter` counts the bytes this rank receives, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .exchange import ExchangeMeter, all_gather_single
from .failure import guarded
from .group import group_ref, resolve_group


def _foreign_bytes(x: torch.Tensor) -> int:
    """Bytes of the blocks of `x [G, ...]` that come from the other ranks."""
    return (x.shape[0] - 1) * x[0].numel() * x.element_size()


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[G, ...] contiguous -> [G, ...]: block i goes to rank i; block i of the result came from rank i."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    guarded("all-to-all", group, dist.all_to_all_single, out, x, None, None, group)
    return out


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0; backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group, meter):
        ctx.group_ref = group_ref(group)  # weakly: a graph kept after a failure must not keep the group alive
        ctx.meter = meter
        out = _all_to_all(x.detach().contiguous(), group)
        if meter is not None:
            meter.forward_bytes += _foreign_bytes(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = _all_to_all(grad.contiguous(), resolve_group(ctx.group_ref))
        if ctx.meter is not None:
            ctx.meter.backward_bytes += _foreign_bytes(out)
        return out, None, None


def all_to_all_blocks(x: torch.Tensor, group, world_size: int, meter: ExchangeMeter | None = None) -> torch.Tensor:
    """Differentiable all-to-all of `x [G, ...]` (block i to rank i); identity when G = 1."""
    if x.shape[0] != world_size:
        raise ValueError(f"all_to_all_blocks: dim 0 of x must be the group size {world_size}; got shape {tuple(x.shape)}")
    if world_size == 1:
        return x
    return _AllToAll.apply(x, group, meter)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    guarded("reduce-scatter", group, fn, out, x, dist.ReduceOp.SUM, group)


class _AllGather(torch.autograd.Function):
    """All-gather of one block per rank into `[G, ...]`; backward: reduce-scatter (sum) of the gradient."""

    @staticmethod
    def forward(ctx, x, group, world_size, meter):
        ctx.group_ref, ctx.meter = group_ref(group), meter
        send = x.detach().contiguous()
        out = send.new_empty((world_size * send.shape[0],) + tuple(send.shape[1:]))  # blocks concatenated on dim 0
        guarded("all-gather", group, all_gather_single, out, send, group)
        out = out.view((world_size,) + tuple(send.shape))
        if meter is not None:
            meter.forward_bytes += _foreign_bytes(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[1:])
        _reduce_scatter(out, grad.view((-1,) + tuple(grad.shape[2:])), resolve_group(ctx.group_ref))
        if ctx.meter is not None:
            ctx.meter.backward_bytes += _foreign_bytes(grad)
        return out, None, None, None


def all_gather_blocks(x: torch.Tensor, group, world_size: int, meter: ExchangeMeter | None = None) -> torch.Tensor:
    """Differentiable all-gather: `x [n, ...]` of every rank as `[G, n, ...]` (block i from rank i); `x[None]` when G = 1."""
    if x.ndim == 0:
        raise ValueError("all_gather_blocks: x needs a leading dimension")
    if world_size == 1:
        return x[None]
    return _AllGather.apply(x, group, world_size, meter)


class _After(torch.autograd.Function):
    """`x` unchanged; in backward, zero gradients for `deps` too, so their own backward (a collective)
    runs on every rank and only after `x`'s has."""

    @staticmethod
    def forward(ctx, x, *deps):
        ctx.shapes = [(d.shape, d.dtype, d.device) for d in deps]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (grad,) + tuple(torch.zeros(s, dtype=t, device=d) for s, t, d in ctx.shapes)


def after(x: torch.Tensor, *deps: torch.Tensor) -> torch.Tensor:
    """`x`, made to depend on `deps` in autograd: the backward of every dep (e.g. an earlier collective
    of the same layer) runs after `x`'s, on every rank, whether or not this rank's result used it (I5)."""
    if not torch.is_grad_enabled() or not any(d.requires_grad for d in deps):
        return x
    return _After.apply(x, *deps)

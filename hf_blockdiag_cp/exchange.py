"""Differentiable K/V exchanges over the CP group.

K and V travel together in one collective per layer: each rank packs its rows as
`[L, Hkv*Dk + Hkv*Dv]` (so unequal head dims and un-repeated GQA heads cost nothing
extra), and the gathered result comes back in slot order, `[G*L, ...]`.

Every buffer handed to a collective is allocated contiguous here: gloo writes contiguous
bytes into receive buffers whatever their strides, which silently corrupts gradients when
a buffer inherits odd strides from an incoming gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _pack_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rows = k.shape[0]
    return torch.cat([k.reshape(rows, -1), v.reshape(rows, -1)], dim=1).contiguous()


def _unpack_rows(buf: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...]):
    rows = buf.shape[0]
    nk = k_shape[1] * k_shape[2]
    k = buf[:, :nk].view(rows, k_shape[1], k_shape[2])
    v = buf[:, nk:].view(rows, v_shape[1], v_shape[2])
    return k, v


class _AllGatherKV(torch.autograd.Function):
    """Forward: all-gather of packed K/V rows. Backward: reduce-scatter (sum) of their gradients."""

    @staticmethod
    def forward(ctx, k, v, group, world_size):
        ctx.group, ctx.world_size = group, world_size
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        send = _pack_rows(k, v)
        recv = send.new_empty((world_size * send.shape[0], send.shape[1]))
        _all_gather_single(recv, send, group=group)
        gk_shape = (recv.shape[0],) + ctx.k_shape[1:]
        gv_shape = (recv.shape[0],) + ctx.v_shape[1:]
        return _unpack_rows(recv, gk_shape, gv_shape)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        rows = ctx.k_shape[0] * ctx.world_size
        if grad_k is None:
            grad_k = torch.zeros((rows,) + ctx.k_shape[1:], dtype=grad_v.dtype, device=grad_v.device)
        if grad_v is None:
            grad_v = torch.zeros((rows,) + ctx.v_shape[1:], dtype=grad_k.dtype, device=grad_k.device)
        send = _pack_rows(grad_k, grad_v)
        recv = send.new_empty((ctx.k_shape[0], send.shape[1]))
        _reduce_scatter_single(recv, send, group=ctx.group)
        gk, gv = _unpack_rows(recv, ctx.k_shape, ctx.v_shape)
        return gk, gv, None, None


def allgather_kv(k: torch.Tensor, v: torch.Tensor, group, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather every rank's K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]` into `[G*L, Hkv, D]` in slot order."""
    if world_size == 1:
        return k, v
    return _AllGatherKV.apply(k, v, group, world_size)


EXCHANGES = {"allgather": allgather_kv}


def exchange_kv(name: str, k, v, group, world_size):
    """Run the named exchange; every rank of the group must call it with the same name (I5)."""
    try:
        fn = EXCHANGES[name]
    except KeyError:
        raise NotImplementedError(
            f"kv_exchange={name!r} is not implemented yet; available: {', '.join(EXCHANGES)}"
        ) from None
    return fn(k, v, group, world_size)

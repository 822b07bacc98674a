"""Differentiable K/V exchanges over the CP group: allgather, halo, a2a.

K and V travel together in one collective per layer: each rank packs its rows as
`[L, Hkv*Dk + Hkv*Dv]` (so unequal head dims and un-repeated GQA heads cost nothing
extra).

- `allgather` returns every rank's rows in slot order, `[G*L, ...]`; backward is a
  reduce-scatter (sum).
- `halo` / `a2a` return exactly the keys this rank needs (`RankRoutes`, planned in
  `exchange_plan`), in increasing pack position. Forward: own rows are copied, foreign rows
  travel by point-to-point from left neighbours (`halo`, `batch_isend_irecv`) or by one
  all-to-all-v (`a2a`, `all_to_all_single` with split sizes). Backward is the reverse
  exchange of the output gradients, accumulated into the local rows with `index_add_`
  (a row needed by several ranks gets every rank's contribution).

Every buffer handed to a collective is allocated contiguous here: gloo writes contiguous
bytes into receive buffers whatever their strides, which silently corrupts gradients when
a buffer inherits odd strides from an incoming gradient.

Failures: every collective runs through `failure.guarded` (see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..planning.exchange_plan import RankRoutes
from .failure import guarded


# --------------------------------------------------------------------------- collectives (looked up per call)


def all_gather_single(out, inp, group):
    # torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group)


def _reduce_scatter_single(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group)


def _a2a_transport(recv, recv_counts, send, send_counts, group) -> None:
    dist.all_to_all_single(recv, send, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group)


def _p2p_transport(recv, recv_counts, send, send_counts, group) -> None:
    """Point-to-point with the peers that have rows to exchange (both sides know the counts from the plan)."""
    ops = []
    offset = 0
    for peer, n in enumerate(recv_counts):
        if n:
            ops.append(dist.P2POp(dist.irecv, recv[offset : offset + n], group=group, group_peer=peer))
            offset += n
    offset = 0
    for peer, n in enumerate(send_counts):
        if n:
            ops.append(dist.P2POp(dist.isend, send[offset : offset + n], group=group, group_peer=peer))
            offset += n
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


_TRANSPORTS: dict[str, Callable] = {"halo": _p2p_transport, "a2a": _a2a_transport}


# --------------------------------------------------------------------------- accounting


@dataclass
class ExchangeMeter:
    """Bytes this rank received through K/V exchanges during one step (recompute included)."""

    forward_bytes: int = 0
    backward_bytes: int = 0
    calls: int = 0

    @property
    def total_bytes(self) -> int:
        return self.forward_bytes + self.backward_bytes


def _row_bytes(buf: torch.Tensor) -> int:
    return buf.shape[1] * buf.element_size()


# --------------------------------------------------------------------------- packing


def _pack_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    rows = k.shape[0]
    return torch.cat([k.reshape(rows, -1), v.reshape(rows, -1)], dim=1).contiguous()


def _unpack_rows(buf: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...]):
    rows = buf.shape[0]
    nk = k_shape[1] * k_shape[2]
    k = buf[:, :nk].view(rows, k_shape[1], k_shape[2])
    v = buf[:, nk:].view(rows, v_shape[1], v_shape[2])
    return k, v


def _grads_or_zeros(grad_k, grad_v, rows: int, k_shape, v_shape):
    like = grad_k if grad_k is not None else grad_v
    if grad_k is None:
        grad_k = torch.zeros((rows,) + tuple(k_shape[1:]), dtype=like.dtype, device=like.device)
    if grad_v is None:
        grad_v = torch.zeros((rows,) + tuple(v_shape[1:]), dtype=like.dtype, device=like.device)
    return grad_k, grad_v


# --------------------------------------------------------------------------- all-gather


class _AllGatherKV(torch.autograd.Function):
    """Forward: all-gather of packed K/V rows. Backward: reduce-scatter (sum) of their gradients."""

    @staticmethod
    def forward(ctx, k, v, group, world_size, meter):
        ctx.group, ctx.world_size, ctx.meter = group, world_size, meter
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        send = _pack_rows(k, v)
        recv = send.new_empty((world_size * send.shape[0], send.shape[1]))
        guarded("all-gather", group, all_gather_single, recv, send, group)
        if meter is not None:
            meter.forward_bytes += (world_size - 1) * send.shape[0] * _row_bytes(send)
            meter.calls += 1
        gk_shape = (recv.shape[0],) + ctx.k_shape[1:]
        gv_shape = (recv.shape[0],) + ctx.v_shape[1:]
        return _unpack_rows(recv, gk_shape, gv_shape)

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        rows = ctx.k_shape[0] * ctx.world_size
        grad_k, grad_v = _grads_or_zeros(grad_k, grad_v, rows, ctx.k_shape, ctx.v_shape)
        send = _pack_rows(grad_k, grad_v)
        recv = send.new_empty((ctx.k_shape[0], send.shape[1]))
        guarded("reduce-scatter", ctx.group, _reduce_scatter_single, recv, send, ctx.group)
        if ctx.meter is not None:
            ctx.meter.backward_bytes += (ctx.world_size - 1) * recv.shape[0] * _row_bytes(recv)
        gk, gv = _unpack_rows(recv, ctx.k_shape, ctx.v_shape)
        return gk, gv, None, None, None


def allgather_kv(k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
    """Gather every rank's K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]` into `[G*L, Hkv, D]` in slot order."""
    del routes
    if world_size == 1:
        return k, v
    return _AllGatherKV.apply(k, v, group, world_size, meter)


# --------------------------------------------------------------------------- needed-only (halo, a2a)


class _NeededKV(torch.autograd.Function):
    """Forward: the needed rows (own rows copied, foreign rows received). Backward: the reverse
    exchange of their gradients, accumulated into the local rows."""

    @staticmethod
    def forward(ctx, k, v, routes: RankRoutes, group, kind: str, meter):
        ctx.routes, ctx.group, ctx.kind, ctx.meter = routes, group, kind, meter
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        packed = _pack_rows(k, v)
        out = packed.new_empty((routes.num_keys, packed.shape[1]))
        out.index_copy_(0, routes.local_out, packed.index_select(0, routes.local_rows))
        if routes.any_traffic:
            send = packed.index_select(0, routes.send_rows).contiguous()
            recv = packed.new_empty((sum(routes.recv_counts), packed.shape[1]))
            guarded(f"{kind} exchange", group, _TRANSPORTS[kind], recv, routes.recv_counts, send, routes.send_counts, group)
            out.index_copy_(0, routes.recv_out, recv)
            if meter is not None:
                meter.forward_bytes += recv.shape[0] * _row_bytes(recv)
        if meter is not None:
            meter.calls += 1
        return _unpack_rows(out, (out.shape[0],) + ctx.k_shape[1:], (out.shape[0],) + ctx.v_shape[1:])

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        routes = ctx.routes
        grad_k, grad_v = _grads_or_zeros(grad_k, grad_v, routes.num_keys, ctx.k_shape, ctx.v_shape)
        g = _pack_rows(grad_k, grad_v)
        grad = g.new_zeros((ctx.k_shape[0], g.shape[1]))
        grad.index_add_(0, routes.local_rows, g.index_select(0, routes.local_out))
        if routes.any_traffic:
            send_back = g.index_select(0, routes.recv_out).contiguous()
            back = g.new_empty((sum(routes.send_counts), g.shape[1]))
            guarded(
                f"{ctx.kind} exchange backward", ctx.group, _TRANSPORTS[ctx.kind],
                back, routes.send_counts, send_back, routes.recv_counts, ctx.group,
            )
            grad.index_add_(0, routes.send_rows, back)
            if ctx.meter is not None:
                ctx.meter.backward_bytes += back.shape[0] * _row_bytes(back)
        gk, gv = _unpack_rows(grad, ctx.k_shape, ctx.v_shape)
        return gk, gv, None, None, None, None


def _needed_only(kind: str):
    def exchange(k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
        if routes is None:
            raise ValueError(f"kv_exchange={kind!r} needs the step's routes (CPStep.kv_routes); build the step with an exchange plan")
        if routes.cp_size != world_size:
            raise ValueError(f"kv_exchange={kind!r}: routes were planned for {routes.cp_size} ranks, the group has {world_size}")
        return _NeededKV.apply(k, v, routes, group, kind, meter)

    exchange.__name__ = f"{kind}_kv"
    exchange.__doc__ = f"The keys this rank needs, `[K, Hkv, D]` in pack order, by the {kind} transport."
    return exchange


halo_kv = _needed_only("halo")
a2a_kv = _needed_only("a2a")

EXCHANGES = {"allgather": allgather_kv, "halo": halo_kv, "a2a": a2a_kv}


def exchange_kv(name: str, k, v, group, world_size, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
    """Run the named exchange; every rank of the group must call it with the same name (I5)."""
    try:
        fn = EXCHANGES[name]
    except KeyError:
        raise ValueError(f"kv_exchange={name!r} is not an exchange; available: {', '.join(EXCHANGES)}") from None
    return fn(k, v, group, world_size, routes=routes, meter=meter)

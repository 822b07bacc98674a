"""What the K/V exchanges share (the exchanges themselves are records, one module each under
`comm/exchanges/`), and `exchange_kv`, which runs a registered exchange by name.

K and V travel together in one collective: each rank packs its rows as
`[L, Hkv*Dk + Hkv*Dv]` (so unequal head dims and un-repeated GQA heads cost nothing extra).

`routed_transport` is the differentiable transport of the exchanges that return exactly the
keys a rank needs (`RankRoutes`, planned in `planning.exchange_plan`), in increasing pack
position: own rows are copied, foreign rows travel by the exchange's collective; backward runs
the same collective in reverse on the output gradients and accumulates them into the local
rows (a row needed by several ranks gets every rank's contribution).

Every exchange is one autograd function: its collective runs (and is waited for) in forward,
the reverse one in backward. Every buffer handed to a collective is allocated contiguous here:
gloo writes contiguous bytes into receive buffers whatever their strides, which silently
corrupts gradients when a buffer inherits odd strides from an incoming gradient.

The functions hold their process group weakly (`group_ref`): autograd keeps a function's
context as long as the graph, and after an error a graph can outlive the step in a cycle
through C++ (a non-reentrant checkpoint's saved-tensor hooks), which would keep a destroyed
gloo group's sockets open and leave the peers of a failed rank waiting (I5). Every collective
runs through `failure.guarded` (see there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..planning.exchange_plan import RankRoutes
from ..planning.exchange_registry import get_exchange
from .failure import guarded

# collective(recv, recv_counts, send, send_counts, group): rows grouped by peer, counts per peer.
RoutedCollective = Callable[[torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...], Any], None]


def all_gather_single(out, inp, group, async_op: bool = False):
    # torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


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


def row_bytes(buf: torch.Tensor) -> int:
    return buf.shape[1] * buf.element_size()


# --------------------------------------------------------------------------- packing and groups


def pack_rows(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K `[n, Hkv, Dk]` and V `[n, Hkv, Dv]` as one contiguous `[n, Hkv*Dk + Hkv*Dv]` buffer."""
    rows = k.shape[0]
    return torch.cat([k.reshape(rows, -1), v.reshape(rows, -1)], dim=1).contiguous()


def unpack_rows(buf: torch.Tensor, k_shape: tuple[int, ...], v_shape: tuple[int, ...]):
    """K and V views of a packed buffer of any number of rows (`k_shape`, `v_shape` give the heads and dims)."""
    rows = buf.shape[0]
    nk = k_shape[1] * k_shape[2]
    return buf[:, :nk].view(rows, k_shape[1], k_shape[2]), buf[:, nk:].view(rows, v_shape[1], v_shape[2])


def grads_or_zeros(grad_k, grad_v, rows: int, k_shape, v_shape):
    """The output gradients of K and V, zeros for the one autograd passes as None."""
    like = grad_k if grad_k is not None else grad_v
    if grad_k is None:
        grad_k = torch.zeros((rows,) + tuple(k_shape[1:]), dtype=like.dtype, device=like.device)
    if grad_v is None:
        grad_v = torch.zeros((rows,) + tuple(v_shape[1:]), dtype=like.dtype, device=like.device)
    return grad_k, grad_v


def group_ref(group):
    """A weak reference to `group` for an autograd context (None: the default group)."""
    return None if group is None else weakref.ref(group)


def resolve_group(ref):
    """The group behind `group_ref`'s reference; raise if it was released meanwhile."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError("blockdiag_cp: the CP process group was released while a backward collective still needed it")
    return group


# --------------------------------------------------------------------------- needed rows along routes


class _Routed(torch.autograd.Function):
    """Forward: the needed rows (own rows copied, foreign rows received). Backward: the reverse
    collective of their gradients, accumulated into the local rows."""

    @staticmethod
    def forward(ctx, k, v, routes: RankRoutes, collective, what: str, ref, meter):
        ctx.routes, ctx.collective, ctx.what, ctx.group_ref, ctx.meter = routes, collective, what, ref, meter
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        packed = pack_rows(k, v)
        out = packed.new_empty((routes.num_keys, packed.shape[1]))
        out.index_copy_(0, routes.local_out, packed.index_select(0, routes.local_rows))
        if routes.any_traffic:
            send = packed.index_select(0, routes.send_rows).contiguous()
            recv = packed.new_empty((sum(routes.recv_counts), packed.shape[1]))
            group = resolve_group(ref)
            guarded(what, group, collective, recv, routes.recv_counts, send, routes.send_counts, group)
            out.index_copy_(0, routes.recv_out, recv)
            if meter is not None:
                meter.forward_bytes += recv.shape[0] * row_bytes(recv)
        if meter is not None:
            meter.calls += 1
        rows = out.shape[0]
        return unpack_rows(out, (rows,) + ctx.k_shape[1:], (rows,) + ctx.v_shape[1:])

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        routes = ctx.routes
        grad_k, grad_v = grads_or_zeros(grad_k, grad_v, routes.num_keys, ctx.k_shape, ctx.v_shape)
        g = pack_rows(grad_k, grad_v)
        grad = g.new_zeros((ctx.k_shape[0], g.shape[1]))
        grad.index_add_(0, routes.local_rows, g.index_select(0, routes.local_out))
        if routes.any_traffic:
            send_back = g.index_select(0, routes.recv_out).contiguous()
            back = g.new_empty((sum(routes.send_counts), g.shape[1]))
            group = resolve_group(ctx.group_ref)
            guarded(f"{ctx.what} backward", group, ctx.collective, back, routes.send_counts, send_back, routes.recv_counts, group)
            grad.index_add_(0, routes.send_rows, back)
            if ctx.meter is not None:
                ctx.meter.backward_bytes += back.shape[0] * row_bytes(back)
        gk, gv = unpack_rows(grad, ctx.k_shape, ctx.v_shape)
        return gk, gv, None, None, None, None, None


def routed_transport(name: str, collective: RoutedCollective):
    """The transport of exchange `name`, which moves the rows of its `RankRoutes` with
    `collective(recv, recv_counts, send, send_counts, group)` (and back in backward)."""

    def transport(k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
        if routes is None:
            raise ValueError(f"kv_exchange={name!r} needs the step's routes (CPStep.kv_routes); build the step with an exchange plan")
        if routes.cp_size != world_size:
            raise ValueError(f"kv_exchange={name!r}: routes were planned for {routes.cp_size} ranks, the group has {world_size}")
        return _Routed.apply(k, v, routes, collective, f"{name} exchange", group_ref(group), meter)

    transport.__name__ = f"{name}_transport"
    transport.__doc__ = f"The keys this rank needs, `[K, Hkv, D]` in pack order, by the {name} exchange."
    return transport


def exchange_kv(name: str, k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None):
    """Run the registered exchange `name` on K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]`: one row per
    entry of its plan's `row_positions`. Every rank of the group must call it alike (I5).
    K/V exchanges only: a head-parallel one moves q too and runs around the kernel (`attention.entry`)."""
    record = get_exchange(name)
    if record.head_parallel:
        raise ValueError(f"kv_exchange={name!r} is head-parallel: it moves q, k and v around the kernel, not K/V rows alone")
    return record.transport(k, v, group, world_size, routes, meter)

"""What the K/V exchanges share (the exchanges themselves are records, one module each under
`comm/exchanges/`), and `exchange_kv`, which runs a registered exchange by name.

K and V travel together in one collective: each rank packs its rows as
`[L, Hkv*Dk + Hkv*Dv]` (so unequal head dims and un-repeated GQA heads cost nothing extra).

`routed_exchange` builds the transport (and the overlap's `begin`) of the exchanges that return
exactly the keys a rank needs (`RankRoutes`, planned in `planning.exchange_plan`), in increasing
pack position: own rows are copied, foreign rows travel by the exchange's collective; backward
runs the same collective in reverse on the output gradients and accumulates them into the local
rows (a row needed by several ranks gets every rank's contribution).

Every exchange moves its rows through a `pending.PendingExchange` (see there): one autograd
function whose collective runs and is waited for in forward, the reverse in backward, or the
same started without waiting for overlap. Every buffer handed to a collective is allocated
contiguous. The functions hold their process group weakly (`group.group_ref`), and every
collective runs through `failure.guarded` (see there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..planning.exchange_plan import RankRoutes
from ..planning.exchange_registry import get_exchange
from .group import group_ref
from .pending import PendingExchange

# collective(recv, recv_counts, send, send_counts, group, async_op): rows grouped by peer, counts per peer;
# asynchronous, it returns its work(s) (`PendingExchange.launch`).
RoutedCollective = Callable[[torch.Tensor, tuple[int, ...], torch.Tensor, tuple[int, ...], Any, bool], Any]


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


# --------------------------------------------------------------------------- needed rows along routes


class PendingRouted(PendingExchange):
    """Forward: the needed rows (own rows copied, foreign rows received by the exchange's collective).
    Backward: the reverse collective of their gradients, accumulated into the local rows (a row
    needed by several ranks gets every rank's contribution)."""

    def __init__(self, name: str, collective: RoutedCollective, routes: RankRoutes, ref, world_size: int, meter):
        super().__init__(ref, world_size, meter)
        self.routes, self.collective = routes, collective
        self.what, self.what_backward = f"{name} exchange", f"{name} exchange backward"

    def start_forward(self, k, v) -> None:
        routes = self.routes
        packed = pack_rows(k, v)
        out = packed.new_empty((routes.num_keys, packed.shape[1]))
        out.index_copy_(0, routes.local_out, packed.index_select(0, routes.local_rows))
        if self.meter is not None:
            self.meter.calls += 1
        if not routes.any_traffic:
            self.keep((out, None))
            return
        send = packed.index_select(0, routes.send_rows).contiguous()
        recv = packed.new_empty((sum(routes.recv_counts), packed.shape[1]))
        self.launch(self.what, self.collective, recv, routes.recv_counts, send, routes.send_counts, state=(out, recv, send))
        if self.meter is not None:
            self.meter.forward_bytes += recv.shape[0] * row_bytes(recv)

    def finish_forward(self, state):
        out, recv = state[0], state[1]
        if recv is not None:
            out.index_copy_(0, self.routes.recv_out, recv)
        rows = out.shape[0]
        return unpack_rows(out, (rows,) + self.k_shape[1:], (rows,) + self.v_shape[1:])

    def start_backward(self, grad_k, grad_v) -> None:
        routes = self.routes
        g = pack_rows(*grads_or_zeros(grad_k, grad_v, routes.num_keys, self.k_shape, self.v_shape))
        grad = g.new_zeros((self.k_shape[0], g.shape[1]))
        grad.index_add_(0, routes.local_rows, g.index_select(0, routes.local_out))
        if not routes.any_traffic:
            self.keep((grad, None))
            return
        send_back = g.index_select(0, routes.recv_out).contiguous()
        back = g.new_empty((sum(routes.send_counts), g.shape[1]))
        self.launch(self.what_backward, self.collective, back, routes.send_counts, send_back, routes.recv_counts,
                    state=(grad, back, send_back))
        if self.meter is not None:
            self.meter.backward_bytes += back.shape[0] * row_bytes(back)

    def finish_backward(self, state):
        grad, back = state[0], state[1]
        if back is not None:
            grad.index_add_(0, self.routes.send_rows, back)
        return unpack_rows(grad, self.k_shape, self.v_shape)


def routed_exchange(name: str, collective: RoutedCollective):
    """The transport and the overlap's `begin` of exchange `name`, which moves the rows of its
    `RankRoutes` with `collective(recv, recv_counts, send, send_counts, group, async_op)` (and back in
    backward); an asynchronous call returns its work(s)."""

    def pending(group, world_size: int, routes: RankRoutes | None, meter) -> PendingRouted:
        if routes is None:
            raise ValueError(f"kv_exchange={name!r} needs the step's routes (CPStep.kv_routes); build the step with an exchange plan")
        if routes.cp_size != world_size:
            raise ValueError(f"kv_exchange={name!r}: routes were planned for {routes.cp_size} ranks, the group has {world_size}")
        return PendingRouted(name, collective, routes, group_ref(group), world_size, meter)

    def transport(k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
        return pending(group, world_size, routes, meter).run(k, v)

    def begin(k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
        return pending(group, world_size, routes, meter).begin(k, v)

    transport.__name__, begin.__name__ = f"{name}_transport", f"{name}_begin"
    transport.__doc__ = f"The keys this rank needs, `[K, Hkv, D]` in pack order, by the {name} exchange."
    begin.__doc__ = f"The {name} exchange started without waiting (overlap); `.wait(out)` collects it."
    return transport, begin


def exchange_kv(name: str, k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None):
    """Run the registered exchange `name` on K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]`: one row per
    entry of its plan's `row_positions`. Every rank of the group must call it alike (I5).
    K/V exchanges only: a head-parallel one moves q too and runs around the kernel (`attention.dispatch`)."""
    record = get_exchange(name)
    if record.head_parallel:
        raise ValueError(f"kv_exchange={name!r} is head-parallel: it moves q, k and v around the kernel, not K/V rows alone")
    return record.transport(k, v, group, world_size, routes, meter)

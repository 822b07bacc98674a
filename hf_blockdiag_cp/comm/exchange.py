"""Differentiable K/V exchanges over the CP group: allgather, halo, a2a, split in two halves so
that communication can run behind compute.

K and V travel together in one collective: each rank packs its rows as
`[L, Hkv*Dk + Hkv*Dv]` (so unequal head dims and un-repeated GQA heads cost nothing extra).

- `allgather` returns every rank's rows in slot order, `[G*L, ...]`; backward is a
  reduce-scatter (sum).
- `halo` / `a2a` return exactly the keys this rank needs (`RankRoutes`, planned in
  `exchange_plan`), in increasing pack position. Forward: own rows are copied, foreign rows
  travel by point-to-point from left neighbours (`halo`, `batch_isend_irecv`) or by one
  all-to-all-v (`a2a`, `all_to_all_single` with split sizes). Backward is the reverse
  exchange of the output gradients, accumulated into the local rows (a row needed by several
  ranks gets every rank's contribution).

Two autograd nodes per exchange, so that neither direction blocks the compute stream early:
`start_exchange` packs the rows and *launches* the collective (`async_op=True`: NCCL runs it
on its own stream); `finish_exchange` *waits* and returns K and V. In backward the order is
mirrored: the finish node launches the reverse collective and returns its buffer while it is
still in flight; the start node (which autograd reaches only after the kernels of later
chunks, `attention.entry`) waits for it. The in-flight buffer has exactly one consumer, the
start node, so nothing reads it before the wait. `exchange_kv` is both halves back to back.

Every buffer handed to a collective is allocated contiguous here: gloo writes contiguous
bytes into receive buffers whatever their strides, which silently corrupts gradients when a
buffer inherits odd strides from an incoming gradient.

Failures: every launch and every wait runs through `failure.guarded` (see there).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..planning.exchange_plan import EXCHANGE_KINDS, RankRoutes
from .failure import fail_group, group_failed, guarded


# --------------------------------------------------------------------------- collectives (looked up per call)


def all_gather_single(out, inp, group, async_op: bool = False):
    # torch >= 2.13 renamed the tensor collectives; older releases only have the old names.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter_single(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return [fn(out, inp, group=group, async_op=True)]


def _all_gather(out, inp, group):
    return [all_gather_single(out, inp, group, async_op=True)]


def _a2a_transport(recv, recv_counts, send, send_counts, group):
    return [dist.all_to_all_single(
        recv, send, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts), group=group, async_op=True
    )]


def _p2p_transport(recv, recv_counts, send, send_counts, group):
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
    return list(dist.batch_isend_irecv(ops)) if ops else []


_TRANSPORTS = {"halo": _p2p_transport, "a2a": _a2a_transport}


def _wait(what: str, group, works) -> None:
    def wait_all():
        for work in works:
            work.wait()  # NCCL: the current stream waits on the collective; the host does not block

    guarded(what, group, wait_all)


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


# --------------------------------------------------------------------------- the two halves


@dataclass(eq=False)
class _Flight:
    """One exchange between its start and its finish (and again between the two in backward).

    The flight holds its group weakly (`group_ref`): autograd keeps flights alive as long as the
    graph, and after an error a graph can outlive the step in a cycle through C++ (a non-reentrant
    checkpoint's saved-tensor hooks), which would keep a destroyed gloo group's sockets open and
    leave the peers of a failed rank waiting (I5). The caller's group and the step hold it strongly."""

    kind: str
    group_ref: Any  # weakref.ref to the process group, or None (the default group)
    world_size: int
    routes: RankRoutes | None
    meter: ExchangeMeter | None
    k_shape: tuple[int, ...] = ()
    v_shape: tuple[int, ...] = ()
    recv: torch.Tensor | None = None  # forward receive buffer, valid after the forward wait
    works: list = field(default_factory=list)  # collectives in flight (forward, then backward)
    back: torch.Tensor | None = None  # needed-only backward: rows other ranks sent back

    @property
    def group(self):
        if self.group_ref is None:
            return None
        group = self.group_ref()
        if group is None:
            raise RuntimeError("blockdiag_cp: the CP process group was released while one of its K/V exchanges was in flight")
        return group

    def out_rows(self, local_rows: int) -> int:
        return local_rows * self.world_size if self.kind == "allgather" else self.routes.num_keys


class _Start(torch.autograd.Function):
    """Forward: pack K/V rows and launch the collective. Backward: wait for the reverse
    collective that `_Finish.backward` launched and turn its rows into K/V gradients."""

    @staticmethod
    def forward(ctx, k, v, flight: _Flight):
        ctx.flight = flight
        flight.k_shape, flight.v_shape = tuple(k.shape), tuple(v.shape)
        packed = _pack_rows(k, v)
        if flight.kind == "allgather":
            flight.recv = packed.new_empty((flight.world_size * packed.shape[0], packed.shape[1]))
            # The collective gets an alias without autograd history: the Work keeps its tensors, and if
            # one were this Function's output, Work -> grad_fn -> ctx -> flight -> group would be a
            # cycle through C++ that Python's gc cannot see. gloo's worker thread could then drop the
            # last reference to its own group (its destructor joins that thread: the group's sockets
            # stay open and peers of a failed rank wait forever; tests/multiprocess/test_fault.py).
            flight.works = guarded("all-gather", flight.group, _all_gather, flight.recv, packed.detach(), flight.group)
            foreign = (flight.world_size - 1) * packed.shape[0]
        else:
            routes = flight.routes
            flight.works, foreign = [], 0
            if routes.any_traffic:
                send = packed.index_select(0, routes.send_rows).contiguous()
                flight.recv = packed.new_empty((sum(routes.recv_counts), packed.shape[1]))
                flight.works = guarded(
                    f"{flight.kind} exchange", flight.group, _TRANSPORTS[flight.kind],
                    flight.recv, routes.recv_counts, send, routes.send_counts, flight.group,
                )
                foreign = flight.recv.shape[0]
        if flight.meter is not None:
            flight.meter.forward_bytes += foreign * _row_bytes(packed)
            flight.meter.calls += 1
        return packed

    @staticmethod
    def backward(ctx, grad_packed):
        flight = ctx.flight
        try:
            _wait(f"{flight.kind} exchange backward", flight.group, flight.works)
        finally:
            flight.works = []
        if flight.back is not None:  # needed-only: add what other ranks computed for our rows
            grad_packed = grad_packed.index_add(0, flight.routes.send_rows, flight.back)
            flight.back = None
        gk, gv = _unpack_rows(grad_packed, flight.k_shape, flight.v_shape)
        return gk, gv, None


class _Finish(torch.autograd.Function):
    """Forward: wait for the collective and return K, V `[rows, Hkv, D]`. Backward: launch the
    reverse collective and return its (in-flight) buffer as the local rows' gradient."""

    @staticmethod
    def forward(ctx, packed, flight: _Flight):
        ctx.flight = flight
        try:
            _wait(f"{flight.kind} exchange", flight.group, flight.works)
        finally:
            flight.works = []  # a failed Work holds its tensors; the flight must not keep it
        if flight.kind == "allgather":
            out = flight.recv
        else:
            routes = flight.routes
            out = packed.new_empty((routes.num_keys, packed.shape[1]))
            out.index_copy_(0, routes.local_out, packed.index_select(0, routes.local_rows))
            if routes.any_traffic:
                out.index_copy_(0, routes.recv_out, flight.recv)
        flight.recv = None
        rows = out.shape[0]
        return _unpack_rows(out, (rows,) + flight.k_shape[1:], (rows,) + flight.v_shape[1:])

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        flight = ctx.flight
        local_rows = flight.k_shape[0]
        grad_k, grad_v = _grads_or_zeros(grad_k, grad_v, flight.out_rows(local_rows), flight.k_shape, flight.v_shape)
        g = _pack_rows(grad_k, grad_v)
        if flight.kind == "allgather":
            grad = g.new_empty((local_rows, g.shape[1]))
            flight.works = guarded("reduce-scatter", flight.group, _reduce_scatter_single, grad, g, flight.group)
            received = (flight.world_size - 1) * local_rows
        else:
            routes = flight.routes
            grad = g.new_zeros((local_rows, g.shape[1]))
            grad.index_add_(0, routes.local_rows, g.index_select(0, routes.local_out))
            received = 0
            if routes.any_traffic:
                send_back = g.index_select(0, routes.recv_out).contiguous()
                flight.back = g.new_empty((sum(routes.send_counts), g.shape[1]))
                flight.works = guarded(
                    f"{flight.kind} exchange backward", flight.group, _TRANSPORTS[flight.kind],
                    flight.back, routes.send_counts, send_back, routes.recv_counts, flight.group,
                )
                received = flight.back.shape[0]
        if flight.meter is not None:
            flight.meter.backward_bytes += received * _row_bytes(g)
        return grad, None


@dataclass(eq=False)
class InFlight:
    """A started exchange: pass it to `finish_exchange` (once) for K and V."""

    packed: torch.Tensor
    flight: _Flight

    def abandon(self, reason: str) -> None:
        """After an error between start and finish: mark the group failed (its ranks are out of
        lock step). If no collective failed (the error came from compute), first let the launched
        collective end: every live peer posted it, and a collective left pending keeps the group's
        connections open after it is destroyed, so peers would wait instead of failing."""
        works, self.flight.works = self.flight.works, []
        group = self.flight.group
        if group_failed(group):
            works = []  # a failed collective's peers are gone: waiting could block forever
        for work in works:
            try:
                work.wait()  # peers that got this far posted it too; a dead peer makes it raise
            except Exception:  # noqa: BLE001 - the error that made us abandon is the one to report
                pass
        fail_group(group, reason)


def _check(kind: str, world_size: int, routes: RankRoutes | None) -> None:
    if kind not in EXCHANGE_KINDS:
        raise ValueError(f"kv_exchange={kind!r} is not an exchange; available: {', '.join(EXCHANGE_KINDS)}")
    if kind != "allgather":
        if routes is None:
            raise ValueError(f"kv_exchange={kind!r} needs the step's routes (CPStep.kv_routes); build the step with an exchange plan")
        if routes.cp_size != world_size:
            raise ValueError(f"kv_exchange={kind!r}: routes were planned for {routes.cp_size} ranks, the group has {world_size}")


def start_exchange(
    name: str, k, v, group, world_size: int, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None
) -> InFlight:
    """Launch the named exchange of K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]`; every rank of the
    group must start the same exchanges in the same order (I5)."""
    _check(name, world_size, routes)
    group_ref = None if group is None else weakref.ref(group)
    flight = _Flight(name, group_ref, world_size, None if name == "allgather" else routes, meter)
    return InFlight(_Start.apply(k, v, flight), flight)


def finish_exchange(started: InFlight):
    """Wait for a started exchange: `allgather` gives `[G*L, Hkv, D]` in slot order, `halo` /
    `a2a` the needed keys `[K, Hkv, D]` in pack order."""
    return _Finish.apply(started.packed, started.flight)


def exchange_kv(name: str, k, v, group, world_size, routes: RankRoutes | None = None, meter: ExchangeMeter | None = None):
    """Run the named exchange at once (start and finish back to back); an all-gather over one rank returns K, V."""
    if world_size == 1 and name == "allgather":
        return k, v
    return finish_exchange(start_exchange(name, k, v, group, world_size, routes=routes, meter=meter))


EXCHANGES = EXCHANGE_KINDS

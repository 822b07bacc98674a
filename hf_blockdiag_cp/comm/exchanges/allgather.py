"""`allgather`: every rank receives every other rank's K/V rows, whatever it needs.

Forward: one all-gather of the packed rows, `[G*L, ...]` in slot order; backward: one
reduce-scatter (sum) of their gradients. No plan: it serves every layout and moves (G-1)·L
rows per rank each way; the best-tuned collective, so `auto` keeps it on ties.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...planning.exchange_plan import ExchangePlan, RankExchange
from ...planning.exchange_registry import ExchangeRecord, register_exchange
from ...planning.layout import Layout
from ...planning.rank_plan import plan_rank
from ..exchange import (
    ExchangeMeter, all_gather_single, grads_or_zeros, group_ref, pack_rows, resolve_group, row_bytes, unpack_rows,
)
from ..failure import guarded


def _reduce_scatter_single(out, inp, group, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class _AllGather(torch.autograd.Function):
    """Forward: all-gather of packed K/V rows. Backward: reduce-scatter (sum) of their gradients."""

    @staticmethod
    def forward(ctx, k, v, ref, world_size: int, meter):
        ctx.group_ref, ctx.world_size, ctx.meter = ref, world_size, meter
        ctx.k_shape, ctx.v_shape = tuple(k.shape), tuple(v.shape)
        send = pack_rows(k, v)
        recv = send.new_empty((world_size * send.shape[0], send.shape[1]))
        group = resolve_group(ref)
        guarded("all-gather", group, all_gather_single, recv, send, group)
        if meter is not None:
            meter.forward_bytes += (world_size - 1) * send.shape[0] * row_bytes(send)
            meter.calls += 1
        rows = recv.shape[0]
        return unpack_rows(recv, (rows,) + ctx.k_shape[1:], (rows,) + ctx.v_shape[1:])

    @staticmethod
    def backward(ctx, grad_k, grad_v):
        rows = ctx.k_shape[0] * ctx.world_size
        grad_k, grad_v = grads_or_zeros(grad_k, grad_v, rows, ctx.k_shape, ctx.v_shape)
        send = pack_rows(grad_k, grad_v)
        recv = send.new_empty((ctx.k_shape[0], send.shape[1]))
        group = resolve_group(ctx.group_ref)
        guarded("reduce-scatter", group, _reduce_scatter_single, recv, send, group)
        if ctx.meter is not None:
            ctx.meter.backward_bytes += (ctx.world_size - 1) * recv.shape[0] * row_bytes(recv)
        gk, gv = unpack_rows(recv, ctx.k_shape, ctx.v_shape)
        return gk, gv, None, None, None


class PendingGather:
    """An all-gather in flight (`allgather_begin`), and in backward the reduce-scatter of its gradients.

    Holds no tensor once a direction has been waited for, so an autograd graph that keeps it
    (activation checkpointing keeps a function's context) keeps no rows alive."""

    def __init__(self, ref, world_size: int, meter):
        self.group_ref, self.world_size, self.meter = ref, world_size, meter
        self.work = self.buffers = self.token = None

    def start(self, what: str, collective, recv, send) -> None:
        group = resolve_group(self.group_ref)
        self.work = guarded(what, group, collective, recv, send, group, True)
        self.buffers = (recv, send)  # both stay alive until the collective is waited for

    def finish(self, what: str) -> torch.Tensor:
        work, (recv, _) = self.work, self.buffers
        self.work = self.buffers = None
        guarded(f"{what} wait", resolve_group(self.group_ref), work.wait)
        return recv

    def wait(self, out: torch.Tensor):
        """(k_rows, v_rows, out): every rank's K/V rows, in slot order, once they arrived; `out` passes through."""
        token, self.token = self.token, None  # the graph holds the token from here on: no cycle through this object
        return _FinishGather.apply(token, out, self)


class _StartGather(torch.autograd.Function):
    """Forward: start the all-gather and return a token for `_FinishGather`. Backward: wait for the
    reduce-scatter that `_FinishGather`'s backward started, and return this rank's K/V gradients."""

    @staticmethod
    def forward(ctx, k, v, pending: PendingGather):
        ctx.pending, ctx.k_shape, ctx.v_shape = pending, tuple(k.shape), tuple(v.shape)
        pending.k_shape, pending.v_shape = ctx.k_shape, ctx.v_shape
        send = pack_rows(k, v)
        pending.start("all-gather", all_gather_single, send.new_empty((pending.world_size * send.shape[0], send.shape[1])), send)
        if pending.meter is not None:
            pending.meter.forward_bytes += (pending.world_size - 1) * send.shape[0] * row_bytes(send)
            pending.meter.calls += 1
        return k.new_zeros(())

    @staticmethod
    def backward(ctx, grad_token):
        del grad_token
        recv = ctx.pending.finish("reduce-scatter")
        gk, gv = unpack_rows(recv, ctx.k_shape, ctx.v_shape)
        return gk, gv, None


class _FinishGather(torch.autograd.Function):
    """Forward: wait for the all-gather; return the rows and `out` (the attention computed while it
    ran) unchanged. Backward: start the reduce-scatter of the rows' gradients and return `out`'s
    gradient at once, so `out`'s own backward runs while the reduce-scatter is in flight.

    `out` passes through this function so that its backward runs on every rank, even where no
    query reads the gathered rows (every rank must join the reduce-scatter, I5)."""

    @staticmethod
    def forward(ctx, token, out, pending: PendingGather):
        del token
        ctx.pending = pending
        recv = pending.finish("all-gather")
        rows = recv.shape[0]
        k_rows, v_rows = unpack_rows(recv, (rows,) + pending.k_shape[1:], (rows,) + pending.v_shape[1:])
        return k_rows, v_rows, out.view_as(out)

    @staticmethod
    def backward(ctx, grad_k, grad_v, grad_out):
        pending = ctx.pending
        if not ctx.needs_input_grad[0]:  # K and V need no gradient (on every rank alike): no reduce-scatter
            return None, grad_out, None
        rows = pending.k_shape[0] * pending.world_size
        grad_k, grad_v = grads_or_zeros(grad_k, grad_v, rows, pending.k_shape, pending.v_shape)
        send = pack_rows(grad_k, grad_v)
        pending.start("reduce-scatter", _reduce_scatter_single, send.new_empty((pending.k_shape[0], send.shape[1])), send)
        if pending.meter is not None:
            pending.meter.backward_bytes += (pending.world_size - 1) * pending.k_shape[0] * row_bytes(send)
        return None, grad_out, None


def allgather_begin(k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None) -> PendingGather:
    """Start the all-gather of K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]`; `.wait(out)` returns what
    `allgather_transport` returns, and `out`. Every rank of the group calls it alike (I5)."""
    del routes
    if world_size == 1:
        raise ValueError("allgather_begin needs a CP group of two or more ranks")
    pending = PendingGather(group_ref(group), world_size, meter)
    pending.token = _StartGather.apply(k, v, pending)
    return pending


def allgather_transport(k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None):
    """Every rank's K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]` as `[G*L, Hkv, D]` in slot order (one rank: k, v)."""
    del routes
    if world_size == 1:
        return k, v
    return _AllGather.apply(k, v, group_ref(group), world_size, meter)


def plan_all_rows(layout: Layout, plan: ExchangePlan | None, rank: int) -> RankExchange:
    """Rank `rank` attends over every slot of the layout, in slot order."""
    del plan
    return RankExchange(plan_rank(layout, rank), layout.slot_positions.reshape(-1))


def all_rows_per_layer(plan: ExchangePlan, rank: int) -> tuple[int, int]:
    """(G-1)·L rows each way, whatever the rank needs."""
    del rank
    rows = (plan.cp_size - 1) * plan.local_len
    return rows, rows


ALLGATHER = register_exchange(
    ExchangeRecord(
        name="allgather",
        aliases=("all_gather",),
        plan=plan_all_rows,
        rows_per_layer=all_rows_per_layer,
        transport=allgather_transport,
        needs_plan=False,
        auto_priority=0,  # ties go to the all-gather
        begin=allgather_begin,
    )
)

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


def _reduce_scatter_single(out, inp, group):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group)


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
    )
)

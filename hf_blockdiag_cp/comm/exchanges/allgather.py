"""`allgather`: every rank receives every other rank's K/V rows, whatever it needs.

Forward: one all-gather of the packed rows, `[G*L, ...]` in slot order; backward: one
reduce-scatter (sum) of their gradients. No plan: it serves every layout and moves (G-1)·L
rows per rank each way; the best-tuned collective, so `auto` keeps it on ties.
"""

from __future__ import annotations

import torch.distributed as dist

from ...planning.exchange_plan import ExchangePlan, RankExchange
from ...planning.exchange_registry import ExchangeRecord, register_exchange
from ...planning.layout import Layout
from ...planning.rank_plan import plan_rank
from ..exchange import ExchangeMeter, all_gather_single, grads_or_zeros, pack_rows, row_bytes, unpack_rows
from ..group import group_ref
from ..pending import PendingExchange


def _reduce_scatter_single(out, inp, group, async_op: bool = False):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, inp, group=group, async_op=async_op)


class PendingGather(PendingExchange):
    """Forward: all-gather of packed K/V rows. Backward: reduce-scatter (sum) of their gradients."""

    what, what_backward = "all-gather", "reduce-scatter"

    def start_forward(self, k, v) -> None:
        send = pack_rows(k, v)
        recv = send.new_empty((self.world_size * send.shape[0], send.shape[1]))
        self.launch(self.what, all_gather_single, recv, send, state=(recv, send))
        if self.meter is not None:
            self.meter.forward_bytes += (self.world_size - 1) * send.shape[0] * row_bytes(send)
            self.meter.calls += 1

    def finish_forward(self, state):
        recv, _ = state
        rows = recv.shape[0]
        return unpack_rows(recv, (rows,) + self.k_shape[1:], (rows,) + self.v_shape[1:])

    def start_backward(self, grad_k, grad_v) -> None:
        rows = self.k_shape[0] * self.world_size
        send = pack_rows(*grads_or_zeros(grad_k, grad_v, rows, self.k_shape, self.v_shape))
        recv = send.new_empty((self.k_shape[0], send.shape[1]))
        self.launch(self.what_backward, _reduce_scatter_single, recv, send, state=(recv, send))
        if self.meter is not None:
            self.meter.backward_bytes += (self.world_size - 1) * recv.shape[0] * row_bytes(recv)

    def finish_backward(self, state):
        recv, _ = state
        return unpack_rows(recv, self.k_shape, self.v_shape)


def allgather_begin(k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None) -> PendingGather:
    """Start the all-gather of K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]`; `.wait(out)` returns what
    `allgather_transport` returns, and `out`. Every rank of the group calls it alike (I5)."""
    del routes
    if world_size == 1:
        raise ValueError("allgather_begin needs a CP group of two or more ranks")
    return PendingGather(group_ref(group), world_size, meter).begin(k, v)


def allgather_transport(k, v, group, world_size: int, routes=None, meter: ExchangeMeter | None = None):
    """Every rank's K `[L, Hkv, Dk]` and V `[L, Hkv, Dv]` as `[G*L, Hkv, D]` in slot order (one rank: k, v)."""
    del routes
    if world_size == 1:
        return k, v
    return PendingGather(group_ref(group), world_size, meter).run(k, v)


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

"""`halo`: exactly the keys each rank needs, by point-to-point from its left neighbours
(`batch_isend_irecv`); backward sends their gradients back the same way.

A rank's left neighbours own the position just before each run of consecutive positions it
holds (rank r-1 for contiguous chunks). Halo serves a layout when every rank needs remote keys
from left neighbours only, i.e. (contiguous layouts) when no needed document spans more than
two ranks; otherwise an explicit `halo` hands over to `a2a`, which moves the same rows.
"""

from __future__ import annotations

import torch.distributed as dist

from ...planning.exchange_plan import ExchangePlan, needed_rows_per_layer, plan_needed_rows
from ...planning.exchange_registry import ExchangeRecord, register_exchange
from ..exchange import routed_exchange


def point_to_point(recv, recv_counts, send, send_counts, group, async_op: bool = False):
    """Point-to-point with the peers that have rows to exchange (both sides know the counts from the
    plan); asynchronous, it returns the works instead of waiting for them."""
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
    works = dist.batch_isend_irecv(ops) if ops else []
    if async_op:
        return works
    for work in works:
        work.wait()
    return None


HALO_TRANSPORT, HALO_BEGIN = routed_exchange("halo", point_to_point)


def left_neighbours(plan: ExchangePlan) -> list[set[int]]:
    """Per rank, the other ranks that own the position just before one of its held runs."""
    # Held runs are maximal, so the position before a run's start ends a run of its owner.
    owner_of_stop = {stop: src for src in range(plan.cp_size) for stop in plan.held[src][:, 1].tolist()}
    return [
        {owner_of_stop[start] for start in plan.held[r][:, 0].tolist() if start > 0} - {r} for r in range(plan.cp_size)
    ]


def beyond_left_neighbours(plan: ExchangePlan) -> str | None:
    """Why halo cannot serve the plan's layout (some rank needs keys beyond its left neighbours), or None."""
    left = left_neighbours(plan)
    for dst in range(plan.cp_size):
        senders = {src for src in range(plan.cp_size) if src != dst and int(plan.traffic[src, dst]) > 0}
        far = sorted(senders - left[dst])
        if far:
            return f"rank {dst} needs keys from ranks {far}, which are not its left neighbours"
    return None


HALO = register_exchange(
    ExchangeRecord(
        name="halo",
        aliases=("left_halo",),
        plan=plan_needed_rows,
        rows_per_layer=needed_rows_per_layer,
        transport=HALO_TRANSPORT,
        begin=HALO_BEGIN,
        unsupported_reason=beyond_left_neighbours,
        fallback="a2a",
        needs_single_node=True,
        auto_priority=10,
    )
)

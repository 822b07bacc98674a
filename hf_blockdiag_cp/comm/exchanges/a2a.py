"""`a2a`: exactly the keys each rank needs, by one all-to-all-v (`all_to_all_single` with split
sizes); backward is the reverse all-to-all-v of their gradients. Serves every layout."""

from __future__ import annotations

import torch.distributed as dist

from ...planning.exchange_plan import needed_rows_per_layer, plan_needed_rows
from ...planning.exchange_registry import ExchangeRecord, register_exchange
from ..exchange import routed_exchange


def all_to_all_v(recv, recv_counts, send, send_counts, group, async_op: bool = False):
    return dist.all_to_all_single(recv, send, output_split_sizes=list(recv_counts), input_split_sizes=list(send_counts),
                                  group=group, async_op=async_op)


A2A_TRANSPORT, A2A_BEGIN = routed_exchange("a2a", all_to_all_v)


A2A = register_exchange(
    ExchangeRecord(
        name="a2a",
        aliases=("alltoall", "all_to_all", "all_to_all_v", "alltoallv"),
        plan=plan_needed_rows,
        rows_per_layer=needed_rows_per_layer,
        transport=A2A_TRANSPORT,
        begin=A2A_BEGIN,
        needs_single_node=True,
        auto_priority=20,
    )
)

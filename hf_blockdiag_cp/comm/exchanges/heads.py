"""`heads`: head-parallel softmax attention (Ulysses-style), the transport the gated delta-rule
token mixers of hybrid models use (`comm.head_shards`), as an exchange record.

Forward: each rank sends head group j of its L rows (q, and k, v repeated where fewer kv heads
than ranks need it: `planning.head_parallel`) to rank j by one all-to-all and puts the received
rows in pack order; the local kernel runs over the whole pack for H/G query heads with the
pack's document boundaries, as a cp = 1 step would; a second all-to-all returns the outputs of
this rank's rows, all heads. Backward: the same two all-to-alls, reversed. Every rank moves
(G-1)·L rows each way whatever its rows hold; the kernel's work is the whole pack's for H/G
heads on every rank, so attention is balanced whatever the layout. Needs H divisible by G.
"""

from __future__ import annotations

import torch

from ...planning.exchange_registry import ExchangeRecord, register_exchange
from ...planning.head_parallel import (
    HeadRoutes,
    head_parallel_row_bytes,
    head_parallel_rows_per_layer,
    head_split_reason,
    kv_head_repeats,
    plan_head_parallel,
)
from ..exchange import ExchangeMeter
from ..head_shards import heads_to_seq, seq_to_heads


def heads_transport(q, k, v, attend, group, world_size: int, routes: HeadRoutes | None = None, meter: ExchangeMeter | None = None):
    """q `[L, H, Dk]`, k `[L, Hkv, Dk]`, v `[L, Hkv, Dv]` -> `[L, H, Dv]`: this rank's rows of
    `attend(q, k, v, heads)` run by every rank over the whole pack (pack order) for its head group."""
    if routes is None or routes.cp_size != world_size:
        raise ValueError(f"kv_exchange='heads' needs the step's routes for {world_size} ranks (CPStep.kv_routes); got {routes}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"kv_exchange='heads' sends q, k and v together; their dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    rows, heads, dim_k = q.shape
    kv_heads, dim_v = k.shape[1], v.shape[2]
    repeats = kv_head_repeats(heads, kv_heads, world_size)
    if repeats > 1:
        k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
    q_group, kv_group = heads // world_size, k.shape[1] // world_size
    send = torch.cat([t.reshape(rows, world_size, -1) for t in (q, k, v)], dim=-1)
    pack = seq_to_heads(send, group, world_size, routes.to_pack, meter)
    total = pack.shape[0]
    qh, kh, vh = pack.split([q_group * dim_k, kv_group * dim_k, kv_group * dim_v], dim=-1)
    mine = slice(routes.rank * q_group, (routes.rank + 1) * q_group)
    out = attend(qh.reshape(total, q_group, dim_k), kh.reshape(total, kv_group, dim_k), vh.reshape(total, kv_group, dim_v), mine)
    back = heads_to_seq(out.reshape(total, q_group * dim_v), group, world_size, routes.to_slots, meter)
    if meter is not None:
        meter.calls += 1
    return back.reshape(rows, heads, dim_v)


HEADS = register_exchange(
    ExchangeRecord(
        name="heads",
        aliases=("ulysses", "head_parallel"),
        plan=plan_head_parallel,
        rows_per_layer=head_parallel_rows_per_layer,
        transport=heads_transport,
        needs_plan=False,
        head_parallel=True,
        unsupported_heads=head_split_reason,
        row_bytes=head_parallel_row_bytes,
        auto_priority=None,  # `auto` chooses per step, before any layer's heads are known (docs/kernels.md)
    )
)

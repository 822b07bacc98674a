"""Head-parallel softmax attention (Ulysses-style), the pure part: which heads go where, the plan
the kernel runs with, the slot <-> pack maps, and the bytes per layer.

A head-parallel exchange moves the queries too: every rank sends head group j of its L rows to
rank j (one all-to-all), so that each rank holds the whole pack for H/G query heads; the kernel
then runs over the whole pack in pack order, with the pack's document boundaries, exactly as a
cp = 1 step sees it (`pack_as_one_rank`); a second all-to-all returns `[L rows, all heads]`.

GQA: query head h reads kv head h // (H / Hkv). When G divides Hkv, rank j gets kv heads
[j·Hkv/G, (j+1)·Hkv/G). Otherwise (fewer kv heads than ranks, or any G that does not divide Hkv)
each kv head is sent `kv_head_repeats` = E / Hkv times, E = lcm(Hkv, G): rank j gets E/G of the
repeated heads, and its H/G query heads read them as H/E-sized groups, the mapping of the full
layer (H is a multiple of both Hkv and G, hence of E). Needs H divisible by G.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .exchange_plan import AttentionShape, ExchangePlan, RankExchange
from .layout import Layout
from .rank_plan import plan_rank


def head_split_reason(heads: int, kv_heads: int, cp_size: int) -> str | None:
    """Why `heads` query and `kv_heads` kv heads cannot be split over `cp_size` ranks, or None."""
    if heads % kv_heads:
        return f"{heads} query heads are not a multiple of {kv_heads} kv heads"
    if heads % cp_size:
        return f"head-parallel attention needs the query heads ({heads}) divisible by the CP size G={cp_size}"
    return None


def kv_head_repeats(heads: int, kv_heads: int, cp_size: int) -> int:
    """How many copies of each kv head travel: lcm(Hkv, G) / Hkv (1 when G divides Hkv)."""
    reason = head_split_reason(heads, kv_heads, cp_size)
    if reason is not None:
        raise ValueError(reason)
    return math.lcm(kv_heads, cp_size) // kv_heads


def pack_as_one_rank(layout: Layout) -> Layout:
    """The same padded pack held by one rank (cp = 1): what the kernel of a head-parallel step sees."""
    rows = torch.arange(layout.padded_seq_len).view(1, -1)
    return Layout("contiguous", 1, layout.original_seq_len, layout.padded_seq_len, rows, layout.document_ids, layout.segments)


@dataclass(frozen=True)
class HeadRoutes:
    """What one rank's head-parallel transport runs with: its head group (`rank`), and the maps
    between the all-to-all's slot order (rank-major) and pack order, None when they are equal
    (contiguous layouts): `to_pack[p]` is the slot of pack position p (`Layout.slot_of_position`),
    `to_slots[s]` the pack position of slot s (`Layout.slot_positions`, flattened)."""

    rank: int
    cp_size: int
    to_pack: torch.Tensor | None
    to_slots: torch.Tensor | None

    def to(self, device: torch.device) -> "HeadRoutes":
        def move(t):
            return None if t is None else t.to(device, non_blocking=True)

        return HeadRoutes(self.rank, self.cp_size, move(self.to_pack), move(self.to_slots))


def plan_head_parallel(layout: Layout, plan: ExchangePlan | None, rank: int) -> RankExchange:
    """The plan of the whole pack as one rank (queries and keys: every position, in pack order) and
    `rank`'s routes. Every rank attends over every position, for its own heads."""
    del plan
    single = pack_as_one_rank(layout)
    slots = layout.slot_positions.reshape(-1)
    positions = single.slot_positions.reshape(-1)
    in_order = torch.equal(slots, positions)
    routes = HeadRoutes(rank, layout.cp_size, None if in_order else layout.slot_of_position, None if in_order else slots)
    return RankExchange(plan_rank(single, 0), positions, routes)


def head_parallel_rows_per_layer(plan: ExchangePlan, rank: int) -> tuple[int, int]:
    """(forward, backward) pack rows `rank` receives from the other ranks per layer, each way:
    (G-1)·L rows of its head group in, (G-1)·L rows of its own tokens' outputs back (backward:
    their gradients, the same counts). A row's bytes: `head_parallel_row_bytes`."""
    del rank
    rows = (plan.cp_size - 1) * plan.local_len
    return rows, rows


def head_parallel_row_bytes(shape: AttentionShape, cp_size: int) -> int:
    """Bytes per received row, both all-to-alls together: the q, k, v of one head group
    (H/G·Dk + E/G·(Dk+Dv)) and one head group's output (H/G·Dv), E the kv heads sent."""
    sent_kv = shape.kv_heads * kv_head_repeats(shape.heads, shape.kv_heads, cp_size)
    return (shape.heads + sent_kv) // cp_size * (shape.head_dim_k + shape.head_dim_v) * shape.bytes_per_element

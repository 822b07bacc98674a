"""K/V exchange planning over a `Layout`: which keys every rank needs, who holds them, and the
routes of the exchanges that move exactly those rows. Pure (no torch.distributed).

Needed keys. A real query needs the keys of its own document from the document's start (or
from `q - W + 1` under a sliding window of W) up to itself. A padding query only sees the
padding rows of its own run that its rank holds: padding never carries a label, so what
padding rows attend to cannot reach a loss, and fetching remote padding would be pure
waste. Every rank's needed keys are a few disjoint position intervals (`[start, stop)`),
computed from maximal *pieces* of its rows: consecutive pack positions of one segment.

The exchanges themselves are records (`planning.exchange_registry`); each one's `plan` returns
a `RankExchange` for a rank. What they share lives here: `plan_exchange` (needed keys and the
traffic matrix of a layout) and `plan_needed_rows` / `needed_rows_per_layer` for the exchanges
that return exactly the needed keys (halo, a2a). Row counts are what one rank *receives* per
attention layer: forward K/V rows, backward gradients of the rows it sent (reverse exchange).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout
from .rank_plan import RankPlan, offsets, plan_rank
from .segments import expand, intersect, interval_size, ranges, run_bounds


# --------------------------------------------------------------------------- intervals


def needed_intervals(layout: Layout, rank: int, sliding_window: int | None = None) -> torch.Tensor:
    """`[n, 2]` sorted disjoint `[start, stop)` pack-position intervals of the keys `rank` needs."""
    if sliding_window is not None and (isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be a positive int or None; got {sliding_window!r}")
    pos = layout.slot_positions[rank]
    seg = layout.segments
    first, last = layout.query_runs(rank)
    a, b = pos[first], pos[last]
    lo = seg.segment_starts[a]
    if sliding_window is not None:
        lo = torch.maximum(lo, a - sliding_window + 1)
    lo = torch.where(layout.document_ids[a] == 0, a, lo)  # padding: own rows only
    stop = b + 1
    # `lo` never decreases along pieces (segments are contiguous in the pack), so merging
    # overlapping or touching intervals is one pass.
    merge_new = torch.ones_like(lo, dtype=torch.bool)
    merge_new[1:] = lo[1:] > stop[:-1]
    g_first, g_last = run_bounds(merge_new)
    return torch.stack([lo[g_first], stop[g_last]], dim=1)


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ExchangeBytes:
    """Bytes one rank receives in one attention layer: K/V rows forward, their gradients backward."""

    forward: int
    backward: int

    @property
    def total(self) -> int:
        return self.forward + self.backward


@dataclass(frozen=True)
class ExchangePlan:
    """Who needs which keys and who sends how many rows to whom, for one layout (and window).

    `traffic[src, dst]` is the number of K/V rows rank `src` sends to rank `dst` when every
    rank receives exactly its needed keys (zero on the diagonal: own rows never travel).
    """

    cp_size: int
    local_len: int
    sliding_window: int | None
    needed: tuple[torch.Tensor, ...]  # per rank, [n, 2] intervals of needed key positions
    held: tuple[torch.Tensor, ...]  # per rank, [m, 2] intervals of held positions
    traffic: torch.Tensor  # [G, G] int64 rows, src x dst

    def num_keys(self, rank: int) -> int:
        """Rows the needed-only exchanges return to `rank` (its own rows included)."""
        return interval_size(self.needed[rank])

    def recv_rows(self, rank: int) -> int:
        return int(self.traffic[:, rank].sum())

    def send_rows(self, rank: int) -> int:
        return int(self.traffic[rank, :].sum())

    @property
    def total_traffic(self) -> int:
        return int(self.traffic.sum())


def kv_row_bytes(kv_heads: int, head_dim_k: int, head_dim_v: int, bytes_per_element: int) -> int:
    """Bytes of one exchanged row: K and V of one token, all kv heads."""
    return kv_heads * (head_dim_k + head_dim_v) * bytes_per_element


@dataclass(frozen=True)
class AttentionShape:
    """The heads of one attention layer, for the bytes of exchanges whose rows carry more than
    K/V (a head-parallel exchange also moves the queries and the outputs)."""

    heads: int
    kv_heads: int
    head_dim_k: int
    head_dim_v: int
    bytes_per_element: int

    @property
    def kv_row_bytes(self) -> int:
        return kv_row_bytes(self.kv_heads, self.head_dim_k, self.head_dim_v, self.bytes_per_element)


def plan_exchange(layout: Layout, sliding_window: int | None = None) -> ExchangePlan:
    """The needed keys and traffic of `layout` (keys clipped to `sliding_window` when given)."""
    g = layout.cp_size
    needed = tuple(needed_intervals(layout, r, sliding_window) for r in range(g))
    held = tuple(layout.held_intervals(r) for r in range(g))
    traffic = torch.zeros(g, g, dtype=torch.long)
    for dst in range(g):
        for src in range(g):
            if src != dst:
                traffic[src, dst] = interval_size(intersect(needed[dst], held[src]))
    return ExchangePlan(g, layout.local_len, sliding_window, needed, held, traffic)


@dataclass(frozen=True)
class RankExchange:
    """What one rank's step takes from its exchange, planned once per step on the host.

    The exchange returns one K/V row per entry of `row_positions` (pack positions, in that
    order); `rank_plan`'s `key_rows` index those rows (kernels with `takes_all_rows` get them
    all). `routes` is whatever the exchange's transport needs on this rank (None, or an object
    with `.to(device)`, e.g. `RankRoutes`).
    """

    rank_plan: RankPlan
    row_positions: torch.Tensor  # [R] int64
    routes: object = None


# --------------------------------------------------------------------------- one rank's routes


@dataclass(frozen=True)
class RankRoutes:
    """Index tables one rank's needed-only exchange runs with (built once per step).

    The exchange returns `num_keys` rows, the needed keys in increasing pack position (the
    key order of `needed_rank_plan`). Own rows are copied (`local_rows` -> `local_out`);
    rows sent to rank d are `send_rows[sum(send_counts[:d]) : ...]` (local row indices, in
    position order); rows received from rank s arrive grouped by s in position order and
    land at `recv_out`.
    """

    rank: int
    cp_size: int
    num_keys: int
    key_positions: torch.Tensor  # [K]
    local_rows: torch.Tensor  # [n_local] int64 local row indices
    local_out: torch.Tensor  # [n_local] int64 output rows
    send_rows: torch.Tensor  # [n_send] int64 local row indices, grouped by destination
    send_counts: tuple[int, ...]  # [G]
    recv_counts: tuple[int, ...]  # [G]
    recv_out: torch.Tensor  # [n_recv] int64 output rows, in arrival order
    any_traffic: bool  # whether any rank of the group sends anything (same on every rank)

    def to(self, device: torch.device) -> "RankRoutes":
        def move(t):
            return t.to(device, non_blocking=True)

        return RankRoutes(
            self.rank, self.cp_size, self.num_keys, move(self.key_positions), move(self.local_rows), move(self.local_out),
            move(self.send_rows), self.send_counts, self.recv_counts, move(self.recv_out), self.any_traffic,
        )


def rank_routes(layout: Layout, plan: ExchangePlan, rank: int) -> RankRoutes:
    """Send / receive / copy tables of `rank` for the needed-only exchanges of `plan`."""
    g, local_len = plan.cp_size, plan.local_len
    slot = layout.slot_of_position
    key_pos = expand(plan.needed[rank])
    key_slot = slot[key_pos]
    owner = key_slot // local_len
    own = owner == rank
    local_out = torch.nonzero(own).reshape(-1)
    remote = torch.nonzero(~own).reshape(-1)
    recv_out = remote[torch.argsort(owner[remote], stable=True)]  # by source rank, then position
    send_parts = []
    for dst in range(g):
        if dst != rank:
            send_parts.append(slot[expand(intersect(plan.needed[dst], plan.held[rank]))] % local_len)
    send_rows = torch.cat(send_parts) if send_parts else torch.zeros(0, dtype=torch.long)
    return RankRoutes(
        rank=rank,
        cp_size=g,
        num_keys=key_pos.numel(),
        key_positions=key_pos,
        local_rows=key_slot[local_out] % local_len,
        local_out=local_out,
        send_rows=send_rows,
        send_counts=tuple(int(x) for x in plan.traffic[rank].tolist()),
        recv_counts=tuple(int(x) for x in plan.traffic[:, rank].tolist()),
        recv_out=recv_out,
        any_traffic=plan.total_traffic > 0,
    )


def needed_rank_plan(layout: Layout, plan: ExchangePlan, rank: int) -> RankPlan:
    """`plan_rank` over the rows the halo / a2a exchange returns (the needed keys, once each, in
    pack order): the same query runs, and per run the needed keys of its segment up to its
    last query (from `q - W + 1` of its first query under the plan's window). `key_rows`
    indexes the exchange's rows, `(0, K)` when the runs use each row once in order.

    For real queries without a window every run's keys equal `plan_rank`'s; a padding run
    sees only the padding rows of its segment that this rank holds.
    """
    base = plan_rank(layout, rank)
    seg = layout.segments
    rows = expand(plan.needed[rank])  # the exchange's output rows, by position
    cu_q = base.cu_seqlens_q.long()
    first_q, last_q = base.q_positions[cu_q[:-1]], base.q_positions[cu_q[1:] - 1]
    begin = seg.segment_starts[first_q]
    if plan.sliding_window is not None:
        real = layout.document_ids[first_q] > 0
        begin = torch.where(real, torch.maximum(begin, first_q - plan.sliding_window + 1), begin)
    lo = torch.searchsorted(rows, begin)
    hi = torch.searchsorted(rows, last_q, right=True)
    k_lens = hi - lo
    index = ranges(lo, k_lens)
    if bool((torch.bincount(index, minlength=rows.numel()) == 0).any()):
        raise AssertionError(f"rank {rank}: the exchange plan fetches keys that no local query run uses")
    identity = index.numel() == rows.numel() and bool((index == torch.arange(rows.numel())).all())
    k_pos = rows[index]
    return RankPlan(
        rank=rank,
        q_positions=base.q_positions,
        q_segments=base.q_segments,
        key_rows=(0, rows.numel()) if identity else index,
        k_positions=k_pos,
        k_segments=seg.segment_ids[k_pos],
        cu_seqlens_q=base.cu_seqlens_q,
        cu_seqlens_k=offsets(k_lens),
        max_seqlen_q=base.max_seqlen_q,
        max_seqlen_k=int(k_lens.max()),
    )


# --------------------------------------------------------------------------- needed rows only


def plan_needed_rows(layout: Layout, plan: ExchangePlan, rank: int) -> RankExchange:
    """The plan of an exchange that returns exactly `rank`'s needed keys, once each, in pack order
    (own rows copied, the rest received along `RankRoutes`)."""
    routes = rank_routes(layout, plan, rank)
    return RankExchange(needed_rank_plan(layout, plan, rank), routes.key_positions, routes)


def needed_rows_per_layer(plan: ExchangePlan, rank: int) -> tuple[int, int]:
    """(forward, backward) rows `rank` receives per layer when every rank receives exactly its needed
    keys: its needed foreign rows, then the gradients of the rows it sent."""
    return plan.recv_rows(rank), plan.send_rows(rank)

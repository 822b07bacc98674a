"""One rank's attention plan: its query runs, the keys each run needs, and varlen offsets.

Pure planning over a `Layout` (no torch.distributed, no kernels). `validate_rank_plan` is
the host check every plan passes before it reaches a kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout
from .segments import ranges

@dataclass(frozen=True)
class RankPlan:
    """What one rank's attention needs, derived once per step from the layout.

    Rows of the gathered K/V tensor are slots in rank-major order. `key_rows` selects the
    keys this rank's queries may see, ordered by pack position and grouped by segment, as a
    `(start, stop)` range when they are contiguous (no gather needed) or an index tensor.
    Query rows are in pack-position order within the rank for every layout we build, which
    the varlen segment table relies on. `causal` False says that every key of a run precedes all
    of the run's queries (the keys from other ranks of a split by keys, `planning.overlap`), so
    every pair of a run is allowed: kernels that align causality bottom-right must not mask.
    """

    rank: int
    q_positions: torch.Tensor  # [L] padded-pack position of each local row
    q_segments: torch.Tensor  # [L]
    key_rows: tuple[int, int] | torch.Tensor
    k_positions: torch.Tensor  # [K] pack position of each selected key
    k_segments: torch.Tensor  # [K]
    cu_seqlens_q: torch.Tensor  # [n+1] int32, per query run of one segment
    cu_seqlens_k: torch.Tensor  # [n+1] int32, keys of that segment up to the run's last query
    max_seqlen_q: int
    max_seqlen_k: int
    causal: bool = True

    @property
    def num_keys(self) -> int:
        return int(self.k_positions.numel())


def plan_rank(layout: Layout, rank: int) -> RankPlan:
    """Attention plan of `rank`: query segments, the keys they need, and varlen offsets."""
    seg = layout.segments
    q_pos = layout.slot_positions[rank]
    if bool((q_pos[1:] <= q_pos[:-1]).any()):
        raise ValueError("layout rows of a rank must be in increasing pack order")
    q_seg = seg.segment_ids[q_pos]
    run_first, run_last = layout.query_runs(rank)
    q_lens = run_last - run_first + 1
    key_begin = seg.segment_starts[q_pos[run_first]]
    key_end = q_pos[run_last] + 1
    k_lens = key_end - key_begin
    k_pos = ranges(key_begin, k_lens)  # pack positions of every needed key, segment by segment
    return RankPlan(
        rank=rank,
        q_positions=q_pos,
        q_segments=q_seg,
        key_rows=range_or_index(layout.slot_of_position[k_pos]),
        k_positions=k_pos,
        k_segments=seg.segment_ids[k_pos],
        cu_seqlens_q=offsets(q_lens),
        cu_seqlens_k=offsets(k_lens),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
    )


def range_or_index(rows: torch.Tensor) -> tuple[int, int] | torch.Tensor:
    """`rows` as a `(start, stop)` range when they are consecutive and not empty (no gather needed), else as they are."""
    if rows.numel() and bool((rows[1:] == rows[:-1] + 1).all()):
        return int(rows[0]), int(rows[-1]) + 1
    return rows


def offsets(lengths: torch.Tensor) -> torch.Tensor:
    """Varlen offsets `[0, l0, l0+l1, ...]` (int32) of run `lengths`."""
    return torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths.long(), 0)]).to(torch.int32)


def key_row_levels(key_rows: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """`key_rows` split by occurrence: level l holds (position in `key_rows`, row) of every row's
    (l+1)-th occurrence, rows ascending. Two runs of one document on a rank need the same key
    prefix, so a row can occur more than once; within a level every row occurs once, which lets
    the gather's backward add each level without two writes to one row (`attention.dispatch`)."""
    rows = key_rows.long()
    order = torch.sort(rows, stable=True).indices
    sorted_rows = rows[order]
    new_row = torch.ones_like(sorted_rows, dtype=torch.bool)
    new_row[1:] = sorted_rows[1:] != sorted_rows[:-1]
    index = torch.arange(rows.numel())
    first = torch.cummax(torch.where(new_row, index, torch.zeros_like(index)), 0).values
    occurrence = index - first
    top = int(occurrence.max()) + 1 if rows.numel() else 0
    return tuple((order[occurrence == level], sorted_rows[occurrence == level]) for level in range(top))


def validate_rank_plan(plan: RankPlan, num_queries: int, num_keys: int, *, num_rows: int | None = None) -> None:
    """Raise ValueError unless `plan`'s varlen metadata is exactly consistent (host check, once per step).

    A bad offset or maximum in a varlen kernel is an out-of-bounds read on the device (on CUDA
    an illegal memory access that poisons the context), so every value a kernel indexes with
    is checked here, before the plan moves to the device: `cu_seqlens_q/k` are 1-D int32 CPU
    tensors of one length >= 2 that start at 0, never decrease and end at `num_queries` (L)
    and `num_keys` (K, the selected keys); every segment has >= 1 query and at least as many
    keys as queries (bottom-right causal alignment; a non-causal plan: >= 1 key); `max_seqlen_q/k` are the exact maxima;
    `q_positions`/`q_segments` hold L entries and `k_positions`/`k_segments` K. With
    `num_rows` (rows the exchange returns), `key_rows` must select K rows inside `[0, num_rows)`.
    """
    where = f"rank {plan.rank} plan"
    lengths = {}
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        cu = getattr(plan, name)
        if not isinstance(cu, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor; got {type(cu).__name__}")
        if cu.dtype != torch.int32:
            raise ValueError(f"{where}: {name} must have dtype torch.int32 (varlen kernels index with it); got {cu.dtype}")
        if cu.ndim != 1:
            raise ValueError(f"{where}: {name} must be 1-D; got shape {tuple(cu.shape)}")
        if cu.device.type != "cpu":
            raise ValueError(f"{where}: {name} must be on the CPU when validated (host plan); got {cu.device}")
        if cu.numel() < 2:
            raise ValueError(f"{where}: {name} must hold at least two offsets [0, ..., total]; got {cu.tolist()}")
        if int(cu[0]) != 0:
            raise ValueError(f"{where}: {name} must start at 0; got {int(cu[0])}")
        lens = cu[1:].long() - cu[:-1].long()
        if bool((lens < 0).any()):
            i = int(torch.nonzero(lens < 0)[0])
            raise ValueError(f"{where}: {name} must be non-decreasing; offset {i + 1} ({int(cu[i + 1])}) < offset {i} ({int(cu[i])})")
        lengths[name] = lens
    cu_q, cu_k = plan.cu_seqlens_q, plan.cu_seqlens_k
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"{where}: cu_seqlens_q and cu_seqlens_k must have the same length (one offset per segment + 1); got {cu_q.numel()} and {cu_k.numel()}")
    if int(cu_q[-1]) != num_queries:
        raise ValueError(f"{where}: cu_seqlens_q must end at the number of local queries ({num_queries}); got {int(cu_q[-1])}")
    if int(cu_k[-1]) != num_keys:
        raise ValueError(f"{where}: cu_seqlens_k must end at the number of selected keys ({num_keys}); got {int(cu_k[-1])}")
    q_lens, k_lens = lengths["cu_seqlens_q"], lengths["cu_seqlens_k"]
    if bool((q_lens < 1).any()):
        i = int(torch.nonzero(q_lens < 1)[0])
        raise ValueError(f"{where}: cu_seqlens_q must give every segment at least one query; segment {i} has none")
    if not plan.causal:
        if bool((k_lens < 1).any()):
            i = int(torch.nonzero(k_lens < 1)[0])
            raise ValueError(f"{where}: cu_seqlens_k must give every segment at least one key; segment {i} has none")
    elif bool((k_lens < q_lens).any()):
        i = int(torch.nonzero(k_lens < q_lens)[0])
        raise ValueError(
            f"{where}: cu_seqlens_k must give every segment at least as many keys as queries (bottom-right causal "
            f"alignment); segment {i} has {int(q_lens[i])} queries and {int(k_lens[i])} keys"
        )
    for name, lens in (("max_seqlen_q", q_lens), ("max_seqlen_k", k_lens)):
        value, exact = getattr(plan, name), int(lens.max())
        if isinstance(value, bool) or not isinstance(value, int) or value != exact:
            raise ValueError(f"{where}: {name} must be the exact maximum segment length {exact}; got {value!r}")
    for name, want in (("q_positions", num_queries), ("q_segments", num_queries), ("k_positions", num_keys), ("k_segments", num_keys)):
        t = getattr(plan, name)
        if t.ndim != 1 or t.numel() != want:
            raise ValueError(f"{where}: {name} must be 1-D with {want} entries; got shape {tuple(t.shape)}")
    rows = plan.key_rows
    if isinstance(rows, tuple):
        start, stop = rows
        if stop - start != num_keys or start < 0 or (num_rows is not None and stop > num_rows):
            bound = "" if num_rows is None else f" inside [0, {num_rows})"
            raise ValueError(f"{where}: key_rows must be a range of {num_keys} rows{bound}; got {rows}")
    else:
        if rows.ndim != 1 or rows.numel() != num_keys:
            raise ValueError(f"{where}: key_rows must index {num_keys} rows; got shape {tuple(rows.shape)}")
        if num_rows is not None and rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows):
            raise ValueError(
                f"{where}: key_rows must index inside [0, {num_rows}) (the exchange's rows); got "
                f"[{int(rows.min())}, {int(rows.max())}]"
            )


def dense_allowed(q_positions, q_segments, k_positions, k_segments, sliding_window: int | None = None) -> torch.Tensor:
    """Boolean [Lq, K] mask: same segment, key not after the query, and inside the window if any.

    HF sliding-window semantics: key allowed iff `k > q - W`.
    """
    allowed = (q_segments[:, None] == k_segments[None, :]) & (k_positions[None, :] <= q_positions[:, None])
    if sliding_window is not None:
        allowed &= k_positions[None, :] > q_positions[:, None] - sliding_window
    return allowed



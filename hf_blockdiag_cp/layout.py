"""Pure planning over document ids: segmentation, padding, layouts and per-rank attention plans.

Nothing here touches torch.distributed or a kernel. Every function works on CPU integer
tensors, so it can be tested exhaustively against a dense mask and reused by the
benchmarks and the balancer.

Vocabulary
- pack: the full packed row of S tokens, identical on every CP rank.
- document ids: int64 [S], 1-based; 0 marks padding. Each id forms one contiguous run.
- padded pack: the pack followed by tail padding up to a multiple of 2·G (`padded_seq_len`).
- segment: a maximal run of one document id in the padded pack. A padding run is its own
  segment, so padding rows attend (causally) only to padding and never produce NaN.
- slot: one local row of one rank; `Layout.slot_positions[r, i]` is the padded-pack position
  held by rank r's row i. Gathered K/V rows come in slot order (rank-major).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .balance import balanced_slot_positions

LAYOUT_STRATEGIES = ("contiguous", "balanced")


# --------------------------------------------------------------------------- segmentation


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids (1-based) from position ids that restart per document.

    A new document starts wherever the position does not continue the previous one by +1,
    the rule Transformers uses to detect packed sequences.
    """
    pos = position_ids.reshape(-1).long()
    if pos.numel() == 0:
        return pos.clone()
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return torch.cumsum(starts.long(), 0)


def document_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Document ids from cumulative lengths `[0, l0, l0+l1, ..., S]`; tokens past the end are padding."""
    cu = cu_seqlens.reshape(-1).long().cpu()
    if cu.numel() < 2 or int(cu[0]) != 0:
        raise ValueError(f"cu_seq_lens_q must start with 0 and hold at least two offsets; got {cu.tolist()[:8]}")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        raise ValueError("cu_seq_lens_q must be non-decreasing")
    if int(cu[-1]) > seq_len:
        raise ValueError(f"cu_seq_lens_q ends at {int(cu[-1])}, beyond the sequence length {seq_len}")
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    return torch.cat([ids, torch.zeros(seq_len - ids.numel(), dtype=torch.long)])


def document_ids_from_lengths(lengths, seq_len: int | None = None) -> torch.Tensor:
    """Document ids for documents of the given lengths laid end to end, padded with 0 to `seq_len`."""
    lengths = torch.as_tensor(list(lengths), dtype=torch.long)
    if bool((lengths <= 0).any()):
        raise ValueError("document lengths must be positive")
    ids = torch.repeat_interleave(torch.arange(1, lengths.numel() + 1), lengths)
    total = ids.numel() if seq_len is None else seq_len
    if total < ids.numel():
        raise ValueError(f"documents hold {ids.numel()} tokens, more than seq_len={seq_len}")
    return torch.cat([ids, torch.zeros(total - ids.numel(), dtype=torch.long)])


def validate_document_ids(document_ids: torch.Tensor, field_name: str = "document_ids") -> None:
    """Raise ValueError unless ids are >= 0 and every non-zero id forms exactly one contiguous run."""
    ids = document_ids.reshape(-1).long()
    if ids.numel() == 0:
        raise ValueError(f"{field_name} is empty: a pack needs at least one token")
    if bool((ids < 0).any()):
        raise ValueError(f"{field_name} must be >= 0 (1-based document ids, 0 = padding); found negative ids")
    change = torch.ones_like(ids, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    run_ids = ids[change]
    run_ids = run_ids[run_ids != 0]
    if run_ids.numel() != torch.unique(run_ids).numel():
        values, counts = torch.unique(run_ids, return_counts=True)
        bad = values[counts > 1][:5].tolist()
        raise ValueError(
            f"{field_name} must give each document one contiguous run of tokens; ids {bad} appear in "
            "several separate runs (documents interleaved or an id reused)"
        )


def padded_length(seq_len: int, cp_size: int) -> int:
    """Smallest multiple of 2·G that holds `seq_len` tokens (2·G leaves room for head-tail splits)."""
    unit = 2 * cp_size
    return max(unit, -(-seq_len // unit) * unit)


@dataclass(frozen=True)
class Segments:
    """Segments of a padded pack: per position, its segment id and the position where that segment starts."""

    segment_ids: torch.Tensor  # [S_pad] int64, 0-based, increasing along the pack
    segment_starts: torch.Tensor  # [S_pad] int64
    boundaries: torch.Tensor  # [n_segments + 1] int64 cumulative offsets

    @staticmethod
    def from_document_ids(document_ids: torch.Tensor) -> "Segments":
        ids = document_ids.reshape(-1).long()
        change = torch.ones_like(ids, dtype=torch.bool)
        change[1:] = ids[1:] != ids[:-1]
        seg = torch.cumsum(change.long(), 0) - 1
        starts_at = torch.nonzero(change).reshape(-1)
        boundaries = torch.cat([starts_at, torch.tensor([ids.numel()])])
        return Segments(seg, starts_at[seg], boundaries)


def packed_cu_seqlens(document_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative offsets `[0, ..., S_pad]` of the segments (documents and padding runs) of a padded pack."""
    return Segments.from_document_ids(document_ids).boundaries


# --------------------------------------------------------------------------- layouts


@dataclass(frozen=True)
class Layout:
    """Which pack position every local row of every CP rank holds.

    `token_indices[r, i]` is the original pack position of rank r's row i, -1 for tail
    padding. `slot_positions` is the same with tail padding numbered past the pack, so every
    slot has a position in the padded pack.
    """

    strategy: str
    cp_size: int
    original_seq_len: int
    padded_seq_len: int
    slot_positions: torch.Tensor  # [G, L] int64, a permutation of range(padded_seq_len)
    document_ids: torch.Tensor  # [S_pad] int64, padded pack order, 0 = padding
    segments: Segments = field(repr=False)

    @property
    def local_len(self) -> int:
        return self.padded_seq_len // self.cp_size

    @property
    def token_indices(self) -> torch.Tensor:
        pos = self.slot_positions
        return torch.where(pos < self.original_seq_len, pos, torch.full_like(pos, -1))

    @property
    def document_lengths(self) -> list[int]:
        ids = self.document_ids[: self.original_seq_len]
        real = ids[ids > 0]
        return torch.unique_consecutive(real, return_counts=True)[1].tolist()

    def real_tokens_per_rank(self) -> list[int]:
        return (self.document_ids[self.slot_positions] > 0).sum(dim=1).tolist()


def _pack_document_ids(documents, seq_len: int | None) -> torch.Tensor:
    """Document ids `[S]` from either form `plan_layout` accepts (see there)."""
    if isinstance(documents, torch.Tensor):
        if seq_len is not None and documents.numel() != seq_len:
            raise ValueError(f"document ids hold {documents.numel()} tokens but seq_len={seq_len}")
        return documents.reshape(-1).long().cpu()
    if isinstance(documents, (list, tuple)):
        if not documents or not all(isinstance(n, int) and not isinstance(n, bool) for n in documents):
            raise ValueError(f"document lengths must be a non-empty list of positive ints; got {list(documents)[:8]}")
        return document_ids_from_lengths(documents, seq_len)
    raise TypeError(
        "plan_layout takes document ids as a 1-D torch.Tensor (1-based, 0 = padding) or document lengths as a "
        f"list/tuple of ints; got {type(documents).__name__}"
    )


def plan_layout(
    documents: torch.Tensor | list[int] | tuple[int, ...],
    cp_size: int,
    strategy: str = "contiguous",
    *,
    seq_len: int | None = None,
    tolerance: float = 0.05,
) -> Layout:
    """Plan which padded-pack positions every CP rank holds.

    `documents` is either the pack's document ids (a torch.Tensor `[S]` or `[1, S]`, 1-based,
    0 = padding) or the documents' lengths (a list/tuple of ints, laid end to end and padded
    with id 0 up to `seq_len` if given). The pack is then padded to a multiple of 2·G.

    strategy "contiguous": rank r holds rows `[r·L, (r+1)·L)`. "balanced": each rank still
    holds L rows in increasing pack order, chosen so that every rank's attention work is
    within `tolerance` of the mean where the pack allows it (algorithm, cost and bound in
    `hf_blockdiag_cp.balance`); it equals the contiguous layout whenever that is already
    balanced.
    """
    if isinstance(cp_size, bool) or not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be a positive integer; got {cp_size!r}")
    if strategy not in LAYOUT_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not supported; accepted values: {', '.join(LAYOUT_STRATEGIES)}")
    ids = _pack_document_ids(documents, seq_len)
    validate_document_ids(ids)
    seq_len = ids.numel()
    s_pad = padded_length(seq_len, cp_size)
    padded = torch.cat([ids, torch.zeros(s_pad - seq_len, dtype=torch.long)])
    segments = Segments.from_document_ids(padded)
    if strategy == "balanced":
        slots = balanced_slot_positions(segments.boundaries, cp_size, tolerance)
    else:
        slots = torch.arange(s_pad).view(cp_size, s_pad // cp_size)
    return Layout(strategy, cp_size, seq_len, s_pad, slots, padded, segments)


# --------------------------------------------------------------------------- per-rank attention plan


@dataclass(frozen=True)
class RankPlan:
    """What one rank's attention needs, derived once per step from the layout.

    Rows of the gathered K/V tensor are slots in rank-major order. `key_rows` selects the
    keys this rank's queries may see, ordered by pack position and grouped by segment, as a
    `(start, stop)` range when they are contiguous (no gather needed) or an index tensor.
    Query rows are in pack-position order within the rank for every layout we build, which
    the varlen segment table relies on.
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
    change = torch.ones_like(q_seg, dtype=torch.bool)
    # A run is one segment AND consecutive positions: a rank may hold two separate chunks of one
    # document (head-tail layouts), and varlen's bottom-right causal alignment needs each chunk alone.
    change[1:] = (q_seg[1:] != q_seg[:-1]) | (q_pos[1:] != q_pos[:-1] + 1)
    run_first = torch.nonzero(change).reshape(-1)
    run_last = torch.cat([run_first[1:], torch.tensor([q_pos.numel()])]) - 1
    q_lens = run_last - run_first + 1
    key_begin = seg.segment_starts[q_pos[run_first]]
    key_end = q_pos[run_last] + 1
    k_lens = key_end - key_begin
    # Pack positions of every needed key, segment by segment.
    offsets = torch.repeat_interleave(key_begin - torch.cumsum(k_lens, 0) + k_lens, k_lens)
    k_pos = torch.arange(int(k_lens.sum())) + offsets
    slot_of_position = torch.empty(layout.padded_seq_len, dtype=torch.long)
    slot_of_position[layout.slot_positions.reshape(-1)] = torch.arange(layout.padded_seq_len)
    rows = slot_of_position[k_pos]
    if rows.numel() and bool((rows[1:] == rows[:-1] + 1).all()):
        key_rows: tuple[int, int] | torch.Tensor = (int(rows[0]), int(rows[-1]) + 1)
    else:
        key_rows = rows
    zero = torch.zeros(1, dtype=torch.long)
    return RankPlan(
        rank=rank,
        q_positions=q_pos,
        q_segments=q_seg,
        key_rows=key_rows,
        k_positions=k_pos,
        k_segments=seg.segment_ids[k_pos],
        cu_seqlens_q=torch.cat([zero, torch.cumsum(q_lens, 0)]).to(torch.int32),
        cu_seqlens_k=torch.cat([zero, torch.cumsum(k_lens, 0)]).to(torch.int32),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
    )


def validate_rank_plan(plan: RankPlan, num_queries: int, num_keys: int, *, num_rows: int | None = None) -> None:
    """Raise ValueError unless `plan`'s varlen metadata is exactly consistent (host check, once per step).

    A bad offset or maximum in a varlen kernel is an out-of-bounds read on the device (on CUDA
    an illegal memory access that poisons the context), so every value a kernel indexes with
    is checked here, before the plan moves to the device: `cu_seqlens_q/k` are 1-D int32 CPU
    tensors of one length >= 2 that start at 0, never decrease and end at `num_queries` (L)
    and `num_keys` (K, the selected keys); every segment has >= 1 query and at least as many
    keys as queries (bottom-right causal alignment); `max_seqlen_q/k` are the exact maxima;
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
    if bool((k_lens < q_lens).any()):
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


# --------------------------------------------------------------------------- accounting


def allgather_kv_bytes_per_rank(layout: Layout, kv_heads: int, head_dim_k: int, head_dim_v: int, bytes_per_element: int) -> int:
    """Bytes of K and V one rank receives per layer in the all-gather forward (the backward's reduce-scatter moves the same)."""
    return (layout.cp_size - 1) * layout.local_len * kv_heads * (head_dim_k + head_dim_v) * bytes_per_element

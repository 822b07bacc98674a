"""Document ids, segments, runs and intervals: the one home of segment arithmetic.

Pure functions over CPU integer tensors (no torch.distributed, no kernels).

Vocabulary
- pack: the full packed row of S tokens, identical on every CP rank.
- document ids: int64 [S], 1-based; 0 marks padding, which may only follow the last real
  token. Each id forms one contiguous run.
- padded pack: the pack followed by tail padding up to a multiple of 2·G (`padded_length`).
- segment: a maximal run of one document id in the padded pack. A padding run is its own
  segment, so padding rows attend (causally) only to padding and never produce NaN.
- run: a maximal stretch of a sequence in which given keys stay equal (`run_starts`);
  e.g. consecutive pack positions of one segment held by one rank.
- interval: `[start, stop)` of pack positions; interval sets are `[n, 2]` int64, sorted and
  disjoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# --------------------------------------------------------------------------- runs and intervals


def run_starts(*keys: torch.Tensor, consecutive: torch.Tensor | None = None) -> torch.Tensor:
    """Bool [n]: True where a new run begins, i.e. at index 0 and wherever any of `keys`
    changes from the previous index (or, with `consecutive` given, where it does not continue
    the previous value by +1)."""
    n = (keys[0] if keys else consecutive).numel()
    new = torch.zeros(n, dtype=torch.bool)
    new[:1] = True
    for key in keys:
        new[1:] |= key[1:] != key[:-1]
    if consecutive is not None:
        new[1:] |= consecutive[1:] != consecutive[:-1] + 1
    return new


def run_bounds(new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, last) index of each run, from the bool tensor that marks run starts."""
    first = torch.nonzero(new).reshape(-1)
    last = torch.cat([first[1:], torch.tensor([new.numel()])]) - 1
    return first, last


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenation of `arange(starts[i], starts[i] + lengths[i])` over i (lengths >= 0)."""
    lengths = lengths.long()
    if lengths.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    offsets = torch.repeat_interleave(starts.long() - (torch.cumsum(lengths, 0) - lengths), lengths)
    return torch.arange(int(lengths.sum())) + offsets


def expand(intervals: torch.Tensor) -> torch.Tensor:
    """All positions of sorted disjoint `[n, 2]` intervals, in increasing order."""
    if intervals.numel() == 0:
        return torch.zeros(0, dtype=torch.long)
    return ranges(intervals[:, 0], intervals[:, 1] - intervals[:, 0])


def intersect(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Sorted `[k, 2]` intersection of two sorted disjoint interval sets."""
    start = torch.maximum(a[:, None, 0], b[None, :, 0])
    stop = torch.minimum(a[:, None, 1], b[None, :, 1])
    pairs = torch.stack([start, stop], dim=-1).reshape(-1, 2)
    pairs = pairs[pairs[:, 0] < pairs[:, 1]]
    return pairs[torch.argsort(pairs[:, 0])]


def interval_size(intervals: torch.Tensor) -> int:
    return int((intervals[:, 1] - intervals[:, 0]).sum()) if intervals.numel() else 0


def position_intervals(positions: torch.Tensor) -> torch.Tensor:
    """`[n, 2]` maximal runs of consecutive values of `positions`, as `[start, stop)`."""
    first, last = run_bounds(run_starts(consecutive=positions))
    return torch.stack([positions[first], positions[last] + 1], dim=1)


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """`inv` with `inv[perm[i]] = i` (perm a permutation of range(n))."""
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), dtype=perm.dtype)
    return inv


# --------------------------------------------------------------------------- document ids


def document_ids_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids (1-based) from position ids that restart per document.

    A new document starts wherever the position does not continue the previous one by +1,
    the rule Transformers uses to detect packed sequences.
    """
    pos = position_ids.reshape(-1).long()
    if pos.numel() == 0:
        return pos.clone()
    return torch.cumsum(run_starts(consecutive=pos).long(), 0)


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
    lengths = lengths[lengths > 0]
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
    """Raise ValueError unless ids are >= 0 and every non-zero id forms exactly one contiguous run.

    Planning accepts padding runs anywhere (each is its own segment); packs from users must
    also pass `validate_padding_at_end`."""
    ids = document_ids.reshape(-1).long()
    if ids.numel() == 0:
        raise ValueError(f"{field_name} is empty: a pack needs at least one token")
    if bool((ids < 0).any()):
        raise ValueError(f"{field_name} must be >= 0 (1-based document ids, 0 = padding); found negative ids")
    run_ids = ids[run_starts(ids)]
    run_ids = run_ids[run_ids != 0]
    if run_ids.numel() != torch.unique(run_ids).numel():
        values, counts = torch.unique(run_ids, return_counts=True)
        bad = values[counts > 1][:5].tolist()
        raise ValueError(
            f"{field_name} must give each document one contiguous run of tokens; ids {bad} appear in "
            "several separate runs (documents interleaved or an id reused)"
        )


def padding_before_a_token(real: torch.Tensor) -> tuple[int, int] | None:
    """(first padding position, last real position) when padding comes before a real token in the
    bool row `real`, else None."""
    real = real.reshape(-1)
    if not bool(real.any()):
        return None
    last_real = int(torch.nonzero(real)[-1])
    if bool(real[: last_real + 1].all()):
        return None
    return int(torch.nonzero(~real[: last_real + 1])[0]), last_real


def validate_padding_at_end(document_ids: torch.Tensor, field_name: str = "document_ids") -> None:
    """Raise ValueError if padding (id 0) comes before a real token: ids are 1-based and padding
    goes last, so a 0-based pack can never be mistaken for a padded one."""
    hole = padding_before_a_token(document_ids.reshape(-1) != 0)
    if hole is not None:
        raise ValueError(
            f"{field_name} has padding (id 0) at position {hole[0]}, before the last real token at position "
            f"{hole[1]}; document ids are 1-based and padding may only come at the end of the pack"
        )


def positions_from_document_ids(ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document (0 for padding)."""
    idx = torch.arange(ids.numel())
    start = torch.cummax(torch.where(run_starts(ids), idx, torch.zeros_like(idx)), 0).values
    return torch.where(ids > 0, idx - start, torch.zeros_like(idx))


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
        new = run_starts(ids)
        seg = torch.cumsum(new.long(), 0) - 1
        starts_at = torch.nonzero(new).reshape(-1)
        boundaries = torch.cat([starts_at, torch.tensor([ids.numel()])])
        return Segments(seg, starts_at[seg], boundaries)

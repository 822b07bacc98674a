"""Balanced layouts: which pack positions each CP rank holds, so that every rank does the same attention work.

Pure planning (numpy and CPU tensors, no torch.distributed, no kernels). Registered as the
layout strategy "balanced" (`plan_layout(..., strategy="balanced")`); `planning.cost`
reports what any layout costs (work, tokens, K/V bytes).

Cost model
  A query at offset i of its segment (a document or a padding run) attends to i + 1 keys,
  so a run of n tokens starting at offset a costs n(2a + n + 1)/2 and a whole segment of l
  tokens w(l) = l(l + 1)/2. A rank's *work* is the sum over its rows: exactly the number of
  true entries of its rows of the block-causal mask. Every rank holds exactly L = S_pad / G
  rows. Documents are independent, so any assignment of positions to ranks is exact as long
  as each rank keeps its rows in increasing pack order (`plan_rank` relies on that).

Algorithm (`balanced_slot_positions`), with T = total work / G and tolerance eps (0.05):
  1. Contiguous chunks if they are already within 1 + eps of T: fewest split documents,
     least communication, and the only layout a left-halo exchange can serve.
  2. Otherwise a greedy (`_greedy_pieces`). Segments whose work is at most eps/4 * T are
     *filler*; the others are taken longest first. Each rank's key is its work plus the
     filler work its free rows will receive (free rows x filler work per token). A segment
     goes whole to the lowest-key rank with room for it if that keeps the key within
     (1 + eps/2) T; otherwise it is split head-tail (zig-zag) over the k lowest-key ranks
     with room, k = 2..G the smallest that stays within budget (or the best k): cut into 2k
     equal chunks, rank i gets chunks i and 2k-1-i, which gives every one of them exactly
     the same work; the l mod 2k leftover tokens are a run in the middle of the segment
     and are placed like a segment. Whatever finds no room, then the filler segments in an
     order that mixes long and short ones (golden-ratio stride over the length order),
     are cut to fill the ranks' free rows exactly, lowest key first.
  3. If the greedy misses 1 + eps too, every segment is zig-zagged over all G ranks (`_zigzag_pieces`)
     with its l mod 2G leftover tokens in its middle; those leftovers of all segments are
     pooled and dealt one token at a time in snake order by cost. The best of the three
     candidates (lowest maximum work, contiguous first on ties) is returned.

Cost per step: O(n log n) in the number of segments n for sorting, a Python loop of O(G log G)
per non-filler segment (at most 4G/eps of them: each holds more than eps/4 of a rank's work),
vectorised numpy for the filler, and O(S) to write the slot table. See
`benchmarks/layout_table.py` for measured times.

Guarantee. Zig-zag gives every rank identical work from every segment's 2G chunks; snake
dealing of the pooled leftover tokens (costs c_1 >= c_2 >= ..., complete forward+backward
rounds because S_pad is a multiple of 2G) leaves max - min <= c_1 - c_last <= l_max - 1
(the rounds' spreads telescope). A candidate is returned early only within (1 + eps) T, else
the best of the three, so with l_max the longest segment (document or padding run):
    max work <= min(contiguous max work, max((1 + eps) T, T + l_max)).
Hence max/mean <= 1 + eps whenever T >= l_max / eps (T >= 20 l_max for eps = 0.05): every
128k-token pack at G <= 16 unless nearly all its work sits in documents of a few hundred
tokens, where contiguous chunks are balanced anyway. Below that, token granularity can make
1.05 impossible: lengths [3, 1] at G = 2 allow at best 4 vs 3 (1.14).
Sliding windows are not in the cost model (they only lower work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .layout import DEFAULT_TOLERANCE, register_layout_strategy
_FILLER_SHARE = 0.25  # filler segment: work <= _FILLER_SHARE * tolerance * T
_BUDGET_SHARE = 0.75  # the greedy aims at (1 + 0.75 tolerance) T, leaving room for the filler's noise
_GOLDEN = 0.6180339887498949


def run_work(offset, length):
    """Work of a run of `length` tokens starting at in-segment `offset`: sum of offset+1 .. offset+length."""
    return length * (2 * offset + length + 1) // 2


# --------------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class Pieces:
    """Runs of consecutive pack positions given to ranks.

    Run i holds positions `[start[i], start[i] + length[i])` on rank `rank[i]`; its first token
    sits at `offset[i]` within its segment, which fixes its work.
    """

    rank: np.ndarray
    start: np.ndarray
    length: np.ndarray
    offset: np.ndarray

    @staticmethod
    def concat(parts: list["Pieces"]) -> "Pieces":
        parts = [p for p in parts if p.rank.size]
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return Pieces(empty, empty, empty, empty)
        return Pieces(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rank", "start", "length", "offset")))

    @staticmethod
    def from_lists(rank: list[int], start: list[int], length: list[int], offset: list[int]) -> "Pieces":
        return Pieces(*(np.asarray(x, dtype=np.int64) for x in (rank, start, length, offset)))

    def work_per_rank(self, cp_size: int) -> np.ndarray:
        out = np.zeros(cp_size, dtype=np.int64)
        np.add.at(out, self.rank, run_work(self.offset, self.length))
        return out

    def slot_positions(self, cp_size: int, local_len: int) -> torch.Tensor:
        """`[G, L]` positions, each rank's rows in increasing pack order."""
        order = np.lexsort((self.start, self.rank))
        starts, lengths = self.start[order], self.length[order]
        per_rank = np.bincount(self.rank, weights=self.length, minlength=cp_size)
        if not np.all(per_rank == local_len):
            raise AssertionError(f"balanced planner produced {per_rank.tolist()} rows per rank, expected {local_len} each")
        first = np.cumsum(lengths) - lengths
        positions = np.repeat(starts - first, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
        return torch.from_numpy(positions.reshape(cp_size, local_len))


# --------------------------------------------------------------------------- candidates


def _contiguous_work(starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int) -> np.ndarray:
    """Per-rank work of contiguous chunks, from the prefix-work function at the G+1 cut points."""
    cuts = np.arange(cp_size + 1, dtype=np.int64) * local_len
    seg = np.searchsorted(starts, cuts, side="right") - 1
    before = np.concatenate([[0], np.cumsum(run_work(0, lengths))])
    prefix = before[seg] + run_work(0, cuts - starts[seg])
    return np.diff(prefix)


def _zigzag_pieces(starts: np.ndarray, lengths: np.ndarray, cp_size: int) -> Pieces:
    """Every segment head-tail over all G ranks; middle leftovers dealt token by token in snake order."""
    g2 = 2 * cp_size
    chunk = lengths // g2
    rem = lengths - g2 * chunk
    big = chunk > 0
    j = np.arange(g2, dtype=np.int64)
    offsets = j[None, :] * chunk[big, None] + (j >= cp_size)[None, :] * rem[big, None]
    ranks = np.broadcast_to(np.where(j < cp_size, j, g2 - 1 - j), offsets.shape)
    chunks = Pieces(
        ranks.reshape(-1).astype(np.int64),
        (starts[big, None] + offsets).reshape(-1),
        np.broadcast_to(chunk[big, None], offsets.shape).reshape(-1),
        offsets.reshape(-1),
    )
    seg = np.repeat(np.arange(lengths.size), rem)
    first = np.cumsum(rem) - rem
    tok_offset = cp_size * chunk[seg] + np.arange(seg.size) - first[seg]
    order = np.argsort(-tok_offset, kind="stable")
    i = np.arange(seg.size)
    lane = i % cp_size
    snake = np.where((i // cp_size) % 2 == 0, lane, cp_size - 1 - lane)
    singles = Pieces(
        snake.astype(np.int64),
        starts[seg][order] + tok_offset[order],
        np.ones(seg.size, dtype=np.int64),
        tok_offset[order],
    )
    return Pieces.concat([chunks, singles])


class _Greedy:
    """State of the greedy: per-rank work and free rows, and the runs placed so far."""

    def __init__(self, cp_size: int, local_len: int, total_work: int, budget: float):
        self.g = cp_size
        self.work = [0] * cp_size
        self.free = [local_len] * cp_size
        self.left_work = total_work  # work and rows not placed yet
        self.left_rows = cp_size * local_len
        self.budget = budget
        self.placed: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.unplaced: list[tuple[int, int, int]] = []  # (start, length, offset)

    @property
    def density(self) -> float:
        """Mean work per row of everything not placed yet: what free rows will receive on average."""
        return self.left_work / self.left_rows if self.left_rows else 0.0

    def key(self, r: int) -> float:
        """Work rank r is heading for: its work plus its free rows at the unplaced mass's density.

        The keys always sum to the total work, so their mean is the target T."""
        return self.work[r] + self.density * self.free[r]

    def _put(self, r: int, start: int, length: int, offset: int) -> None:
        ranks, starts, lengths, offsets = self.placed
        ranks.append(r), starts.append(start), lengths.append(length), offsets.append(offset)
        work = run_work(offset, length)
        self.work[r] += work
        self.free[r] -= length
        self.left_work -= work
        self.left_rows -= length

    def place(self, start: int, length: int, offset: int = 0) -> None:
        """Place one run whole if that stays within budget, else zig-zag it over the fewest lowest-key ranks."""
        density = self.density
        free = self.free
        keys = [w + density * f for w, f in zip(self.work, free)]
        best_key = min(keys)
        best = keys.index(best_key)
        if free[best] < length:  # the lowest-key rank is full: the lowest key among ranks with room
            best, best_key = -1, float("inf")
            for r in range(self.g):
                if free[r] >= length and keys[r] < best_key:
                    best, best_key = r, keys[r]
        delta = run_work(offset, length) - density * length
        # Runs too short to split, and the middle leftovers of split segments, go whole regardless.
        if best >= 0 and (best_key + delta <= self.budget or length < 4 or offset > 0):
            self._put(best, start, length, offset)
        elif not (offset == 0 and self._split(keys, density, start, length)):
            self.unplaced.append((start, length, offset))

    def _split(self, keys: list[float], density: float, start: int, length: int) -> bool:
        """Zig-zag a segment over the k lowest-key ranks with room, k the smallest within budget (else the best k)."""
        order = sorted(range(self.g), key=keys.__getitem__)
        free = self.free
        best: tuple[float, list[int], int] | None = None
        # Each of k ranks gains about excess / k, so no k below excess / (budget - lowest key) can fit.
        excess = run_work(0, length) - density * length
        room = self.budget - keys[order[0]]
        k_low = max(2, int(excess // room)) if room > 0 else self.g
        for k in range(min(k_low, self.g, length // 2), min(self.g, length // 2) + 1):
            chunk = length // (2 * k)
            rem = length - 2 * k * chunk
            ranks = [r for r in order if free[r] >= 2 * chunk][:k]
            if len(ranks) < k:
                continue
            peak = keys[ranks[-1]] + chunk * (2 * k * chunk + 1 + rem) - density * 2 * chunk
            if best is None or peak < best[0]:
                best = (peak, ranks, k)
            if peak <= self.budget:
                break
        if best is None:
            return False
        _, ranks, k = best
        chunk = length // (2 * k)
        rem = length - 2 * k * chunk
        pair_work = chunk * (2 * k * chunk + 1 + rem)  # the same for every rank: the point of zig-zag
        heads = [i * chunk for i in range(k)]
        tails = [rem + (2 * k - 1 - i) * chunk for i in range(k)]
        placed_ranks, placed_starts, placed_lengths, placed_offsets = self.placed
        placed_ranks.extend(ranks + ranks)
        placed_offsets.extend(heads + tails)
        placed_starts.extend([start + o for o in heads + tails])
        placed_lengths.extend([chunk] * (2 * k))
        for r in ranks:
            self.work[r] += pair_work
            self.free[r] -= 2 * chunk
        self.left_work -= k * pair_work
        self.left_rows -= 2 * k * chunk
        if rem:
            self.place(start + k * chunk, rem, k * chunk)
        return True

    def fill(self, filler: Pieces) -> Pieces:
        """Cut `filler` (a sequence of runs, rank ignored) into the free rows, lowest key first."""
        ranks = np.asarray(sorted(range(self.g), key=self.key), dtype=np.int64)
        free = np.asarray(self.free, dtype=np.int64)[ranks]
        run_end = np.cumsum(filler.length)
        cut_end = np.cumsum(free)
        if (int(run_end[-1]) if run_end.size else 0) != int(cut_end[-1]):
            raise AssertionError(f"filler holds {run_end[-1:].tolist()} tokens for {int(cut_end[-1])} free rows")
        points = np.unique(np.concatenate([[0], run_end, cut_end]))
        lo, hi = points[:-1], points[1:]
        run = np.searchsorted(run_end, lo, side="right")
        rank = ranks[np.searchsorted(cut_end, lo, side="right")]
        into = lo - (run_end[run] - filler.length[run])
        cut = Pieces(rank, filler.start[run] + into, hi - lo, filler.offset[run] + into)
        return Pieces.concat([Pieces.from_lists(*self.placed), cut])


def _greedy_pieces(starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int, tolerance: float) -> Pieces:
    """Step 2 of the module docstring: whole segments by key, zig-zag over few ranks where needed, filler last."""
    work = run_work(0, lengths)
    mean = float(work.sum()) / cp_size
    by_length = np.argsort(-lengths, kind="stable")
    is_filler = work[by_length] <= _FILLER_SHARE * tolerance * mean
    large, small = by_length[~is_filler], by_length[is_filler]
    greedy = _Greedy(cp_size, local_len, int(work.sum()), (1.0 + _BUDGET_SHARE * tolerance) * mean)
    for i in large.tolist():
        greedy.place(int(starts[i]), int(lengths[i]), 0)
    # Mixed filler order: a golden-ratio stride over the length order, so every stretch holds long and short.
    mixed = small[np.argsort((np.arange(small.size) * _GOLDEN) % 1.0, kind="stable")]
    left = np.asarray(greedy.unplaced, dtype=np.int64).reshape(-1, 3)
    left = left[np.argsort(-left[:, 1], kind="stable")]
    zeros = np.zeros(mixed.size + left.shape[0], dtype=np.int64)
    filler = Pieces(
        zeros,
        np.concatenate([left[:, 0], starts[mixed]]),
        np.concatenate([left[:, 1], lengths[mixed]]),
        np.concatenate([left[:, 2], np.zeros(mixed.size, dtype=np.int64)]),
    )
    return greedy.fill(filler)


def balanced_slot_positions(boundaries: torch.Tensor, cp_size: int, tolerance: float = DEFAULT_TOLERANCE) -> torch.Tensor:
    """`[G, L]` slot positions of the balanced layout of a padded pack with segment `boundaries` `[0, ..., S_pad]`."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0; got {tolerance!r}")
    bounds = boundaries.detach().cpu().numpy().astype(np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    s_pad = int(bounds[-1])
    local_len = s_pad // cp_size
    contiguous = _contiguous_work(starts, lengths, cp_size, local_len)
    mean = float(contiguous.sum()) / cp_size
    limit = (1.0 + tolerance) * mean
    if cp_size == 1 or contiguous.max() <= limit:
        return torch.arange(s_pad).view(cp_size, local_len)
    greedy = _greedy_pieces(starts, lengths, cp_size, local_len, tolerance)
    greedy_max = greedy.work_per_rank(cp_size).max()
    if greedy_max <= limit:
        return greedy.slot_positions(cp_size, local_len)
    zigzag = _zigzag_pieces(starts, lengths, cp_size)
    zigzag_max = zigzag.work_per_rank(cp_size).max()
    best = min(contiguous.max(), greedy_max, zigzag_max)
    if contiguous.max() == best:
        return torch.arange(s_pad).view(cp_size, local_len)
    chosen = greedy if greedy_max == best else zigzag
    return chosen.slot_positions(cp_size, local_len)


register_layout_strategy("balanced", balanced_slot_positions)

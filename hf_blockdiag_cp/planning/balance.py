"""Balanced layouts: which pack positions each CP rank holds, so that every rank takes the same attention time.

Pure planning (numpy and CPU tensors, no torch.distributed, no kernels). Registered as the
layout strategy "balanced" (`plan_layout(..., strategy="balanced", kernel_cost=...)`);
`planning.cost` reports what any layout costs (pairs, predicted cost, tokens, K/V bytes).

Cost model
  A rank's cost is the sum over its query runs of `KernelCost.run_cost` (planning.kernel_cost):
  tiles of the run's bottom-right causal block, plus overheads per run and per query/key tile,
  fitted per kernel (docs/layouts.md, "Calibration"). Unlike pair counts, cost is not conserved
  by splitting: cutting a document adds runs, key tiles and partial diagonal tiles, so short
  documents should stay whole and split documents should use few, long chunks. With
  `PAIR_COUNT` the cost is the number of allowed query-key pairs and the algorithm below is the
  pair balancer of earlier versions, with its guarantee. Every rank holds exactly L = S_pad / G
  rows (a hard constraint); documents are independent, so any assignment is exact as long as
  each rank keeps its rows in increasing pack order (`plan_rank` relies on that).

Algorithm (`balanced_slot_positions`), with T = cost of every segment whole / G, tolerance eps (0.05):
  1. Contiguous chunks if they are already within 1 + eps of T: fewest split documents,
     least communication, and the only layout a left-halo exchange can serve.
  2. Otherwise a greedy (`_greedy_pieces`). Segments whose cost beyond a run's fixed overhead
     (`per_run`, paid whole or cut) is at most eps/4 * T are *filler*; the others are taken
     longest first. (Counting the overhead would leave a kernel with a dear run almost no filler,
     and the greedy would zig-zag short documents to close the last gaps.) Each rank's key is its
     cost plus its free rows at an expected cost per row: the mean of everything unplaced, or for
     a kernel cost the (lower) filler's, since a rank holding dear rows should get cheap rows
     later rather than a split document. A segment goes whole to the lowest-key rank with room if
     that keeps the key within (1 + eps/2) x the mean key (which grows by what splits add);
     otherwise it is split head-tail (zig-zag) over the k lowest-key ranks with room, k = 2..G the
     smallest within budget (or the best k), but only if that lowers the peak key below placing it
     whole. Zig-zag cuts 2k equal chunks and gives rank i chunks i and 2k-1-i: the same pairs for
     each (the same cost up to tile alignment; the dearest pair goes to the lowest key); the l mod
     2k leftover tokens are a run in the middle of the segment and are placed like a segment.
     Whatever finds no room, then the filler segments in an order that mixes long and short ones
     (golden-ratio stride over the length order), are cut to fill the ranks' free rows exactly,
     lowest key first.
  3. If the greedy misses 1 + eps too, every segment is zig-zagged over all G ranks (`_zigzag_pieces`)
     with its l mod 2G leftover tokens in its middle; for `PAIR_COUNT` those leftovers are
     pooled and dealt one token at a time in snake order, for a kernel cost (where a one-token
     run pays a run's overhead) they are cut into the free rows, dearest first. The best of the
     three candidates (lowest maximum predicted cost, contiguous first on ties) is returned.
  4. Unless contiguous won, a refinement (`_refine`) swaps rows between the dearest rank and a
     cheaper one while that lowers the peak: the last x rows of a run on the dearest rank (its
     dearest rows) for the first x rows of a run on the other, x equal both ways, until max/mean
     is within 1 + tolerance/10. The greedy's filler is cut by an estimated density, so it leaves
     a few percent between ranks (5 % at G = 8 on log-normal packs); the swaps take that to about
     1 % (tests/unit/test_kernel_cost.py), at the price of more split documents (benchmarks/results/layout_table.md).
  5. If the refined layout's peak is still above (1 + 2 eps) T (under a kernel cost), greedy
     candidates with budgets of 2, 4, 8 and 16 x eps (`_retry_greedy`); the two with the lowest
     peaks are refined as in 4, and one replaces the layout only if it lowers the predicted peak
     by more than 2 %. The greedy is sensitive to its budget: when every key is near it, a long
     document can be zig-zagged over all G ranks (32 chunks of 321 tokens for a 10k document at G
     = 16), adding more key tiles and runs than it evens out; a looser budget keeps it whole or on
     fewer ranks.

Cost per step: O(n log n) in the number of segments n for sorting, a Python loop of O(G log G)
per non-filler segment (at most 4G/eps of them), vectorised numpy for the filler, at most 2G
refinement moves of O(G) numpy evaluations over 12 x 12 run pairs, and O(S) to write the slot
table; step 5 adds four greedy passes and two refinements (about 2-3x the time). See
`benchmarks/layout_table.py` for measured times.

Guarantee. The returned layout's maximum predicted cost is never above the contiguous layout's
(best of candidates, contiguous included). For `PAIR_COUNT` the earlier bound holds: zig-zag
gives every rank identical pairs from every segment's 2G chunks; snake dealing of the pooled
leftover tokens (costs c_1 >= c_2 >= ..., complete forward+backward rounds because S_pad is a
multiple of 2G) leaves max - min <= c_1 - c_last <= l_max - 1, so with l_max the longest segment
    max work <= min(contiguous max work, max((1 + eps) T, T + l_max)),
hence max/mean <= 1 + eps whenever T >= l_max / eps; token granularity can make 1.05 impossible
below that (lengths [3, 1] at G = 2 allow at best 4 vs 3). For a kernel cost there is no such
bound: splits add cost, and the per-call constant sets a floor on max / ideal (docs/layouts.md);
tests/unit/test_kernel_cost.py checks the predicted balance of the `bench ranks` scenarios.
Sliding windows are not in the cost model (they only lower work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kernel_cost import DEFAULT_KERNEL_COST, KernelCost
from .layout import DEFAULT_TOLERANCE, register_layout_strategy

_FILLER_SHARE = 0.25  # filler segment: work - per_run <= _FILLER_SHARE * tolerance * T
_BUDGET_SHARE = 0.75  # the greedy aims at (1 + 0.75 tolerance) T, leaving room for the filler's noise
_GOLDEN = 0.6180339887498949
_REFINE_MOVES = 2  # row swaps per rank at most in the final refinement
_REFINE_SHARE = 0.1  # the refinement stops at max/mean <= 1 + 0.1 tolerance (each swap splits runs)
_REFINE_RUNS = 12  # runs per rank a swap considers (the dearest on the dearest rank, the longest on the other)
# Step 5: when the refined layout's peak is above (1 + _RETRY_ABOVE tolerance) T, greedy candidates at
# _RETRY_FACTORS x the tolerance; the _RETRY_REFINED with the lowest greedy peaks are refined, and one
# replaces the layout only if it lowers the predicted peak by more than _RETRY_GAIN.
_RETRY_ABOVE = 2
_RETRY_FACTORS = (2, 4, 8, 16)
_RETRY_REFINED = 2
_RETRY_GAIN = 0.02


# --------------------------------------------------------------------------- pieces


@dataclass(frozen=True)
class Pieces:
    """Runs of consecutive pack positions given to ranks.

    Run i holds positions `[start[i], start[i] + length[i])` on rank `rank[i]`; its first token
    sits at `offset[i]` within its segment, which fixes its cost. (Two pieces of one segment that
    end up adjacent on one rank form one kernel run; counting them as two overestimates a little.)
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

    def cost_per_rank(self, cp_size: int, kernel_cost: KernelCost) -> np.ndarray:
        """Predicted cost per rank, without the per-call constant (`KernelCost.run_cost` summed)."""
        return np.bincount(self.rank, weights=kernel_cost.run_cost(self.offset, self.length), minlength=cp_size)

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


def _contiguous_pieces(bounds: np.ndarray, cp_size: int, local_len: int) -> Pieces:
    """Contiguous chunks as pieces: the segments cut at the G - 1 rank boundaries."""
    cuts = np.arange(cp_size + 1, dtype=np.int64) * local_len
    points = np.union1d(bounds, cuts)
    lo, hi = points[:-1], points[1:]
    seg_start = bounds[np.searchsorted(bounds, lo, side="right") - 1]
    return Pieces(lo // local_len, lo, hi - lo, lo - seg_start)


def _snake_singles(starts: np.ndarray, seg: np.ndarray, tok_offset: np.ndarray, cp_size: int) -> Pieces:
    """Single tokens dealt in snake order by decreasing offset (their pair count): only right when splits are free."""
    order = np.argsort(-tok_offset, kind="stable")
    i = np.arange(seg.size)
    lane = i % cp_size
    snake = np.where((i // cp_size) % 2 == 0, lane, cp_size - 1 - lane)
    return Pieces(snake.astype(np.int64), starts[seg][order] + tok_offset[order], np.ones(seg.size, dtype=np.int64),
                  tok_offset[order])


def _zigzag_pieces(starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int, kernel_cost: KernelCost) -> Pieces:
    """Every segment head-tail over all G ranks; the middle leftovers (< 2G tokens each) fill the rows left.

    For the pair count they are dealt token by token in snake order (the bound of the module
    docstring); for a kernel cost, single-token runs would each pay a run's overhead, so the
    leftover runs are cut into the free rows, most expensive first, lowest cost first."""
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
    if kernel_cost.splits_are_free:
        seg = np.repeat(np.arange(lengths.size), rem)
        first = np.cumsum(rem) - rem
        tok_offset = cp_size * chunk[seg] + np.arange(seg.size) - first[seg]
        return Pieces.concat([chunks, _snake_singles(starts, seg, tok_offset, cp_size)])
    has_rem = rem > 0
    middle = Pieces(
        np.zeros(int(has_rem.sum()), dtype=np.int64),
        starts[has_rem] + cp_size * chunk[has_rem],
        rem[has_rem],
        cp_size * chunk[has_rem],
    )
    order = np.argsort(-kernel_cost.run_cost(middle.offset, middle.length), kind="stable")
    middle = Pieces(*(getattr(middle, f)[order] for f in ("rank", "start", "length", "offset")))
    work = chunks.cost_per_rank(cp_size, kernel_cost)
    used = np.bincount(chunks.rank, weights=chunks.length, minlength=cp_size).astype(np.int64)
    greedy = _Greedy(cp_size, local_len, 0.0, 0.0, kernel_cost)
    greedy.work, greedy.free = work.tolist(), (local_len - used).tolist()
    return Pieces.concat([chunks, greedy.fill(middle)])


class _Greedy:
    """State of the greedy: per-rank cost and free rows, and the runs placed so far."""

    def __init__(self, cp_size: int, local_len: int, total_cost: float, budget_factor: float, kernel_cost: KernelCost):
        self.g = cp_size
        self.cost_model = kernel_cost
        self.work = [0.0] * cp_size  # predicted cost so far
        self.free = [local_len] * cp_size
        # Rows not placed yet, and their cost as whole runs: what splits add is not foreseen, so
        # it shows in `work` when it happens and the mean key grows by it.
        self.left_work = total_cost
        self.left_rows = cp_size * local_len
        self.budget_factor = budget_factor
        self.fill_density: float | None = None
        self.placed: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        self.unplaced: list[tuple[int, int, int]] = []  # (start, length, offset)

    def cost(self, offset, length):
        return self.cost_model.run_cost(offset, length)

    @property
    def density(self) -> float:
        """Cost per row that free rows are expected to receive: the mean of everything not placed yet,
        or less, `fill_density` (the filler's), when splits add cost (then a rank holding dear rows
        should get cheap ones later, not a split document)."""
        mean = self.left_work / self.left_rows if self.left_rows else 0.0
        return min(mean, self.fill_density) if self.fill_density is not None else mean

    def key(self, r: int) -> float:
        """Cost rank r is heading for: its cost plus its free rows at the unplaced mass's density.

        The keys always sum to the total cost placed or expected, so their mean is about the target T."""
        return self.work[r] + self.density * self.free[r]

    def _put(self, r: int, start: int, length: int, offset: int, cost: float) -> None:
        ranks, starts, lengths, offsets = self.placed
        ranks.append(r), starts.append(start), lengths.append(length), offsets.append(offset)
        self.work[r] += cost
        self.free[r] -= length
        self.left_rows -= length

    @property
    def budget(self) -> float:
        """(1 + 0.75 tolerance) x the mean key. The keys' sum grows by what splits add (their extra
        tiles and runs), so the budget follows the mean instead of staying at the unsplit T."""
        return self.budget_factor * (sum(self.work) + self.left_work) / self.g

    def place(self, start: int, length: int, offset: int = 0) -> None:
        """Place one run whole if that stays within budget, else zig-zag it over the fewest lowest-key
        ranks if that lowers the peak key; what fits nowhere is left for the filler."""
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
        cost = float(self.cost(offset, length))
        whole_peak = best_key + cost - density * length
        budget = self.budget
        # Runs too short to split, and the middle leftovers of split segments, go whole regardless.
        if best >= 0 and (whole_peak <= budget or length < 4 or offset > 0):
            self.left_work -= cost
            self._put(best, start, length, offset, cost)
            return
        split = self._best_split(keys, density, length, budget) if offset == 0 else None
        if split is not None and split[0] < whole_peak:
            self._apply_split(start, length, *split[1:])
        elif best >= 0:
            self.left_work -= cost
            self._put(best, start, length, offset, cost)
        else:
            self.unplaced.append((start, length, offset))

    def _best_split(self, keys: list[float], density: float, length: int, budget: float):
        """(peak key, ranks, k, pair order) of zig-zag over the k lowest-key ranks with room, k the
        smallest within budget (else the lowest peak); None if no k has room.

        Head-tail pairs (chunks i and 2k-1-i) hold the same pairs; under a kernel cost they differ a
        little (tile alignment, key tiles), so the dearest pair goes to the lowest key."""
        order = sorted(range(self.g), key=keys.__getitem__)
        free = self.free
        best = None
        # Each of k ranks gains about excess / k, so no k below excess / (budget - lowest key) can fit.
        excess = float(self.cost(0, length)) - density * length
        room = budget - keys[order[0]]
        k_low = max(2, int(excess // room)) if room > 0 else self.g
        for k in range(min(k_low, self.g, length // 2), min(self.g, length // 2) + 1):
            chunk = length // (2 * k)
            rem = length - 2 * k * chunk
            ranks = [r for r in order if free[r] >= 2 * chunk][:k]
            if len(ranks) < k:
                continue
            i = np.arange(k, dtype=np.int64)
            pair_cost = self.cost(i * chunk, chunk) + self.cost(rem + (2 * k - 1 - i) * chunk, chunk)
            dearest = np.argsort(-pair_cost, kind="stable")  # pair dearest[j] goes to ranks[j]
            peak = max(keys[r] + float(pair_cost[p]) for r, p in zip(ranks, dearest)) - density * 2 * chunk
            if best is None or peak < best[0]:
                best = (peak, ranks, k, dearest)
            if peak <= budget:
                break
        return best

    def _apply_split(self, start: int, length: int, ranks: list[int], k: int, dearest: np.ndarray) -> None:
        chunk = length // (2 * k)
        rem = length - 2 * k * chunk
        # The segment leaves the unplaced estimate, but for its middle leftover, which `place` takes next.
        self.left_work -= float(self.cost(0, length)) - (float(self.cost(k * chunk, rem)) if rem else 0.0)
        for r, p in zip(ranks, dearest.tolist()):
            head, tail = p * chunk, rem + (2 * k - 1 - p) * chunk
            self._put(r, start + head, chunk, head, float(self.cost(head, chunk)))
            self._put(r, start + tail, chunk, tail, float(self.cost(tail, chunk)))
        if rem:
            self.place(start + k * chunk, rem, k * chunk)

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


def _greedy_pieces(
    starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int, tolerance: float, kernel_cost: KernelCost
) -> Pieces:
    """Step 2 of the module docstring: whole segments by key, zig-zag over few ranks where needed, filler last."""
    work = kernel_cost.run_cost(0, lengths)
    mean = float(work.sum()) / cp_size
    by_length = np.argsort(-lengths, kind="stable")
    is_filler = work[by_length] - kernel_cost.per_run <= _FILLER_SHARE * tolerance * mean
    large, small = by_length[~is_filler], by_length[is_filler]
    greedy = _Greedy(cp_size, local_len, float(work.sum()), 1.0 + _BUDGET_SHARE * tolerance, kernel_cost)
    if not kernel_cost.splits_are_free and small.size:
        greedy.fill_density = float(work[small].sum()) / float(lengths[small].sum())
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


def _refine(pieces: Pieces, cp_size: int, kernel_cost: KernelCost, max_moves: int, stop_ratio: float = 1.0) -> Pieces:
    """Step 4 of the module docstring: lower the dearest rank by swapping rows with cheaper ranks.

    A move gives the last x rows of a run on the dearest rank (its dearest rows: they see the most
    keys) for the first x rows of a run on a cheaper rank, x equal both ways so every rank keeps L
    rows. Among every pair of runs and a grid of x (tile multiples, refined once around the best),
    it takes the move with the lowest resulting max of the two ranks' costs, if that is below the
    dearest rank's cost now; the cheapest rank is tried first. Every cost is `KernelCost.run_cost`
    of the runs as they stand, so the max never rises. Each swap splits runs (more split documents,
    more needed-only bytes), so it stops once the peak is within `stop_ratio` x the mean."""
    rank, start, length, offset = (pieces.rank.copy(), pieces.start.copy(), pieces.length.copy(), pieces.offset.copy())
    run_cost = kernel_cost.run_cost
    step_x = max(kernel_cost.tile_q, 1)
    for _ in range(max_moves):
        per_run = run_cost(offset, length)
        costs = np.bincount(rank, weights=per_run, minlength=cp_size)
        hi = int(np.argmax(costs))
        target = costs[hi]
        if target <= stop_ratio * costs.mean():
            break
        move = None
        # The candidates: hi's dearest runs and each cheaper rank's longest (bounded work per move).
        a = np.flatnonzero((rank == hi) & (length > 0))
        a = a[np.argsort(-per_run[a], kind="stable")[:_REFINE_RUNS]]
        for lo in np.argsort(costs, kind="stable").tolist():
            if lo == hi or costs[lo] >= target:
                break
            b = np.flatnonzero((rank == lo) & (length > 0))
            if not a.size or not b.size:
                continue
            b = b[np.argsort(-length[b], kind="stable")[:_REFINE_RUNS]]
            la, lb = length[a][:, None], length[b][None, :]
            most = np.minimum(la, lb)  # [A, B]: the rows a swap of these two runs can move
            best = None
            for grid in range(2):
                if grid == 0:
                    frac = np.linspace(0.0, 1.0, 17)[1:]
                    x = np.maximum(1, np.round(frac[None, None, :] * most[..., None] / step_x) * step_x)
                else:  # a finer grid around the best x of each pair
                    centre = best_x[..., None]
                    span = np.maximum(most[..., None] / 16.0, 1)
                    x = np.round(centre + span * np.linspace(-1.0, 1.0, 17)[None, None, :])
                x = np.clip(x, 1, most[..., None]).astype(np.int64)
                oa, ob = offset[a][:, None, None], offset[b][None, :, None]
                la3, lb3 = la[..., None], lb[..., None]
                ca, cb = per_run[a][:, None, None], per_run[b][None, :, None]
                # hi keeps a's head and takes b's head; lo keeps b's tail and takes a's tail.
                new_hi = target - ca + run_cost(oa, la3 - x) + run_cost(ob, x)
                new_lo = costs[lo] - cb + run_cost(ob + x, lb3 - x) + run_cost(oa + la3 - x, x)
                peak = np.maximum(new_hi, new_lo)
                best_x = np.take_along_axis(x, np.argmin(peak, axis=2)[..., None], axis=2)[..., 0]
                flat = int(np.argmin(peak))
                i, j, k = np.unravel_index(flat, peak.shape)
                if best is None or peak[i, j, k] < best[0]:
                    best = (float(peak[i, j, k]), int(a[i]), int(b[j]), int(x[i, j, k]))
            if best[0] < target * (1.0 - 1e-4):
                move = (lo, *best[1:])
                break
        if move is None:
            break
        lo, ia, ib, x = move
        # a's tail (last x rows) goes to lo, b's head (first x rows) to hi: two new runs.
        rank = np.append(rank, [lo, hi])
        start = np.append(start, [start[ia] + length[ia] - x, start[ib]])
        length = np.append(length, [x, x])
        offset = np.append(offset, [offset[ia] + length[ia] - x, offset[ib]])
        length[ia] -= x
        start[ib] += x
        offset[ib] += x
        length[ib] -= x
    keep = length > 0
    return Pieces(rank[keep], start[keep], length[keep], offset[keep])


def balanced_slot_positions(
    boundaries: torch.Tensor,
    cp_size: int,
    tolerance: float = DEFAULT_TOLERANCE,
    kernel_cost: KernelCost = DEFAULT_KERNEL_COST,
) -> torch.Tensor:
    """`[G, L]` slot positions of the balanced layout of a padded pack with segment `boundaries` `[0, ..., S_pad]`."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0; got {tolerance!r}")
    if not isinstance(kernel_cost, KernelCost):
        raise TypeError(f"kernel_cost must be a planning.KernelCost; got {type(kernel_cost).__name__}")
    bounds = boundaries.detach().cpu().numpy().astype(np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    s_pad = int(bounds[-1])
    local_len = s_pad // cp_size
    contiguous = _contiguous_pieces(bounds, cp_size, local_len).cost_per_rank(cp_size, kernel_cost)
    # T: every segment whole, divided by G (for the pair count the same as any layout's mean).
    target = float(kernel_cost.run_cost(0, lengths).sum()) / cp_size
    limit = (1.0 + tolerance) * target
    if cp_size == 1 or contiguous.max() <= limit:
        return torch.arange(s_pad).view(cp_size, local_len)
    moves, stop = _REFINE_MOVES * cp_size, 1.0 + _REFINE_SHARE * tolerance
    greedy = _greedy_pieces(starts, lengths, cp_size, local_len, tolerance, kernel_cost)
    greedy_max = greedy.cost_per_rank(cp_size, kernel_cost).max()
    if greedy_max <= limit:
        return _refine(greedy, cp_size, kernel_cost, moves, stop).slot_positions(cp_size, local_len)
    zigzag = _zigzag_pieces(starts, lengths, cp_size, local_len, kernel_cost)
    zigzag_max = zigzag.cost_per_rank(cp_size, kernel_cost).max()
    best = min(contiguous.max(), greedy_max, zigzag_max)
    if contiguous.max() == best:
        return torch.arange(s_pad).view(cp_size, local_len)
    chosen = _refine(greedy if greedy_max == best else zigzag, cp_size, kernel_cost, moves, stop)
    peak = chosen.cost_per_rank(cp_size, kernel_cost).max()
    if not kernel_cost.splits_are_free and peak > (1.0 + _RETRY_ABOVE * tolerance) * target:
        chosen = _retry_greedy(chosen, peak, starts, lengths, cp_size, local_len, tolerance, kernel_cost, moves, stop)
    return chosen.slot_positions(cp_size, local_len)


def _retry_greedy(chosen: Pieces, chosen_peak: float, starts, lengths, cp_size: int, local_len: int, tolerance: float,
                  kernel_cost: KernelCost, moves: int, stop: float) -> Pieces:
    """Step 5 of the module docstring: greedy candidates with looser budgets, for a layout above (1 + 2 eps) T.

    Under a kernel cost the greedy is sensitive to its budget: near the end, when every key is close
    to it, a long document can be zig-zagged over all G ranks (32 chunks of 321 tokens for a 10k
    document at G = 16), which adds more key tiles and runs than it evens out. A looser budget
    places such documents whole or over fewer ranks. The candidates with the lowest greedy peaks are
    refined like the first layout; one replaces it only if its predicted peak is lower by more than
    `_RETRY_GAIN`, so layouts the first pass already balanced stay as they are."""
    greedy = [_greedy_pieces(starts, lengths, cp_size, local_len, tolerance * f, kernel_cost) for f in _RETRY_FACTORS]
    # Refinement costs about 3x a greedy pass: only the _RETRY_REFINED candidates with the lowest greedy peaks are refined.
    greedy.sort(key=lambda g: g.cost_per_rank(cp_size, kernel_cost).max())
    best = chosen_peak * (1.0 - _RETRY_GAIN)
    for candidate in greedy[:_RETRY_REFINED]:
        candidate = _refine(candidate, cp_size, kernel_cost, moves, stop)
        peak = candidate.cost_per_rank(cp_size, kernel_cost).max()
        if peak < best:
            chosen, best = candidate, peak
    return chosen


register_layout_strategy("balanced", balanced_slot_positions)

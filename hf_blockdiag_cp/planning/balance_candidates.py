"""Candidate balanced layouts, as runs of pack positions given to ranks (`Pieces`).

Three constructions that `planning.balance` chooses from and then refines: contiguous chunks,
every segment zig-zagged over all G ranks, and a greedy that keeps short documents whole and
zig-zags a long one over as few ranks as its budget allows. How and why: docs/layouts.md, "How
the balanced layout is built". Pure planning: numpy and CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .kernel_cost import KernelCost

_FILLER_SHARE = 0.25  # filler segment: cost - per_run <= _FILLER_SHARE * tolerance * T
_BUDGET_SHARE = 0.75  # the greedy aims at (1 + 0.75 tolerance) x the mean key, leaving room for the filler's noise
_GOLDEN = 0.6180339887498949


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


def contiguous_pieces(bounds: np.ndarray, cp_size: int, local_len: int) -> Pieces:
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


def zigzag_pieces(starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int, kernel_cost: KernelCost) -> Pieces:
    """Every segment head-tail over all G ranks; the middle leftovers (< 2G tokens each) fill the rows left.

    For the pair count they are dealt token by token in snake order (which gives the pair bound,
    docs/layouts.md); for a kernel cost, single-token runs would each pay a run's overhead, so the
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


def greedy_pieces(
    starts: np.ndarray, lengths: np.ndarray, cp_size: int, local_len: int, tolerance: float, kernel_cost: KernelCost
) -> Pieces:
    """The greedy candidate: segments longest first, whole on the lowest-key rank or zig-zagged over few
    ranks where the budget (1 + 0.75 tolerance) requires it; short (filler) segments cut into the rows left."""
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

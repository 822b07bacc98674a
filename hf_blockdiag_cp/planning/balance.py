"""The "balanced" layout strategy: which pack positions each CP rank holds, so that every rank
takes about the same attention time.

With contiguous chunks the rank holding the end of a long document does most of its work. This
strategy evens out each rank's predicted kernel cost (`KernelCost`; with `PAIR_COUNT`, allowed
pairs, within a proven bound), keeps L = S_pad / G rows per rank in pack order, and is never
predicted dearer than contiguous chunks. Steps, reasons and the bound: docs/layouts.md, "How the
balanced layout is built"; the candidates it chooses from: `balance_candidates`. Pure planning.
"""

from __future__ import annotations

import numpy as np
import torch

from .balance_candidates import Pieces, contiguous_pieces, greedy_pieces, zigzag_pieces
from .kernel_cost import DEFAULT_KERNEL_COST, KernelCost
from .layout import DEFAULT_TOLERANCE, register_layout_strategy

_REFINE_MOVES = 2  # row swaps per rank at most in the refinement
_REFINE_SHARE = 0.1  # the refinement stops at max/mean <= 1 + 0.1 tolerance (each swap splits runs)
_REFINE_RUNS = 12  # runs per rank a swap considers (the dearest on the dearest rank, the longest on the other)
# Retry: when the refined layout's peak is above (1 + _RETRY_ABOVE tolerance) T, greedy candidates at
# _RETRY_FACTORS x the tolerance; the _RETRY_REFINED with the lowest greedy peaks are refined, and one
# replaces the layout only if it lowers the predicted peak by more than _RETRY_GAIN.
_RETRY_ABOVE = 2
_RETRY_FACTORS = (2, 4, 8, 16)
_RETRY_REFINED = 2
_RETRY_GAIN = 0.02


def _refine(pieces: Pieces, cp_size: int, kernel_cost: KernelCost, max_moves: int, stop_ratio: float = 1.0) -> Pieces:
    """Lower the dearest rank by swapping rows with cheaper ranks, at most `max_moves` times.

    A move gives the last x rows of a run on the dearest rank (its dearest rows: they see the most
    keys) for the first x rows of a run on a cheaper rank, x equal both ways so every rank keeps L
    rows (`_find_move`). Every cost is `KernelCost.run_cost` of the runs as they stand, so the
    maximum never rises. Each swap splits runs (more split documents, more needed-only bytes), so
    it stops once the peak is within `stop_ratio` x the mean."""
    rank, start, length, offset = (pieces.rank.copy(), pieces.start.copy(), pieces.length.copy(), pieces.offset.copy())
    for _ in range(max_moves):
        per_run = kernel_cost.run_cost(offset, length)
        costs = np.bincount(rank, weights=per_run, minlength=cp_size)
        hi = int(np.argmax(costs))
        if costs[hi] <= stop_ratio * costs.mean():
            break
        move = _find_move(rank, length, offset, per_run, costs, hi, kernel_cost)
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


def _find_move(rank, length, offset, per_run, costs, hi: int, kernel_cost: KernelCost):
    """(lo, run a on hi, run b on lo, x) of the first swap that lowers the peak, cheapest rank tried first; else None.

    The candidates (bounded work per move): hi's `_REFINE_RUNS` dearest runs and each cheaper
    rank's `_REFINE_RUNS` longest."""
    target = costs[hi]
    a = np.flatnonzero((rank == hi) & (length > 0))
    a = a[np.argsort(-per_run[a], kind="stable")[:_REFINE_RUNS]]
    for lo in np.argsort(costs, kind="stable").tolist():
        if lo == hi or costs[lo] >= target:
            break
        b = np.flatnonzero((rank == lo) & (length > 0))
        if not a.size or not b.size:
            continue
        b = b[np.argsort(-length[b], kind="stable")[:_REFINE_RUNS]]
        best = _best_swap(a, b, length, offset, per_run, target, costs[lo], kernel_cost)
        if best[0] < target * (1.0 - 1e-4):
            return (lo, *best[1:])
    return None


def _best_swap(a, b, length, offset, per_run, hi_cost, lo_cost, kernel_cost: KernelCost):
    """(peak, run a, run b, x) of the swap of runs a x b with the lowest max of the two ranks' costs.

    x runs over a grid of fractions of the rows the two runs can move (tile multiples), then a
    finer grid around the best x of each pair. hi keeps a's head and takes b's head; lo keeps b's
    tail and takes a's tail."""
    run_cost = kernel_cost.run_cost
    step_x = max(kernel_cost.tile_q, 1)
    la, lb = length[a][:, None], length[b][None, :]
    most = np.minimum(la, lb)  # [A, B]: the rows a swap of these two runs can move
    best = best_x = None  # best_x: the coarse grid's best x of each pair, the centre of the fine grid
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
        new_hi = hi_cost - ca + run_cost(oa, la3 - x) + run_cost(ob, x)
        new_lo = lo_cost - cb + run_cost(ob + x, lb3 - x) + run_cost(oa + la3 - x, x)
        peak = np.maximum(new_hi, new_lo)
        best_x = np.take_along_axis(x, np.argmin(peak, axis=2)[..., None], axis=2)[..., 0]
        i, j, k = np.unravel_index(int(np.argmin(peak)), peak.shape)
        if best is None or peak[i, j, k] < best[0]:
            best = (float(peak[i, j, k]), int(a[i]), int(b[j]), int(x[i, j, k]))
    return best


def balanced_slot_positions(
    boundaries: torch.Tensor,
    cp_size: int,
    tolerance: float = DEFAULT_TOLERANCE,
    kernel_cost: KernelCost = DEFAULT_KERNEL_COST,
) -> torch.Tensor:
    """`[G, L]` slot positions of the balanced layout of a padded pack with segment `boundaries` `[0, ..., S_pad]`.

    With T = the cost of every segment whole / G and eps = `tolerance` (docs/layouts.md, "How the
    balanced layout is built", steps 1-5): (1) contiguous chunks if their peak is within
    (1 + eps) T; (2) else the greedy, refined, if within (1 + eps) T; (3) else the lowest peak of
    contiguous, greedy and zig-zag (contiguous first on ties), (4) refined unless contiguous won,
    and (5) under a kernel cost, greedy retries with looser budgets above (1 + 2 eps) T."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0; got {tolerance!r}")
    if not isinstance(kernel_cost, KernelCost):
        raise TypeError(f"kernel_cost must be a planning.KernelCost; got {type(kernel_cost).__name__}")
    bounds = boundaries.detach().cpu().numpy().astype(np.int64)
    starts, lengths = bounds[:-1], np.diff(bounds)
    s_pad = int(bounds[-1])
    local_len = s_pad // cp_size
    contiguous = contiguous_pieces(bounds, cp_size, local_len).cost_per_rank(cp_size, kernel_cost)
    # T: every segment whole, divided by G (for the pair count the same as any layout's mean).
    target = float(kernel_cost.run_cost(0, lengths).sum()) / cp_size
    limit = (1.0 + tolerance) * target
    if cp_size == 1 or contiguous.max() <= limit:
        return torch.arange(s_pad).view(cp_size, local_len)
    moves, stop = _REFINE_MOVES * cp_size, 1.0 + _REFINE_SHARE * tolerance
    greedy = greedy_pieces(starts, lengths, cp_size, local_len, tolerance, kernel_cost)
    greedy_max = greedy.cost_per_rank(cp_size, kernel_cost).max()
    if greedy_max <= limit:
        return _refine(greedy, cp_size, kernel_cost, moves, stop).slot_positions(cp_size, local_len)
    zigzag = zigzag_pieces(starts, lengths, cp_size, local_len, kernel_cost)
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
    """Step 5: greedy candidates at `_RETRY_FACTORS` x the tolerance, for a layout above (1 + 2 eps) T.

    Under a kernel cost the greedy is sensitive to its budget: near the end, when every key is close
    to it, a long document can be zig-zagged over all G ranks, which adds more key tiles and runs
    than it evens out; a looser budget places it whole or over fewer ranks. The `_RETRY_REFINED`
    candidates with the lowest greedy peaks are refined like the first layout (refining is the
    dear part); one replaces it only if its predicted peak is lower by more than `_RETRY_GAIN`,
    so layouts the first pass already balanced stay as they are."""
    greedy = [greedy_pieces(starts, lengths, cp_size, local_len, tolerance * f, kernel_cost) for f in _RETRY_FACTORS]
    greedy.sort(key=lambda g: g.cost_per_rank(cp_size, kernel_cost).max())
    best = chosen_peak * (1.0 - _RETRY_GAIN)
    for candidate in greedy[:_RETRY_REFINED]:
        candidate = _refine(candidate, cp_size, kernel_cost, moves, stop)
        peak = candidate.cost_per_rank(cp_size, kernel_cost).max()
        if peak < best:
            chosen, best = candidate, peak
    return chosen


register_layout_strategy("balanced", balanced_slot_positions)

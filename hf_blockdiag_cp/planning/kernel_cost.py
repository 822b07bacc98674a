"""The one home of query-run arithmetic: allowed pairs, and what a tiled kernel spends on a run.

Pure planning (numpy only: no torch.distributed, no kernels, no layout). A run of q queries at
in-segment offset a sees the k = a + q keys of its segment up to its last query, bottom-right
causal (query i sees keys 0 .. a + i):
  pairs  allowed query-key pairs, q(2a + q + 1)/2 (`run_pairs`): the mask's true entries.
  cost   what a tiled varlen kernel spends on it (`KernelCost.run_cost`): tiles of
         tile_q x tile_k holding at least one allowed pair, plus fixed overheads per run and
         per query / key tile, in units of one full tile. A rank's local attention time is
         about (per_call + the sum over its runs) x `ms_per_tile`.
Kernel records carry calibrated constants (`kernels/calibration.json`, with the commands that refit
them; docs/layouts.md, "Calibration").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


def run_pairs(offset, length):
    """Pairs of a run of `length` queries starting at in-segment `offset`: sum of offset+1 .. offset+length."""
    return length * (2 * offset + length + 1) // 2


def _floor_sum(n: np.ndarray, m: int, a: int, b: np.ndarray) -> np.ndarray:
    """sum_{i=0}^{n-1} floor((a·i + b) / m) per element (n, b >= 0 arrays; a >= 0, m > 0 scalars).

    The Euclid-like reduction of AtCoder's floor_sum, vectorised: (a, m) follow Euclid's algorithm
    on the scalars alone, so only n and b vary per element; O(log m) numpy steps."""
    n = np.asarray(n, dtype=np.int64).copy()
    b = np.asarray(b, dtype=np.int64).copy()
    out = np.zeros(np.broadcast(n, b).shape, dtype=np.int64)
    n, b = np.broadcast_to(n, out.shape).copy(), np.broadcast_to(b, out.shape).copy()
    active = n > 0
    while active.any():
        if a >= m:
            out += np.where(active, (n - 1) * n // 2 * (a // m), 0)
            a %= m
        out += np.where(active & (b >= m), n * (b // m), 0)
        b %= m
        y_max = a * n + b
        active &= y_max >= m
        n, b = y_max // m, y_max % m
        m, a = a, m
    return out


@dataclass(frozen=True)
class KernelCost:
    """Predicted local attention time (forward + backward) of a tiled varlen kernel, in units of one full tile.

    run_cost = per_tile·tiles + per_run + per_q_tile·ceil(q / tile_q) + per_k_tile·ceil(k / tile_k)
    for a run of q queries against its k keys. `tiles` counts the tile_q x tile_k blocks of the
    run's bottom-right causal block that hold at least one allowed pair (the kernel computes
    those, masked or not); the key-tile term is the backward's per key block work (load K/V,
    write dK/dV), which makes a short run late in a long document dear. A rank costs
    per_call + the sum over its runs; per_call (launches, full-size gradient buffers) is the
    same on every rank, so it never changes a layout, only predicted ratios to the ideal.
    `ms_per_tile` turns cost into milliseconds for the calibration's shape; `source` says where
    the constants come from. The defaults are the varlen starting values (docs/layouts.md,
    "Calibration"); `PAIR_COUNT` (1 x 1 tiles, no overheads) counts allowed pairs.
    """

    tile_q: int = 128
    tile_k: int = 128
    per_tile: float = 1.0
    # Defaults: the varlen calibration on the H200 (kernels/calibration.json, 2026-12-01), rounded.
    per_run: float = 10.8
    per_q_tile: float = 0.0
    per_k_tile: float = 1.32
    per_call: float = 94.7
    ms_per_tile: float = 2.84e-3
    source: str = "varlen's calibration, rounded: bench ranks --calibrate-from, one NVIDIA H200, torch 2.11.0+cu130, 2026-12-01"

    def __post_init__(self):
        for name in ("tile_q", "tile_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KernelCost.{name} must be a positive integer; got {value!r}")
        for name in ("per_tile", "per_run", "per_q_tile", "per_k_tile", "per_call", "ms_per_tile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"KernelCost.{name} must be a number >= 0; got {value!r}")
        if not self.per_tile > 0:
            raise ValueError(f"KernelCost.per_tile must be > 0 (the unit of cost); got {self.per_tile!r}")
        if not isinstance(self.source, str):
            raise TypeError(f"KernelCost.source must be a string; got {type(self.source).__name__}")

    @staticmethod
    def from_dict(values: dict) -> "KernelCost":
        """A KernelCost from a JSON object (unknown keys are a ValueError naming them)."""
        known = {f.name for f in fields(KernelCost)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown KernelCost fields {unknown}; known: {', '.join(sorted(known))}")
        return KernelCost(**values)

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def splits_are_free(self) -> bool:
        """True for the pair count: cutting a run in pieces never changes the total cost."""
        return self.tile_q == self.tile_k == 1 and self.per_run == self.per_q_tile == self.per_k_tile == 0

    def run_tiles(self, offset, length) -> np.ndarray:
        """Tiles holding at least one allowed pair, of runs of `length` queries at in-segment `offset`.

        Query tile t (rows t·tile_q ..) reaches key offset + min(q, (t+1)·tile_q) - 1 and starts
        at key tile 0, so it touches ceil((offset + min(q, (t+1)·tile_q)) / tile_k) key tiles."""
        offset = np.asarray(offset, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        tq, tk = self.tile_q, self.tile_k
        full = length // tq
        if tq == tk:  # query tile t (1-based) touches t + ceil(offset / tile) key tiles
            tiles = full * (full + 1) // 2 + full * (-(-offset // tk))
        else:
            tiles = _floor_sum(full, tk, tq, offset + tq + tk - 1)
        partial = (length % tq) > 0
        return tiles + np.where(partial, -(-(offset + length) // tk), 0)

    def run_features(self, offset, length) -> dict[str, np.ndarray]:
        """Per run: what `run_cost` weighs (runs, tiles, q_tiles, k_tiles) and its pairs."""
        offset = np.asarray(offset, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        return {
            "runs": (length > 0).astype(np.int64),
            "tiles": self.run_tiles(offset, length),
            "q_tiles": -(-length // self.tile_q),
            "k_tiles": np.where(length > 0, -(-(offset + length) // self.tile_k), 0),
            "pairs": run_pairs(offset, length),
        }

    def run_cost(self, offset, length) -> np.ndarray:
        """Predicted cost (float, units of one full tile) of runs of `length` queries at in-segment `offset`."""
        f = self.run_features(offset, length)
        return (self.per_tile * f["tiles"] + self.per_run * f["runs"] + self.per_q_tile * f["q_tiles"]
                + self.per_k_tile * f["k_tiles"])


PAIR_COUNT = KernelCost(
    tile_q=1, tile_k=1, per_tile=1.0, per_run=0.0, per_q_tile=0.0, per_k_tile=0.0, per_call=0.0, ms_per_tile=0.0,
    source="allowed query-key pairs",
)
DEFAULT_KERNEL_COST = KernelCost()

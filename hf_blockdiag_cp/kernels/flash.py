"""flash-attn kernel (`flash_attn.flash_attn_varlen_func`). Experimental: not verified on a GPU.

Same segments as the torch varlen kernel: one varlen segment per run of local queries of one
document, its keys from the document's start (or the window's) to the run's last query. A run
that continues a document begun before it (on another rank, or earlier in a head-tail
layout) has more keys than queries, and its causal mask must be aligned bottom-right
(query i of q sees keys up to i + k - q). flash-attn >= 2.1 aligns `causal=True` that way,
so one call does everything. Older releases (and builds that follow them) align top-left,
which would silently hide those keys; for them `split_asymmetric_segments` peels every
segment with keys > queries out of the batched call: only square segments (where both
alignments agree) go to the one varlen call, and each peeled segment runs alone with its
queries preceded by keys - queries placeholder rows, which makes it square too. The
placeholders' outputs are dropped (so they receive no gradient): exact, at the cost of the
placeholder rows' work.

GQA is native (flash-attn takes fewer K/V heads); no softcap, no sinks.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

from ..state import CPStep


@functools.cache
def _flash_module():
    """The imported `flash_attn` package, or None when it does not import (not installed, broken build)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_func, flash_attn_varlen_func  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means the backend is unavailable
        return None
    return flash_attn


def available() -> bool:
    return _flash_module() is not None


def causal_is_bottom_right(version: str) -> bool:
    """Whether flash-attn `version` aligns `causal=True` bottom-right (changed in 2.1.0)."""
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) or "0"
        parts.append(int(digits))
    while len(parts) < 2:
        parts.append(0)
    return tuple(parts) >= (2, 1)


# None: decide from flash_attn.__version__; True / False force it (a build that differs from its version).
CAUSAL_BOTTOM_RIGHT: bool | None = None


def _bottom_right() -> bool:
    if CAUSAL_BOTTOM_RIGHT is not None:
        return CAUSAL_BOTTOM_RIGHT
    return causal_is_bottom_right(getattr(_flash_module(), "__version__", "0"))


# --------------------------------------------------------------------------- the peel (pure)


@dataclass(frozen=True)
class FlashSplit:
    """Square segments for one batched causal call, and the asymmetric ones peeled off.

    `peeled[i] = (q_start, q_stop, k_start, k_stop)` of a segment with more keys than queries.
    `q_rows` / `k_rows` select the square segments' query and key rows (a `(start, stop)`
    range when contiguous, else an int64 index tensor; None when every segment is peeled),
    `cu_seqlens` (int32, the same for queries and keys) and `max_seqlen` describe them. The
    kernel concatenates its outputs as [peeled segments in order, batched rows]; `inverse`
    puts that back in query order (None when it already is).
    """

    peeled: tuple[tuple[int, int, int, int], ...]
    q_rows: tuple[int, int] | torch.Tensor | None
    k_rows: tuple[int, int] | torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    inverse: torch.Tensor | None

    def to(self, device: torch.device) -> "FlashSplit":
        def move(t):
            return t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t

        return FlashSplit(
            self.peeled, move(self.q_rows), move(self.k_rows), move(self.cu_seqlens), self.max_seqlen, move(self.inverse)
        )


def _rows(cu: torch.Tensor, segments: torch.Tensor) -> tuple[int, int] | torch.Tensor:
    """Rows of the given segments of `cu`, as a range when they are consecutive."""
    starts, stops = cu[segments], cu[segments + 1]
    if bool((starts[1:] == stops[:-1]).all()):
        return int(starts[0]), int(stops[-1])
    lengths = stops - starts
    return torch.arange(int(lengths.sum())) + torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)


def split_asymmetric_segments(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> FlashSplit:
    """Peel every segment with more keys than queries off the batched causal call (see the module doc).

    Takes the host (CPU) offsets of a validated plan (`validate_rank_plan`): keys >= queries in
    every segment. Pure; O(segments).
    """
    cu_q, cu_k = cu_seqlens_q.reshape(-1).long().cpu(), cu_seqlens_k.reshape(-1).long().cpu()
    q_lens, k_lens = cu_q[1:] - cu_q[:-1], cu_k[1:] - cu_k[:-1]
    if bool((k_lens < q_lens).any()):
        raise ValueError("split_asymmetric_segments: every segment needs at least as many keys as queries")
    asym = k_lens > q_lens
    peeled_ids = torch.nonzero(asym).reshape(-1)
    square_ids = torch.nonzero(~asym).reshape(-1)
    peeled = tuple(
        (int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])) for i in peeled_ids.tolist()
    )
    if square_ids.numel() == 0:
        q_rows = k_rows = cu = None
        max_seqlen = 0
        batched_q = torch.zeros(0, dtype=torch.long)
    else:
        q_rows, k_rows = _rows(cu_q, square_ids), _rows(cu_k, square_ids)
        lens = q_lens[square_ids]
        cu = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens, 0)]).to(torch.int32)
        max_seqlen = int(lens.max())
        batched_q = torch.arange(*q_rows) if isinstance(q_rows, tuple) else q_rows
    order = torch.cat([torch.arange(a, b) for a, b, _, _ in peeled] + [batched_q])
    identity = bool((order == torch.arange(order.numel())).all())
    return FlashSplit(peeled, q_rows, k_rows, cu, max_seqlen, None if identity else torch.argsort(order))


def _take(t: torch.Tensor, rows) -> torch.Tensor:
    if isinstance(rows, tuple):
        return t[rows[0] : rows[1]]
    return t.index_select(0, rows)


# --------------------------------------------------------------------------- the kernel


@functools.cache
def _accepts_window() -> bool:
    fa = _flash_module()
    return fa is not None and "window_size" in inspect.signature(fa.flash_attn_varlen_func).parameters


def _window_kwargs(sliding_window: int | None) -> dict:
    if sliding_window is None:
        return {}
    if not _accepts_window():
        raise ValueError(
            "attn_backend='flash': this flash-attn release has no window_size argument (added in 2.3), so it cannot "
            "run a sliding-window layer; upgrade flash-attn or use attn_backend='varlen' / 'flex'"
        )
    return {"window_size": (sliding_window - 1, 0)}


def flash_attention_kernel(q, k, v, step: CPStep, *, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [L,H,D], k [K,Hkv,D], v [K,Hkv,D] -> [L,H,D]."""
    fa = _flash_module()
    if fa is None:
        raise ValueError("attn_backend='flash' needs the flash-attn package, which does not import here")
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    window = _window_kwargs(sliding_window)
    plan = step.plan
    if _bottom_right():
        return fa.flash_attn_varlen_func(
            q, k, v, plan.cu_seqlens_q, plan.cu_seqlens_k, plan.max_seqlen_q, plan.max_seqlen_k,
            softmax_scale=scale, causal=True, **window,
        )
    # Top-left causal alignment: peel asymmetric segments (host offsets, once per step: no device sync).
    split = step.cached(
        ("flash_split", q.device),
        lambda: split_asymmetric_segments(step.rank_plan.cu_seqlens_q, step.rank_plan.cu_seqlens_k).to(q.device),
    )
    pieces = []
    for q_start, q_stop, k_start, k_stop in split.peeled:
        extra = (k_stop - k_start) - (q_stop - q_start)
        square_q = torch.cat([q.new_zeros(extra, *q.shape[1:]), q[q_start:q_stop]])
        out = fa.flash_attn_func(
            square_q[None], k[None, k_start:k_stop], v[None, k_start:k_stop], softmax_scale=scale, causal=True, **window
        )
        pieces.append(out[0, extra:])
    if split.cu_seqlens is not None:
        kb = _take(k, split.k_rows)
        pieces.append(
            fa.flash_attn_varlen_func(
                _take(q, split.q_rows), kb, _take(v, split.k_rows), split.cu_seqlens, split.cu_seqlens,
                split.max_seqlen, split.max_seqlen, softmax_scale=scale, causal=True, **window,
            )
        )
    out = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out if split.inverse is None else out.index_select(0, split.inverse)

"""Packs and layouts for the planning and exchange tests: packs from runs of documents and
padding, every registered layout strategy plus a head-tail layout built here independently of
the library, and the hypothesis strategies that draw them."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import strategies as st

from hf_blockdiag_cp.planning import PAIR_COUNT, layout_strategies, plan_layout

LAYOUT_STRATEGIES = layout_strategies()


def pack_ids(runs: list[tuple[bool, int]]) -> torch.Tensor:
    """Document ids from runs of (is_padding, length): documents numbered 1.. in order, padding 0."""
    parts, doc = [], 0
    for is_pad, n in runs:
        if not is_pad:
            doc += 1
        parts.append(torch.full((n,), 0 if is_pad else doc))
    return torch.cat(parts)


def headtail_layout(ids: torch.Tensor, cp_size: int):
    """Zig-zag layout built here, independent of the library: rank r holds chunks r and 2G-1-r."""
    base = plan_layout(ids, cp_size)
    chunk = base.padded_seq_len // (2 * cp_size)
    rows = [
        torch.cat([torch.arange(r * chunk, (r + 1) * chunk), torch.arange((2 * cp_size - 1 - r) * chunk, (2 * cp_size - r) * chunk)])
        for r in range(cp_size)
    ]
    return dataclasses.replace(base, strategy="headtail", slot_positions=torch.stack(rows))


def make_layout(ids, cp_size, kind):
    return headtail_layout(ids, cp_size) if kind == "headtail" else plan_layout(ids, cp_size, kind, kernel_cost=PAIR_COUNT)


LAYOUT_KINDS = tuple(LAYOUT_STRATEGIES) + ("headtail",)

runs_strategy = st.lists(st.tuples(st.booleans(), st.integers(1, 24)), min_size=1, max_size=10)
window_strategy = st.one_of(st.none(), st.integers(1, 12))

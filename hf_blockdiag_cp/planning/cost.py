"""What a layout costs: per-rank attention work, real tokens and K/V bytes.

Pure planning. Work is the number of true entries of a rank's rows of the block-causal mask
(the cost model of `planning.balance`); bytes come from the exchange plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .exchange_plan import kv_row_bytes, plan_exchange
from .layout import Layout


def rank_work(layout: Layout) -> torch.Tensor:
    """`[G]` predicted attention work per rank: query-key pairs of the block-causal mask on its rows."""
    pos = layout.slot_positions
    return (pos - layout.segments.segment_starts[pos] + 1).sum(dim=1)


def split_documents(layout: Layout) -> int:
    """Number of real documents whose tokens sit on more than one rank."""
    g = layout.cp_size
    ids = layout.document_ids[layout.slot_positions]
    n_doc = int(layout.document_ids.max())
    if n_doc == 0:
        return 0
    present = torch.zeros(g, n_doc + 1, dtype=torch.bool)
    present[torch.arange(g)[:, None].expand_as(ids), ids] = True
    return int((present[:, 1:].sum(dim=0) > 1).sum())


@dataclass(frozen=True)
class LayoutCost:
    """What a layout costs each rank per attention layer (K/V bytes received in the forward;
    the backward receives as many for allgather, and each rank's sent rows for a2a)."""

    work: list[int]  # block-causal query-key pairs
    tokens: list[int]  # real (non-padding) rows
    allgather_bytes: list[int]  # every rank's rows to every rank
    a2a_bytes: list[int]  # exactly the needed remote rows (`exchange_plan`)
    halo_valid: bool  # whether left-neighbour halo exchange can serve the layout
    split_documents: int

    @property
    def imbalance(self) -> float:
        """max / mean of `work` (1.0 is perfect; the slowest rank sets the step time)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0


def layout_cost(
    layout: Layout, kv_heads: int = 8, head_dim_k: int = 128, head_dim_v: int = 128, bytes_per_element: int = 2
) -> LayoutCost:
    """Per-rank work, tokens and K/V bytes of `layout`; the defaults are 8 kv heads of dim 128 in bf16."""
    row_bytes = kv_row_bytes(kv_heads, head_dim_k, head_dim_v, bytes_per_element)
    plan = plan_exchange(layout)
    ranks = range(layout.cp_size)
    return LayoutCost(
        work=rank_work(layout).tolist(),
        tokens=layout.real_tokens_per_rank(),
        allgather_bytes=[plan.bytes_per_layer("allgather", r, row_bytes).forward for r in ranks],
        a2a_bytes=[plan.bytes_per_layer("a2a", r, row_bytes).forward for r in ranks],
        halo_valid=plan.halo_valid,
        split_documents=split_documents(layout),
    )

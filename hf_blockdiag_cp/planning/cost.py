"""What a layout costs: per-rank attention work, predicted kernel cost, real tokens and K/V bytes.

Pure planning. Work is the number of true entries of a rank's rows of the block-causal mask
(`overlap_work`: of the rows that attend while the exchange runs; `key_local_work`: of the
entries whose key the rank holds);
cost is what a tiled kernel is predicted to spend on the rank's query runs (`KernelCost`,
the arithmetic's home is `planning.kernel_cost`); bytes come from the exchange records
(`exchange_registry`) over the layout's exchange plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .exchange_plan import AttentionShape, plan_exchange
from .exchange_registry import exchange_records
from .kernel_cost import DEFAULT_KERNEL_COST, PAIR_COUNT, KernelCost, run_pairs  # noqa: F401  (re-exported)
from .layout import Layout
from .overlap import plan_overlap
from .rank_plan import plan_rank


def rank_work(layout: Layout) -> torch.Tensor:
    """`[G]` attention work per rank: query-key pairs of the block-causal mask on its rows."""
    pos = layout.slot_positions
    return (pos - layout.segments.segment_starts[pos] + 1).sum(dim=1)


def overlap_work(layout: Layout) -> torch.Tensor:
    """`[G]` attention work per rank that runs while its K/V exchange is in flight under
    `CPConfig(overlap=True)`: the query-key pairs of its local part (`plan_overlap`, all-gather rows)."""
    rows = layout.slot_positions.reshape(-1)
    work = []
    for rank in range(layout.cp_size):
        local = plan_overlap(layout, rank, plan_rank(layout, rank), rows).local
        if local is None:
            work.append(0)
            continue
        q_lens = (local.plan.cu_seqlens_q[1:] - local.plan.cu_seqlens_q[:-1]).long()
        k_lens = (local.plan.cu_seqlens_k[1:] - local.plan.cu_seqlens_k[:-1]).long()
        work.append(int(run_pairs(k_lens - q_lens, q_lens).sum()))
    return torch.tensor(work, dtype=torch.long)


def key_local_work(layout: Layout) -> torch.Tensor:
    """`[G]` attention work per rank over keys it holds: the query-key pairs of its rows whose key is on
    the rank too. What the split by keys (`plan_key_overlap`: the local keys while the exchange is in
    flight, the rest after it, merged by log-sum-exp) runs during the exchange; never less than
    `overlap_work`. A row
    at position p sees its segment from `segment_starts[p]` to p; the rank holds those of its rows
    from the first at or after that start to the row itself (rows are in increasing pack order)."""
    pos = layout.slot_positions
    first_held = torch.searchsorted(pos, layout.segments.segment_starts[pos].contiguous())
    return (torch.arange(pos.shape[1]) - first_held + 1).sum(dim=1)


def rank_runs(layout: Layout, rank: int) -> tuple[np.ndarray, np.ndarray]:
    """(in-segment offset, length) of each query run of `rank` (`Layout.query_runs`), as numpy int64."""
    first, last = layout.query_runs(rank)
    pos = layout.slot_positions[rank]
    offset = pos[first] - layout.segments.segment_starts[pos[first]]
    return offset.numpy().astype(np.int64), (last - first + 1).numpy().astype(np.int64)


def rank_features(layout: Layout, kernel_cost: KernelCost = DEFAULT_KERNEL_COST) -> list[dict[str, int]]:
    """Per rank, the sums over its query runs of `KernelCost.run_features` (what calibration fits on)."""
    out = []
    for r in range(layout.cp_size):
        features = kernel_cost.run_features(*rank_runs(layout, r))
        out.append({name: int(value.sum()) for name, value in features.items()})
    return out


def rank_cost(layout: Layout, kernel_cost: KernelCost = DEFAULT_KERNEL_COST) -> list[float]:
    """Per rank, predicted local attention cost: per_call + its runs' costs (units of one full tile; `KernelCost`)."""
    return [kernel_cost.per_call + float(kernel_cost.run_cost(*rank_runs(layout, r)).sum()) for r in range(layout.cp_size)]


def ideal_cost(layout: Layout, kernel_cost: KernelCost = DEFAULT_KERNEL_COST) -> float:
    """What one rank would spend on the whole pack (every segment one run), divided by G: the ideal per rank."""
    lengths = layout.segments.boundaries.diff().numpy().astype(np.int64)
    return (kernel_cost.per_call + float(kernel_cost.run_cost(0, lengths).sum())) / layout.cp_size


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
    """What a layout costs each rank per attention layer. `exchange_bytes` has, for every
    registered exchange that can serve the layout (and the heads, for a head-parallel one), the
    bytes each rank receives in the forward (the record's `rows_per_layer` says what the
    backward receives)."""

    work: list[int]  # block-causal query-key pairs
    cost: list[float]  # predicted kernel cost (`KernelCost`, units of one full tile)
    ideal: float  # the whole pack's cost on one rank / G (no run split)
    tokens: list[int]  # real (non-padding) rows
    exchange_bytes: dict[str, list[int]]  # exchange name -> forward bytes per rank
    split_documents: int

    @property
    def imbalance(self) -> float:
        """max / mean of `work` (1.0 is perfect; the slowest rank sets the step time)."""
        mean = sum(self.work) / len(self.work)
        return max(self.work) / mean if mean else 1.0

    @property
    def cost_imbalance(self) -> float:
        """max / mean of the predicted `cost`."""
        mean = sum(self.cost) / len(self.cost)
        return max(self.cost) / mean if mean else 1.0

    @property
    def over_ideal(self) -> float:
        """max predicted cost / `ideal`: the prediction of `bench ranks`' max_over_ideal (splits included)."""
        return max(self.cost) / self.ideal if self.ideal else 1.0


def layout_cost(
    layout: Layout,
    kv_heads: int = 8,
    head_dim_k: int = 128,
    head_dim_v: int = 128,
    bytes_per_element: int = 2,
    kernel_cost: KernelCost = DEFAULT_KERNEL_COST,
    heads: int | None = None,
) -> LayoutCost:
    """Per-rank work, predicted cost, tokens and exchange bytes of `layout`; the defaults are 8 kv
    heads of dim 128 in bf16. Exchanges whose rows carry query heads too (head-parallel) are
    listed only with `heads`, the query heads, and when they can split them over the ranks."""
    shape = AttentionShape(kv_heads if heads is None else heads, kv_heads, head_dim_k, head_dim_v, bytes_per_element)
    plan = plan_exchange(layout)
    ranks = range(layout.cp_size)
    return LayoutCost(
        work=rank_work(layout).tolist(),
        cost=rank_cost(layout, kernel_cost),
        ideal=ideal_cost(layout, kernel_cost),
        tokens=layout.real_tokens_per_rank(),
        exchange_bytes={
            x.name: [x.layer_bytes(plan, r, shape).forward for r in ranks]
            for x in exchange_records()
            if x.reason(plan) is None
            and (x.row_bytes is None or (heads is not None and x.heads_reason(heads, kv_heads, layout.cp_size) is None))
        },
        split_documents=split_documents(layout),
    )

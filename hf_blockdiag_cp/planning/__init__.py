"""Pure planning: document ids -> segments -> layout -> rank plans -> exchange plans -> cost.

No torch.distributed and no kernels: every function works on CPU integer tensors, so it is
tested exhaustively against dense masks and reused by the benchmarks. Modules, bottom up:
`segments` (runs and intervals, the one home of that arithmetic), `layout` (layout
strategies, registered by name), `balance` (the "balanced" strategy; its candidate layouts in
`balance_candidates`), `rank_plan` (one rank's queries, keys and varlen offsets),
`exchange_plan` (needed keys and traffic), `overlap` (what attends while the exchange runs: split by queries or by keys), `head_parallel` (the head-parallel exchange's head
split, plan and bytes), `exchange_registry` (one `ExchangeRecord` per exchange, registered by
`comm.exchanges`),
`kernel_cost` (what a tiled kernel spends on a query run: `KernelCost`, the one home of run
arithmetic), `cost` (work, predicted cost and bytes per rank).
"""

from . import balance  # noqa: F401  (registers the "balanced" layout strategy)
from .cost import (
    LayoutCost,
    ideal_cost,
    key_local_work,
    layout_cost,
    overlap_work,
    rank_cost,
    rank_features,
    rank_runs,
    rank_work,
    split_documents,
)
from .exchange_plan import (
    AttentionShape,
    ExchangeBytes,
    ExchangePlan,
    RankExchange,
    RankRoutes,
    kv_row_bytes,
    needed_intervals,
    needed_rank_plan,
    needed_rows_per_layer,
    plan_exchange,
    plan_needed_rows,
    rank_routes,
)
from .exchange_registry import (
    ExchangeRecord,
    canonical_exchange_name,
    choose_exchange,
    exchange_names,
    exchange_records,
    get_exchange,
    register_exchange,
    unregister_exchange,
)
from .head_parallel import (
    HeadRoutes,
    head_parallel_row_bytes,
    head_parallel_rows_per_layer,
    head_split_reason,
    kv_head_repeats,
    pack_as_one_rank,
    plan_head_parallel,
)
from .kernel_cost import DEFAULT_KERNEL_COST, PAIR_COUNT, KernelCost, run_pairs
from .layout import DEFAULT_TOLERANCE, Layout, layout_strategies, plan_layout, register_layout_strategy
from .overlap import OverlapPlan, QueryPart, plan_key_overlap, plan_overlap
from .rank_plan import RankPlan, dense_allowed, key_row_levels, plan_rank, validate_rank_plan
from .segments import (
    Segments,
    document_ids_from_cu_seqlens,
    document_ids_from_lengths,
    document_ids_from_position_ids,
    padded_length,
    positions_from_document_ids,
    validate_document_ids,
)

__all__ = [
    "AttentionShape",
    "DEFAULT_KERNEL_COST",
    "DEFAULT_TOLERANCE",
    "PAIR_COUNT",
    "ExchangeBytes",
    "ExchangePlan",
    "ExchangeRecord",
    "HeadRoutes",
    "KernelCost",
    "Layout",
    "LayoutCost",
    "OverlapPlan",
    "QueryPart",
    "RankExchange",
    "RankPlan",
    "RankRoutes",
    "Segments",
    "canonical_exchange_name",
    "choose_exchange",
    "dense_allowed",
    "document_ids_from_cu_seqlens",
    "document_ids_from_lengths",
    "document_ids_from_position_ids",
    "exchange_names",
    "exchange_records",
    "get_exchange",
    "head_parallel_row_bytes",
    "head_parallel_rows_per_layer",
    "head_split_reason",
    "ideal_cost",
    "key_local_work",
    "key_row_levels",
    "kv_head_repeats",
    "kv_row_bytes",
    "layout_cost",
    "layout_strategies",
    "needed_intervals",
    "needed_rank_plan",
    "needed_rows_per_layer",
    "overlap_work",
    "pack_as_one_rank",
    "padded_length",
    "plan_exchange",
    "plan_head_parallel",
    "plan_needed_rows",
    "plan_key_overlap",
    "plan_overlap",
    "plan_layout",
    "plan_rank",
    "positions_from_document_ids",
    "rank_cost",
    "rank_features",
    "rank_routes",
    "rank_runs",
    "rank_work",
    "run_pairs",
    "register_exchange",
    "register_layout_strategy",
    "split_documents",
    "unregister_exchange",
    "validate_document_ids",
    "validate_rank_plan",
]

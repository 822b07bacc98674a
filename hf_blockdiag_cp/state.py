"""Per-step state, built once on the host and reused by every layer and by recompute.

A `CPStep` holds everything attention needs for one packed step on one rank: the group,
the layout, this rank's plan (on the compute device), the chosen kernel and exchange, and
caches of masks keyed by sliding window. It reaches attention in two ways (invariant I6):
as the `blockdiag_cp_step` keyword that every attention call receives (and that activation
checkpoint recompute replays), and through a process-wide slot that `train_ctx()` sets, for
code that calls `F.scaled_dot_product_attention` directly.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from .exchange import ExchangeMeter
from .exchange_plan import NEEDED_ONLY, ExchangePlan, RankRoutes, needed_rank_plan, plan_exchange, rank_routes
from .layout import Layout, RankPlan, plan_rank, validate_rank_plan

STEP_KWARG = "blockdiag_cp_step"


@dataclass(frozen=True)
class BlockdiagCpModelState:
    """Global packed boundaries for model-owned layers (recurrent / linear attention).

    `packed_cu_seqlens` are the offsets of the segments of the *global* padded pack
    (documents and padding runs), on the compute device and as a CPU copy; `group` is the CP
    process group (None without CP), `rank` this process's CP rank, and `layout` tells which
    pack positions each rank holds (contiguous chunks unless a balanced layout was asked for).
    """

    group: Any
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor
    rank: int = 0
    layout: Layout | None = None  # which pack positions each rank holds (`layout.slot_positions`)


@dataclass(frozen=True)
class DevicePlan:
    """This rank's `RankPlan` moved to the compute device once per step."""

    q_positions: torch.Tensor
    q_segments: torch.Tensor
    k_positions: torch.Tensor
    k_segments: torch.Tensor
    key_index: torch.Tensor | None  # None when the needed keys are one contiguous range
    key_range: tuple[int, int] | None
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    # Pack position and segment of every row the exchange returns (all slots for all-gather).
    # Kernels that skip masked blocks themselves (flex) attend over these rows unsliced, so
    # their shapes stay constant from step to step and compiled kernels are reused.
    row_positions: torch.Tensor
    row_segments: torch.Tensor
    # Pack position where each query's segment starts. Segments are contiguous in pack
    # positions, so "same segment and not after the query" is q_start <= k_pos <= q_pos.
    q_starts: torch.Tensor
    # Set when the queries are the positions q_offset + [0, L) and when row r holds position r
    # (contiguous layout with all-gather): kernels can then use indices as positions.
    q_offset: int | None = None
    rows_are_positions: bool = False

    @staticmethod
    def from_rank_plan(
        plan: RankPlan, device: torch.device, row_positions: torch.Tensor, row_segments: torch.Tensor, q_starts: torch.Tensor
    ) -> "DevicePlan":
        def to(t):
            return t.to(device, non_blocking=True)

        rows = plan.key_rows
        cu_q, cu_k = to(plan.cu_seqlens_q), to(plan.cu_seqlens_k)
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if cu.device.type != device.type or (device.index is not None and cu.device.index != device.index):
                raise ValueError(f"DevicePlan: {name} must be on the compute device {device}; got {cu.device}")
            if cu.dtype != torch.int32:
                raise ValueError(f"DevicePlan: {name} must have dtype torch.int32; got {cu.dtype}")
        return DevicePlan(
            q_positions=to(plan.q_positions),
            q_segments=to(plan.q_segments),
            k_positions=to(plan.k_positions),
            k_segments=to(plan.k_segments),
            key_index=None if isinstance(rows, tuple) else to(rows),
            key_range=rows if isinstance(rows, tuple) else None,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
            row_positions=to(row_positions),
            row_segments=to(row_segments),
            q_starts=to(q_starts),
            q_offset=_range_offset(plan.q_positions),
            rows_are_positions=_range_offset(row_positions) == 0,
        )


def _range_offset(positions: torch.Tensor) -> int | None:
    """a if positions == [a, a+1, ..., a+n-1], else None (host tensor, once per step)."""
    if positions.numel() == 0:
        return None
    first = int(positions[0])
    return first if torch.equal(positions, torch.arange(first, first + positions.numel())) else None


@dataclass(eq=False)
class CPStep:
    """Everything one rank's attention needs during one CP step."""

    group: Any  # ProcessGroup or None (cp = 1)
    rank: int
    world_size: int
    layout: Layout
    rank_plan: RankPlan
    plan: DevicePlan
    attn_backend: str  # canonical kernel name chosen for this step
    kv_exchange: str  # canonical exchange name agreed for this step
    model_state: BlockdiagCpModelState
    attention_calls: int = 0
    mask_cache: dict = field(default_factory=dict, repr=False)
    exchange_plan: ExchangePlan | None = None  # needed keys and traffic of every rank (see exchange_plan)
    kv_routes: RankRoutes | None = None  # this rank's halo / a2a tables on the device (None for allgather)
    exchange_bytes: ExchangeMeter = field(default_factory=ExchangeMeter)  # bytes received this step

    @staticmethod
    def for_rank(
        layout: Layout,
        rank: int,
        group,
        device: torch.device,
        attn_backend: str,
        kv_exchange: str,
        exchange_plan: ExchangePlan | None = None,
    ) -> "CPStep":
        """Plan rank `rank`'s attention for this layout and move the plan to `device` (once per step)."""
        routes = None
        if kv_exchange in NEEDED_ONLY:
            # The exchange returns the needed keys once each, in pack order; the plan's key_rows index them.
            exchange_plan = exchange_plan if exchange_plan is not None else plan_exchange(layout)
            rank_plan = needed_rank_plan(layout, exchange_plan, rank)
            routes = rank_routes(layout, exchange_plan, rank)
            rows = routes.key_positions  # the exchange's output rows
            routes = routes.to(device)
        else:
            rank_plan = plan_rank(layout, rank)
            rows = layout.slot_positions.reshape(-1)  # all-gather output rows, in slot order
        # Host check of the varlen metadata before anything reaches a kernel (a bad offset there is an illegal access).
        validate_rank_plan(rank_plan, layout.local_len, rank_plan.num_keys, num_rows=rows.numel())
        boundaries = layout.segments.boundaries
        return CPStep(
            group=group,
            rank=rank,
            world_size=layout.cp_size,
            layout=layout,
            rank_plan=rank_plan,
            plan=DevicePlan.from_rank_plan(
                rank_plan, device, rows, layout.segments.segment_ids[rows], layout.segments.segment_starts[rank_plan.q_positions]
            ),
            attn_backend=attn_backend,
            kv_exchange=kv_exchange,
            model_state=BlockdiagCpModelState(group, boundaries.to(device), boundaries, rank, layout),
            exchange_plan=exchange_plan,
            kv_routes=routes,
        )

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def cached(self, key, build):
        """Per-step cache (block masks, dense masks): built at the first layer, reused by every other and by recompute."""
        value = self.mask_cache.get(key)
        if value is None:
            value = build()
            self.mask_cache[key] = value
        return value


_ACTIVE_STEP: CPStep | None = None


def active_step() -> CPStep | None:
    """The step whose `train_ctx()` is open, or None."""
    return _ACTIVE_STEP


def current_blockdiag_cp_state() -> BlockdiagCpModelState | None:
    """Global packed boundaries and group of the CP step in progress; None outside a step."""
    step = _ACTIVE_STEP
    return None if step is None else step.model_state


@contextlib.contextmanager
def activate(step: CPStep):
    """Make `step` the active one for the duration of the block (forward and backward)."""
    global _ACTIVE_STEP
    previous = _ACTIVE_STEP
    _ACTIVE_STEP = step
    try:
        yield step
    finally:
        _ACTIVE_STEP = previous

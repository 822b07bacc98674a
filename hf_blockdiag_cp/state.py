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

from .layout import Layout, RankPlan, plan_rank

STEP_KWARG = "blockdiag_cp_step"


@dataclass(frozen=True)
class BlockdiagCpModelState:
    """Global packed boundaries for model-owned layers (recurrent / linear attention).

    `packed_cu_seqlens` are the offsets of the segments of the *global* padded pack
    (documents and padding runs), on the compute device and as a CPU copy; `group` is the CP
    process group (None without CP).
    """

    group: Any
    packed_cu_seqlens: torch.Tensor
    packed_cu_seqlens_cpu: torch.Tensor


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

    @staticmethod
    def from_rank_plan(plan: RankPlan, device: torch.device) -> "DevicePlan":
        def to(t):
            return t.to(device, non_blocking=True)

        rows = plan.key_rows
        return DevicePlan(
            q_positions=to(plan.q_positions),
            q_segments=to(plan.q_segments),
            k_positions=to(plan.k_positions),
            k_segments=to(plan.k_segments),
            key_index=None if isinstance(rows, tuple) else to(rows),
            key_range=rows if isinstance(rows, tuple) else None,
            cu_seqlens_q=to(plan.cu_seqlens_q),
            cu_seqlens_k=to(plan.cu_seqlens_k),
            max_seqlen_q=plan.max_seqlen_q,
            max_seqlen_k=plan.max_seqlen_k,
        )


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

    @staticmethod
    def for_rank(layout: Layout, rank: int, group, device: torch.device, attn_backend: str, kv_exchange: str) -> "CPStep":
        """Plan rank `rank`'s attention for this layout and move the plan to `device` (once per step)."""
        rank_plan = plan_rank(layout, rank)
        boundaries = layout.segments.boundaries
        return CPStep(
            group=group,
            rank=rank,
            world_size=layout.cp_size,
            layout=layout,
            rank_plan=rank_plan,
            plan=DevicePlan.from_rank_plan(rank_plan, device),
            attn_backend=attn_backend,
            kv_exchange=kv_exchange,
            model_state=BlockdiagCpModelState(group, boundaries.to(device), boundaries),
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

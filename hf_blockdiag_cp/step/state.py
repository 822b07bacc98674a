"""The step object: per-step state, built once on the host and reused by every layer and by recompute.

A `CPStep` holds everything attention needs for one packed step on one rank: the group,
the layout, this rank's plan (on the compute device), the configured kernel and the agreed
exchange, and caches of masks keyed by sliding window. It reaches attention in two ways
(invariant I6, docs/design.md): as the `blockdiag_cp_step` keyword that every attention call
receives (and that activation-checkpoint recompute replays), and through a process-wide slot
that `step.activate()` sets around forward and backward, for code that calls
`F.scaled_dot_product_attention` directly. The slot is process-wide on purpose: backward and
recompute may run in another thread, where context variables set around `forward()` are gone.

What a step ran (`StepChoices`: kernels, exchange, layout) is logged once per distinct choice at
INFO on the `hf_blockdiag_cp` loggers when its context exits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm.exchange import ExchangeMeter
from ..compat.transformers import attn_implementation as config_attn_implementation
from ..kernels.attention.lse import merge_into
from ..planning import ExchangePlan, Layout, OverlapPlan, QueryPart, RankPlan, key_row_levels
from .model_support import configured_model
from .targets import StepTargets

STEP_KWARG = "blockdiag_cp_step"
ATTN_IMPLEMENTATION = "blockdiag_cp"  # the attention implementation that runs a step (registered by integrations)
# Attention caches its kernel choice per layer kind in the step under keys ("kernel", ...).
KERNEL_CACHE_KEY = "kernel"
# Recurrent token mixers keep their context (`mixers.MixerContext`, what they ran) in the step under this key.
MIXER_CONTEXT_KEY = ("mixer_context",)
logger = logging.getLogger(__name__)


def exchange_label(exchange: str, overlap) -> str:
    """How logs and tables name an exchange run with `overlap` (`CPConfig.overlap`, or a benchmark row's:
    False / None, True or "queries", "keys"): `allgather`, `allgather+overlap`, `allgather+overlap_keys`."""
    return exchange + ("" if not overlap else "+overlap_keys" if overlap == "keys" else "+overlap")


@dataclass(frozen=True)
class StepChoices:
    """What a CP step ran: the kernels of its attention layers (one per layer kind, e.g. softcapped
    layers may need another), the K/V exchange and the layout, next to what the config asked for."""

    kernels: tuple[str, ...]
    attn_backend: str  # as configured ("auto" or a kernel name)
    kv_exchange: str
    requested_kv_exchange: str | None  # as configured ("auto" or an exchange name; None: unknown)
    layout: str
    overlap: str | None = None  # how the exchange overlapped attention: "queries" or "keys" (CPConfig.overlap)
    mixers: str | None = None  # what recurrent token mixers ran, e.g. "gated_delta_rule=fla short_conv=fla transport=states"

    def describe(self) -> str:
        kernels = ", ".join(self.kernels) or "none"
        exchange = self.requested_kv_exchange or self.kv_exchange
        overlapped = "" if self.overlap is None else f" overlapped with attention (split by {self.overlap})"
        return (
            f"blockdiag_cp runs kernel {kernels} (attn_backend={self.attn_backend!r}), K/V exchange "
            f"{self.kv_exchange}{overlapped} (kv_exchange={exchange!r}), layout {self.layout}"
            + ("" if self.mixers is None else f", token mixers {self.mixers}")
        )

    def as_logs(self) -> dict[str, str]:
        """The choices as Trainer log entries (`cp_kv_exchange` ends in `+overlap` when it overlapped
        attention split by queries, `+overlap_keys` split by keys)."""
        logs = {"cp_attn_kernel": "+".join(self.kernels), "cp_kv_exchange": exchange_label(self.kv_exchange, self.overlap),
                "cp_layout": self.layout}
        return logs if self.mixers is None else {**logs, "cp_mixers": self.mixers}


@functools.cache
def log_choices(choices: StepChoices) -> None:
    """Log `choices` at INFO, once per process for each distinct choice."""
    logger.info(choices.describe())


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
    """This rank's `RankPlan` moved to the compute device once per step: the plan its kernel runs
    with (under a head-parallel exchange, the whole pack's: every position, in pack order)."""

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
    # With key_index: (positions, rows) of each occurrence level (`planning.key_row_levels`), and
    # whether level 0 holds every exchanged row in order (the gradient is then a plain gather).
    key_levels: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
    key_levels_cover_rows: bool = False
    causal: bool = True  # RankPlan.causal: False when every key precedes its run (split by keys, remote part)

    @staticmethod
    def from_rank_plan(
        plan: RankPlan, device: torch.device, row_positions: torch.Tensor, row_segments: torch.Tensor, q_starts: torch.Tensor
    ) -> "DevicePlan":
        def to(t):
            return t.to(device, non_blocking=True)

        rows = plan.key_rows
        levels = () if isinstance(rows, tuple) else key_row_levels(rows)
        cover = bool(levels) and torch.equal(levels[0][1], torch.arange(row_positions.numel()))
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
            key_levels=tuple((to(pos), to(row)) for pos, row in levels),
            key_levels_cover_rows=cover,
            causal=plan.causal,
        )


def cached(cache: dict, key, build):
    """`cache[key]`, built by `build()` the first time (per-step state: masks, kernel choices)."""
    value = cache.get(key)
    if value is None:
        value = cache[key] = build()
    return value


@dataclass(eq=False)
class StepPart:
    """One part of a rank's queries on the device (`planning.overlap.QueryPart`): the local query rows
    it holds and its own plan and caches, which is all a kernel reads of a step (`plan`, `cached`)."""

    queries: tuple[int, int] | torch.Tensor
    plan: DevicePlan
    mask_cache: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def from_part(part: QueryPart, layout: Layout, device: torch.device) -> "StepPart":
        seg, queries = layout.segments, part.queries
        return StepPart(
            queries if isinstance(queries, tuple) else queries.to(device, non_blocking=True),
            DevicePlan.from_rank_plan(
                part.plan, device, part.row_positions, seg.segment_ids[part.row_positions],
                seg.segment_starts[part.plan.q_positions],
            ),
        )

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This part's rows of `x` `[L, ...]` (`x` itself when they are all its rows: a slice's backward
        would fill a zero gradient of `x`'s size first)."""
        if isinstance(self.queries, tuple):
            start, stop = self.queries
            return x if (start, stop) == (0, x.shape[0]) else x.narrow(0, start, stop - start)
        return x.index_select(0, self.queries)

    def cached(self, key, build):
        return cached(self.mask_cache, key, build)


@dataclass(frozen=True)
class StepOverlap:
    """A rank's attention split for overlap (`planning.overlap.OverlapPlan`), on the device: the `local`
    part attends while the exchange runs, the `remote` part after it. Split by queries, `merge`
    restores query order; split by keys (`by_keys`), `merge_by_keys` merges the remote part's
    partial softmax into its queries' rows of the local part's."""

    local: StepPart | None
    remote: StepPart | None
    merge_index: torch.Tensor | None
    remote_first: bool
    by_keys: bool = False

    @staticmethod
    def from_plan(plan: OverlapPlan, layout: Layout, device: torch.device) -> "StepOverlap":
        def part(p):
            return None if p is None else StepPart.from_part(p, layout, device)

        index = None if plan.merge_index is None else plan.merge_index.to(device, non_blocking=True)
        return StepOverlap(part(plan.local), part(plan.remote), index, plan.remote_first, plan.by_keys)

    @property
    def parts(self) -> tuple[StepPart, ...]:
        return tuple(p for p in (self.local, self.remote) if p is not None)

    def merge(self, local_out: torch.Tensor, remote_out: torch.Tensor) -> torch.Tensor:
        """The parts' outputs `[n, H, Dv]` as one `[L, H, Dv]` in query order."""
        if self.remote_first:
            return torch.cat([remote_out, local_out])
        out = torch.cat([local_out, remote_out])
        return out if self.merge_index is None else out.index_select(0, self.merge_index)

    def merge_by_keys(self, local_out, local_lse, remote_out, remote_lse) -> torch.Tensor:
        """`[L, H, Dv]`: the local part's output (every query over its rank's keys), with the rows of
        the remote part's queries merged with the remote part's by log-sum-exp (`kernels.attention.lse`)."""
        return merge_into(local_out, local_lse, self.remote.queries, remote_out, remote_lse)


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
    attn_backend: str  # canonical kernel name (or "auto", resolved per layer) configured for this step
    kv_exchange: str  # canonical exchange name agreed for this step
    model_state: BlockdiagCpModelState
    attention_calls: int = 0
    mask_cache: dict = field(default_factory=dict, repr=False)
    exchange_plan: ExchangePlan | None = None  # needed keys and traffic of every rank (None: not planned)
    kv_routes: Any = None  # the exchange's tables for this rank on the device (`RankExchange.routes`)
    exchange_bytes: ExchangeMeter = field(default_factory=ExchangeMeter)  # bytes received this step
    requested_kv_exchange: str | None = None  # the configured kv_exchange ("auto" or a name)
    model: Any = field(default=None, repr=False)  # the model the user named (error messages only)
    overlap: StepOverlap | None = None  # the split when the exchange overlaps attention (CPConfig.overlap)
    overlapped_queries: int = 0  # query rows attended while an exchange was in flight, this step (recompute included)
    mixer_backend: str = "auto"  # kernels of recurrent token mixers (CPConfig.mixer_backend)
    mixer_transport: str = "auto"  # how they cross the group (CPConfig.mixer_transport)
    head_tiles: str = "eager"  # how the log-prob head runs its tiles (CPConfig.head_tiles)
    attention_free: bool = False  # set by the token mixers of a model without attention layers (Mamba2)
    targets: StepTargets | None = None  # the shard's target rows on the device (the log-prob head's), with labels

    @contextlib.contextmanager
    def activate(self):
        """Make this the active step for forward AND backward; on a clean exit, raise if no
        attention call went through `blockdiag_cp` (every layer would have attended only inside
        its local shard) in a model that has attention (`attention_free`), else log what ran
        (`log_choices`)."""
        global _ACTIVE_STEP
        previous = _ACTIVE_STEP
        _ACTIVE_STEP = self
        try:
            yield self
        finally:
            _ACTIVE_STEP = previous
        if self.attention_calls == 0 and not self.attention_free:
            raise RuntimeError(
                "blockdiag_cp: no attention call went through 'blockdiag_cp' during this CP step, so every layer "
                f"attended only inside its local shard. {_no_attention_cause(self.model)}"
            )
        log_choices(self.choices)

    @property
    def choices(self) -> StepChoices:
        """What this step ran so far: the kernels attention chose (per layer kind), the exchange, the layout."""
        kernels = {
            value.name for key, value in self.mask_cache.items()
            if isinstance(key, tuple) and key[:1] == (KERNEL_CACHE_KEY,)
        }
        mixers = self.mask_cache.get(MIXER_CONTEXT_KEY)
        return StepChoices(tuple(sorted(kernels)), self.attn_backend, self.kv_exchange, self.requested_kv_exchange,
                           self.layout.strategy, self.overlap_split, None if mixers is None else mixers.describe())

    @property
    def overlap_split(self) -> str | None:
        """How the exchange overlaps attention this step: "queries", "keys", or None."""
        return None if self.overlap is None else "keys" if self.overlap.by_keys else "queries"

    @property
    def local_len(self) -> int:
        return self.layout.local_len

    def cached(self, key, build):
        """Per-step cache (block masks, dense masks): built at the first layer, reused by every other and by recompute."""
        return cached(self.mask_cache, key, build)

    @property
    def kernel_targets(self) -> tuple[Any, ...]:
        """What the kernels run on: the step itself, or the parts of its queries under overlap."""
        return (self,) if self.overlap is None else self.overlap.parts


def attn_implementation(model) -> Any:
    """The attention implementation of `model`'s config (inside a DDP / compile wrapper), or None without a config."""
    return config_attn_implementation(getattr(configured_model(model), "config", None))


def _no_attention_cause(model) -> str:
    """The likely cause of a step in which no attention call went through `blockdiag_cp`."""
    if model is None:
        return (
            "Load the model with attn_implementation='blockdiag_cp' (import hf_blockdiag_cp first) and run its forward "
            "inside train_ctx(); pass model= to make_cp_blockdiag_batch_and_ctx and this error names the model's "
            "attention implementation"
        )
    impl = attn_implementation(model)
    if impl != ATTN_IMPLEMENTATION:
        return (
            f"The model's attention implementation is {impl!r}; expected {ATTN_IMPLEMENTATION!r}. Load it with "
            f"attn_implementation={ATTN_IMPLEMENTATION!r}; if it was switched after loading (e.g. by "
            "set_attn_implementation() on another model that shares this config object), call "
            f"model.set_attn_implementation({ATTN_IMPLEMENTATION!r}) and give the other model its own config"
        )
    return (
        f"The model's attention implementation is {impl!r}, so its forward did not run in this step: run "
        "model(**local) and its backward inside `with train_ctx():`, with the local batch of this step"
    )


_ACTIVE_STEP: CPStep | None = None


def active_step() -> CPStep | None:
    """The step whose `train_ctx()` is open, or None."""
    return _ACTIVE_STEP


def current_blockdiag_cp_state() -> BlockdiagCpModelState | None:
    """Global packed boundaries and group of the CP step in progress; None outside a step."""
    step = _ACTIVE_STEP
    return None if step is None else step.model_state


BlockdiagCPModelState = BlockdiagCpModelState  # the spelling of the other CP names; the first one stays

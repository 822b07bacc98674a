"""FlexAttention kernel: a document-causal block mask over pack positions.

The block mask is built once per step and sliding window (first layer), then reused by
every layer and by recompute. It is built straight from the plan's intervals (every query
sees the keys at pack positions `[lo, q]`), with block-level min/max arithmetic: no compiled
mask builder (whose first compile took minutes inside a model) and nothing of size S².
The kernel is compiled once per process; FlexAttention has no CPU backward, so `auto` never
picks it on CPU.

A logit softcap (Gemma2) is a `score_mod`. Attention sinks (GPT-OSS) cannot be a
`score_mod` (they add a logit that has no key), so the kernel returns its log-sum-exp and
rescales the output by `exp(lse - logaddexp(lse, sink)) = sigmoid(lse - sink)`.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from .registry import KernelRecord, register_kernel


SPARSE_BLOCK = 128  # FlexAttention's default sparse block; the kernel's tiles divide it


@functools.cache
def compiled_flex():
    # dynamic=None: static for the first shape, one recompile to dynamic shapes if the row or query
    # count changes (needed-only exchanges, varying pack lengths) instead of one compile per shape
    # until dynamo's recompile limit drops the kernel to eager.
    return torch.compile(flex_attention)


def _mask_mod(plan, sliding_window):
    """Segments are contiguous runs of pack positions, so "same segment and causal" is one
    interval per query: q_start <= k <= q. When the rows or the queries are a plain range of
    positions (contiguous layout, all-gather), the index is the position: fewer loads in the
    kernel's partial blocks."""
    q_start, q_positions, k_positions = plan.q_starts, plan.q_positions, plan.row_positions
    q_offset, rows_are_positions = plan.q_offset, plan.rows_are_positions

    def mask_mod(b, h, q_idx, kv_idx):
        key = kv_idx if rows_are_positions else k_positions[kv_idx]
        query = q_idx + q_offset if q_offset is not None else q_positions[q_idx]
        lower = q_start[q_idx]
        if sliding_window is not None:
            lower = torch.maximum(lower, query - sliding_window + 1)
        return (key >= lower) & (key <= query)

    return mask_mod


def query_intervals(plan, sliding_window: int | None):
    """(lo, hi) per query: the pack positions of the keys it may see are exactly [lo, hi]."""
    hi = plan.q_positions
    lo = plan.q_starts
    if sliding_window is not None:
        lo = torch.maximum(lo, hi - (sliding_window - 1))
    return lo, hi


def block_classes(lo, hi, row_positions, block: int = SPARSE_BLOCK):
    """(partial, full) `[q blocks, row blocks]` booleans for queries allowed keys at positions [lo, hi].

    A tile is full iff every query's interval holds every row of it: max(lo) <= min(row) and
    max(row) <= min(hi), exact. A tile is kept (partial) unless it is certainly empty (all rows
    before every interval or after every one); keeping an empty tile costs time, never correctness,
    since partial tiles are masked element by element. Tiles cut by the end of the sequence are
    never called full."""
    big = torch.iinfo(torch.int64).max // 4

    def tiles(x, fill):
        n = -(-x.numel() // block)
        padded = x.new_full((n * block,), fill, dtype=torch.int64)
        padded[: x.numel()] = x
        return padded.view(n, block)

    lo_min, lo_max = tiles(lo, big).amin(1), tiles(lo, -big).amax(1)
    hi_min, hi_max = tiles(hi, big).amin(1), tiles(hi, -big).amax(1)
    k_min, k_max = tiles(row_positions, big).amin(1), tiles(row_positions, -big).amax(1)
    kept = (k_max[None, :] >= lo_min[:, None]) & (k_min[None, :] <= hi_max[:, None])
    full = (k_min[None, :] >= lo_max[:, None]) & (k_max[None, :] <= hi_min[:, None])
    if lo.numel() % block:
        full[-1] = False
    if row_positions.numel() % block:
        full[:, -1] = False
    return kept & ~full, full


def _ordered(blocks):
    """Block-level booleans [Q, K] -> FlexAttention's (num_blocks [1,1,Q], indices [1,1,Q,K]) int32."""
    num = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return num[None, None].contiguous(), order[None, None].contiguous()


def build_block_mask(step, sliding_window: int | None) -> BlockMask:
    plan = step.plan
    lo, hi = query_intervals(plan, sliding_window)
    partial, full = block_classes(lo, hi, plan.row_positions)
    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(full),
        BLOCK_SIZE=SPARSE_BLOCK,
        mask_mod=_mask_mod(plan, sliding_window),
        seq_lengths=(plan.q_positions.numel(), plan.row_positions.numel()),
    )


def block_mask(step, sliding_window: int | None):
    """The step's block mask for this window: built once (by the shard step or the first layer)."""
    return step.cached(("flex", sliding_window), lambda: build_block_mask(step, sliding_window))


@functools.cache
def _softcap_score_mod(softcap: float):
    # One function object per value: compiled kernels guard on the score_mod's identity.
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_attention_kernel(
    q,
    k,
    v,
    step,
    *,
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [L,H,Dk], k/v: every exchange row [R,Hkv,D] (masked by pack position) -> [L,H,Dv]."""
    mask = block_mask(step, sliding_window)
    fn = compiled_flex() if q.is_cuda else flex_attention
    extra = {}
    if softcap is not None:
        extra["score_mod"] = _softcap_score_mod(float(softcap))
    if sinks is not None:
        extra["return_aux"] = AuxRequest(lse=True)
    out = fn(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        block_mask=mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
        **extra,
    )
    if sinks is not None:
        out, aux = out
        lse = aux.lse.squeeze(0).float()  # [H, L], natural log
        out = out * torch.sigmoid(lse - sinks.float().reshape(-1, 1)).unsqueeze(-1).to(out.dtype)
    return out.squeeze(0).transpose(0, 1)


def _check(device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int) -> str | None:
    if device.type not in ("cuda", "cpu"):
        return f"FlexAttention does not run on {device.type}"
    if device.type == "cuda" and min(head_dim_k, head_dim_v) < 16:
        # Inductor's flex lowering refuses smaller head dims at compile time (a LoweringException deep
        # inside the first step); say so before any kernel is built.
        return f"compiled FlexAttention needs head dims of at least 16, got {head_dim_k} (key) and {head_dim_v} (value)"
    return None


def _prepare(step) -> None:
    """Build the step's block mask before the first layer (built on the device, no host sync in attention)."""
    if step.plan.q_positions.is_cuda:
        block_mask(step, None)


register_kernel(
    KernelRecord(
        name="flex",
        aliases=("flexattention", "flex_attention"),
        fn=flex_attention_kernel,
        check=_check,
        features=frozenset({"softcap", "sinks"}),  # sinks via the returned log-sum-exp
        takes_all_rows=True,  # constant shapes step to step, so the compiled kernel is reused
        prepare=_prepare,
        auto_priority=20,  # FlexAttention has no CPU backward: auto never picks it on CPU
    )
)

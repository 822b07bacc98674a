"""Dispatch of one attention call of a CP step: the step's exchange and kernel around this rank's
queries.

With a K/V exchange: the exchange over the CP group, then the local kernel over this rank's queries
and the keys they need (`local_attention`); with `CPConfig.overlap`, what the rank holds is attended
while the exchange runs (split by queries or by keys, `split_attention`). With a head-parallel
exchange (`heads`): q, k, v to head shards, the kernel over the whole pack for this rank's heads,
and the outputs back. The kernel is chosen once per step and layer kind.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..comm.exchange import exchange_kv
from ..comm.notice import warn_once
from ..kernels import choose_kernel
from ..planning import get_exchange
from ..step.state import CPStep, StepPart
from .features import AttentionFeatures

logger = logging.getLogger(__name__)


def blockdiag_attention(
    step: CPStep,
    query,
    key,
    value,
    *,
    scale: float | None,
    sliding_window: int | None,
    features: AttentionFeatures = AttentionFeatures(),
    module=None,
):
    """Block-diagonal CP attention. query [1,H,L,Dk], key [1,Hkv,L,Dk], value [1,Hkv,L,Dv] -> [1,L,H,Dv]:
    the step's K/V exchange, then the local kernel over the rows it returned; or the step's
    head-parallel exchange around the kernel. `module` (the attention module, or None) names the call in errors."""
    # squeeze, not [0]: a select's backward zero-fills a tensor of the input's size and copies the
    # gradient into it (q, k, v of every layer); a squeeze's backward is a view.
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in _autocast_inputs(query, key, value))
    record = get_exchange(step.kv_exchange)
    if record.head_parallel:
        out = head_parallel_attention(step, record, q, k, v, scale=scale, sliding_window=sliding_window, features=features, module=module)
    elif step.overlap is not None and not (step.overlap.by_keys and sliding_window is not None):
        out = overlapped_attention(step, record, q, k, v, scale=scale, sliding_window=sliding_window, features=features)
    else:
        ek, ev = exchange_kv(step.kv_exchange, k, v, step.group, step.world_size, routes=step.kv_routes, meter=step.exchange_bytes)
        out = local_attention(step, q, ek, ev, scale=scale, sliding_window=sliding_window, features=features)
    step.attention_calls += 1
    return out.unsqueeze(0)


def _autocast_inputs(query, key, value):
    """q, k, v in autocast's dtype when autocast is on and they are fp32, else as given.

    Under `torch.autocast` an fp32 model's rotary output is fp32, and stock SDPA (on autocast's
    lower-precision list) and Transformers' flash attention both attend in the autocast dtype; so
    does the step: the same numerics as the stock model, and fa4 / varlen (bf16 or fp16 only) stay
    usable under `bf16=True` mixed precision. The exchange then moves half the bytes."""
    device_type = query.device.type
    if query.dtype != torch.float32 or not torch.is_autocast_enabled(device_type):
        return query, key, value
    dtype = torch.get_autocast_dtype(device_type)
    return (t.to(dtype) if t.dtype == torch.float32 else t for t in (query, key, value))


def overlapped_attention(step: CPStep, record, q, k, v, *, scale, sliding_window, features):
    """q [L,H,Dk], k/v [L,Hkv,D] -> [L,H,Dv], the exchange overlapped with attention (`step.overlap`):
    the record's `begin` starts it, `split_attention` attends while it is in flight; in backward the
    reverse collective runs under the local part's backward."""
    pending = record.begin(k, v, step.group, step.world_size, step.kv_routes, step.exchange_bytes)
    return split_attention(step, q, k, v, pending.wait, scale=scale, sliding_window=sliding_window, features=features)


def split_attention(step: CPStep, q, k, v, wait, *, scale, sliding_window, features=AttentionFeatures()):
    """q [L,H,Dk] against this rank's own k/v [L,Hkv,D] (the local part), then `wait(local_out)` ->
    (exchanged k rows, exchanged v rows, local_out) and the remote part over those rows -> [L,H,Dv].

    Split by queries: the queries whose keys are all local, then the others, each query whole in one
    part; putting the parts back in order is exact. Split by keys (`by_keys`): every query over its
    rank's own keys, then the queries with keys on other ranks over those, merged by log-sum-exp
    (`kernels.attention.lse`); the sinks join the local part only, so they count once, and the layer has no
    sliding window (`blockdiag_attention` runs windowed layers in order: the remote part's kernels
    run without a causal mask, hence without a window)."""
    split = step.overlap
    by_keys = split.by_keys
    lse = {"return_lse": True} if by_keys else {}
    if split.local is not None:
        local = local_attention(step, split.local.take(q), k, v, scale=scale, sliding_window=sliding_window,
                                features=features, part=split.local, **lse)
        local_out, local_lse = local if by_keys else (local, None)
        step.overlapped_queries += local_out.shape[0]
    else:
        local_out, local_lse = q.new_zeros((0, q.shape[1], v.shape[-1])), None
    exchanged_k, exchanged_v, local_out = wait(local_out)
    if split.remote is None:
        return local_out
    remote_features = replace(features, sinks=None) if by_keys else features
    remote = local_attention(step, split.remote.take(q), exchanged_k, exchanged_v, scale=scale,
                             sliding_window=sliding_window, features=remote_features, part=split.remote, **lse)
    if by_keys:
        return split.merge_by_keys(local_out, local_lse, *remote)
    return split.merge(local_out, remote)


def head_parallel_attention(step: CPStep, record, q, k, v, *, scale, sliding_window, features, module=None):
    """q [L,H,Dk], k/v [L,Hkv,D] -> [L,H,Dv] by the head-parallel `record`: its transport around the
    local kernel, which runs with the step's plan (the whole pack) on this rank's heads.

    The head counts are checked first: every rank runs the same layer shapes, so a layer the
    exchange cannot split raises on every rank before any collective of that layer (I5)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    reason = record.heads_reason(heads, kv_heads, step.world_size)
    if reason is not None:
        raise ValueError(
            f"blockdiag_cp: {_layer_name(module)} has {heads} query heads and {kv_heads} kv heads; kv_exchange={record.name!r} "
            f"cannot split them over the CP size G={step.world_size}: {reason}. Choose a CP size that divides "
            f"{heads}, or another kv_exchange"
        )

    def attend(q_heads, k_heads, v_heads, mine: slice):
        return local_attention(
            step, q_heads, k_heads, v_heads, scale=scale, sliding_window=sliding_window, features=features.for_heads(mine)
        )

    return record.transport(q, k, v, attend, step.group, step.world_size, step.kv_routes, step.exchange_bytes)


def _layer_name(module) -> str:
    """How errors name an attention call: its module and layer index, or an SDPA call (the drop-in, the hooks)."""
    return "an SDPA call (cp_blockdiag_sdpa)" if module is None else f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')})"


def needed_keys(plan, rows_k, rows_v):
    """The keys this rank's queries may see, in the plan's key order, from the exchange's rows."""
    if plan.key_range is not None:
        start, stop = plan.key_range
        if start == 0 and stop == rows_k.shape[0]:
            return rows_k, rows_v  # every row (cp = 1): no slice, so no zero-filled slice gradient in backward
        return rows_k[start:stop], rows_v[start:stop]
    return _GatherKeys.apply(rows_k, plan), _GatherKeys.apply(rows_v, plan)


class _GatherKeys(torch.autograd.Function):
    """rows[plan.key_index], whose backward adds the key gradients back level by level.

    `index_select`'s backward is an `index_add_` whose repeated rows (two runs of one document
    on a rank share a key prefix) contend for the same atomics (measured in docs/layouts.md,
    "The key gather"). Here every level of `plan.key_levels` names each row once: level 0 is a
    gather (or a copy into zeros when some rows are unused), the rest are conflict-free
    `index_add_`s over the few repeated rows."""

    @staticmethod
    def forward(ctx, rows, plan):
        ctx.plan, ctx.num_rows = plan, rows.shape[0]
        return rows.index_select(0, plan.key_index)

    @staticmethod
    def backward(ctx, grad):
        plan = ctx.plan
        (pos, row), *rest = plan.key_levels
        if plan.key_levels_cover_rows:
            out = grad.index_select(0, pos)
        else:
            out = grad.new_zeros((ctx.num_rows, *grad.shape[1:])).index_copy_(0, row, grad.index_select(0, pos))
        for pos, row in rest:
            out.index_add_(0, row, grad.index_select(0, pos))
        return out, None


def _choose_kernel(requested: str, device, dtype, head_dim_k: int, head_dim_v: int, names, needs_lse: bool):
    """`choose_kernel`; when the split by keys (`needs_lse`) makes `auto` take another kernel than it
    takes for the same layer otherwise (one whose log-sum-exp is verified there, often the slow dense
    one), a WARNING says so (once per run, rank 0)."""
    kernel = choose_kernel(requested, device, dtype, head_dim_k, head_dim_v, names, needs_lse)
    if needs_lse and requested == "auto":
        usual = choose_kernel(requested, device, dtype, head_dim_k, head_dim_v, names)
        if usual.name != kernel.name:
            reason = usual.unsupported_reason(device, dtype, head_dim_k, head_dim_v, names, needs_lse=True)
            warn_once(logger, ("overlap keys kernel", usual.name, kernel.name, dtype, head_dim_k, head_dim_v), (
                f"blockdiag_cp: overlap='keys' runs the {kernel.name} kernel instead of {usual.name} for attention "
                f"layers of head dims {head_dim_k}/{head_dim_v} in {dtype} ({reason}); overlap='queries' keeps "
                f"{usual.name} (warned once)"
            ))
    return kernel


def local_attention(
    step: CPStep,
    q,
    exchanged_k,
    exchanged_v,
    *,
    scale: float | None,
    sliding_window: int | None,
    features: AttentionFeatures = AttentionFeatures(),
    part: StepPart | None = None,
    return_lse: bool = False,
):
    """This rank's share: q [L,H,Dk] against the keys it needs among the exchange's output rows -> [L,H,Dv];
    with `part`, that part's queries against its rows (`split_attention`);
    with `return_lse`, `(out, lse [L,H])` from a kernel that `returns_lse`."""
    head_dim_k, head_dim_v = q.shape[-1], exchanged_v.shape[-1]
    # The kernel is chosen per layer kind: a softcapped or sink layer may need another kernel.
    names = features.names
    kernel = step.cached(
        ("kernel", q.device, q.dtype, head_dim_k, head_dim_v, names, return_lse),
        lambda: _choose_kernel(step.attn_backend, q.device, q.dtype, head_dim_k, head_dim_v, names, return_lse),
    )
    target = step if part is None else part
    if kernel.takes_all_rows:
        k, v = exchanged_k, exchanged_v
    else:
        k, v = needed_keys(target.plan, exchanged_k, exchanged_v)
    if scale is None:
        scale = head_dim_k**-0.5
    lse = {"return_lse": True} if return_lse else {}
    return kernel.fn(q, k, v, target, scale=scale, sliding_window=sliding_window, **features.kernel_kwargs(), **lse)

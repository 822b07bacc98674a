"""State passing: a recurrent token mixer over this rank's rows, exact for documents that continue
from other ranks (`planning.mixer_plan`, "states"), at any CP size and layout.

Convolution: every rank all-gathers the last `width` rows of each of its pieces; each piece is
convolved with the rows before it prepended (`ConvHaloPlan`).

Recurrence: the local pass runs every run of the rank from a zero state and returns each run's
final state F. The state at the end of a run is affine in its start state, S_end = P·S_start + F;
one all-gather of every piece's (P, F) gives each carried run (one continuing a document) its
start state, composed along the document's earlier pieces (`carried_start_states`), and its rows
get that state's contribution added. For the delta rule P and the contribution come from a
transition pass over the carried runs (values zero, the identity as initial state: its final state
is P, its output the coefficients of the start state in each row's output). For Mamba2's SSD scan
P is a scalar decay per head, exp(sum dt·A), and a row's contribution C_t·S_start decayed to t,
computed directly; for Mamba1's selective scan P is a decay per channel and state entry, exp(A·sum
dt), and the contribution likewise (`_decay_with_states`); for MiniMax's lightning attention P is
λ^n per head, a constant decay. Every step is differentiable, so
backward passes state gradients back the same way (reduce-scatter). Every rank issues the same two
all-gathers per layer (one in a layer without a convolution) whatever its rows hold, and `comm.blocks.after` ties each layer's second
gather to its first, so their backwards run in the same order on every rank (I5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.blocks import after, all_gather_blocks
from ..kernels.mixers.buckets import with_zero_row
from ..kernels.mixers.registry import MixerDims, MixerKernelRecord
from ..planning.mixer_plan import ConvHaloPlan, MixerRuns, MixerShape, StatePassingPlan, plan_conv_halo, plan_state_passing
from .context import MixerContext


@dataclass(frozen=True)
class _DeviceHalo:
    plan: ConvHaloPlan
    send_rows: torch.Tensor  # -1 replaced by the zero row's index
    ext_index: torch.Tensor
    keep: torch.Tensor


def _halo(ctx: MixerContext, width: int, device) -> _DeviceHalo:
    def build():
        plan = plan_conv_halo(ctx.layout, ctx.rank, width)
        send = torch.where(plan.send_rows < 0, ctx.layout.local_len, plan.send_rows)
        return _DeviceHalo(plan, send.to(device), plan.ext_index.to(device), plan.keep.to(device))

    return ctx.cached(("halo", width, str(device)), build)


def conv_with_halo(ctx: MixerContext, kernel: MixerKernelRecord, x, weight, bias, activation):
    """`x [L, C]` convolved per document across ranks -> (`[L, C]`, the gathered rows: order them)."""
    width = weight.shape[-1] - 1
    halo = _halo(ctx, width, x.device)
    padded = with_zero_row(x)
    sent = padded.index_select(0, halo.send_rows)
    gathered = all_gather_blocks(sent, ctx.group, ctx.world_size).reshape(-1, x.shape[1])
    ext = torch.cat([x, gathered, x.new_zeros(1, x.shape[1])]).index_select(0, halo.ext_index)
    table = ctx.table(("halo", width), lambda: halo.plan.ext_runs, x.device)
    return kernel.fn(ext, weight, bias, activation, table).index_select(0, halo.keep), gathered


def conv_rows(ctx: MixerContext, name: str, shape: MixerShape, x, weight, bias, activation):
    """The depthwise convolution that opens a mixer layer without a head-parallel transport (Mamba1,
    Mamba2), over this rank's rows `x [L, C]` per document, with the layer's transport: -> (`[L, C]`,
    the gathered halo under state passing, to order the layer's next gather after, or None on one
    rank). `name` names the layer in the error a refused transport raises."""
    try:
        states = ctx.transport_for(shape) == "states"
    except ValueError as exc:
        raise ValueError(f"blockdiag_cp: {name}: {exc}") from None
    conv = ctx.kernel("short_conv", x, MixerDims())
    if states:
        return conv_with_halo(ctx, conv, x, weight, bias, activation)
    return conv.fn(x, weight, bias, activation, ctx.table("pack", lambda: ctx.runs, x.device)), None


@dataclass(frozen=True)
class _DeviceStates:
    plan: StatePassingPlan
    carried_rows: torch.Tensor  # [R] local rows of the carried runs, in order
    carried_spans: tuple[tuple[int, int], ...]  # each carried run's rows within carried_rows
    final_index: torch.Tensor  # [slots] run whose final state each block sends (n_runs: a zero state)
    transition_index: torch.Tensor  # [slots] carried run whose transition each block sends (c: zero)


def _states(ctx: MixerContext, device) -> _DeviceStates:
    def build():
        plan = plan_state_passing(ctx.layout, ctx.rank)
        bounds = plan.runs.boundaries
        spans, rows, start = [], [], 0
        for i in plan.carried.tolist():
            a, b = int(bounds[i]), int(bounds[i + 1])
            rows.append(torch.arange(a, b))
            spans.append((start, start + b - a))
            start += b - a
        n_runs, n_carried = bounds.numel() - 1, plan.carried.numel()
        final = torch.where(plan.export_final < 0, n_runs, plan.export_final)
        transition = torch.where(plan.export_transition < 0, n_carried, plan.export_transition)
        carried_rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.long)
        return _DeviceStates(plan, carried_rows.to(device), tuple(spans), final.to(device), transition.to(device))

    return ctx.cached(("states", str(device)), build)


def _carried_runs(plan: StatePassingPlan) -> MixerRuns:
    lengths = plan.runs.lengths[plan.carried]
    bounds = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths, 0)])
    return MixerRuns(bounds, torch.ones(lengths.numel(), dtype=torch.bool))


def carried_start_states(ctx: MixerContext, final, transition, compose, order_after):
    """The state entering each carried run of this rank, from every piece's (transition, final state).

    `final [n_runs, *state]`: each local run's final state from a zero start; `transition [c, *p]`: each
    carried run's transition P (S_end = P·S_start + F); `compose(p, s)`: P·S for one block. One
    all-gather (after `order_after`) of every piece's (P, F); each carried run's start state is its
    document's chain of earlier pieces composed in pack order. -> (`[c, *state]` fp32 or None when this
    rank has no carried run, the gathered blocks: order what follows after them)."""
    states = _states(ctx, final.device)
    plan = states.plan
    p_shape, s_shape = tuple(transition.shape[1:]), tuple(final.shape[1:])
    p_size = torch.Size(p_shape).numel()
    blocks = torch.cat([with_zero_row(transition.float().flatten(1)).index_select(0, states.transition_index),
                        with_zero_row(final.float().flatten(1)).index_select(0, states.final_index)], dim=-1)
    blocks = after(blocks, order_after)
    gathered = all_gather_blocks(blocks, ctx.group, ctx.world_size).reshape(-1, blocks.shape[-1])
    if not plan.carried.numel():
        return None, gathered
    p = gathered[:, :p_size].reshape((-1,) + p_shape)
    f = gathered[:, p_size:].reshape((-1,) + s_shape)
    starts = []
    for chain in plan.chains:
        state = f[chain[0]]
        for block in chain[1:]:
            state = compose(p[block], state) + f[block]
        starts.append(state)
    return torch.stack(starts), gathered


def delta_rule_with_states(ctx: MixerContext, kernel: MixerKernelRecord, q, k, v, g, beta, torch_rule, order_after):
    """This rank's rows of the gated delta rule over documents spread across ranks -> `[L, Hv, Dv]`.
    q, k `[L, Hk, Dk]`, v `[L, Hv, Dv]`, g, beta `[L, Hv]`; `order_after`: the layer's earlier gather."""
    states = _states(ctx, q.device)
    plan = states.plan
    local = ctx.table("local_runs", lambda: plan.runs, q.device)
    out, final = kernel.fn(q, k, v, g, beta, local, None, True, torch_rule)
    hv, dk = v.shape[1], q.shape[2]
    n_carried = plan.carried.numel()
    if n_carried:
        rows = states.carried_rows
        carried = ctx.table("carried_runs", lambda: _carried_runs(plan), q.device)
        eye = torch.eye(dk, dtype=torch.float32, device=q.device).expand(n_carried, hv, dk, dk).contiguous()
        coeff, transition = kernel.fn(q.index_select(0, rows), k.index_select(0, rows), v.new_zeros(rows.numel(), hv, dk),
                                      g.index_select(0, rows), beta.index_select(0, rows), carried, eye, True, torch_rule)
    else:
        coeff, transition = None, final.new_zeros(0, hv, dk, dk)
    starts, gathered = carried_start_states(ctx, final, transition, torch.matmul, order_after)
    if starts is None:
        return after(out, gathered)
    corrections = [torch.einsum("thk,hkv->thv", coeff[a:b].float(), state) for (a, b), state in zip(states.carried_spans, starts)]
    return _add_rows(out, states.carried_rows, torch.cat(corrections))


def _decay_with_states(ctx: MixerContext, out, final, log_decay, contribution, order_after):
    """State passing for a recurrence whose transition is a decay per state entry or per head:
    `log_decay [R, *d]` over the carried rows (in `carried_rows` order), a run's transition exp(Σ
    log_decay) broadcast against its state; `contribution(span, decay [r, *d], state) -> [r, ...]` the
    start state's term in the rows `span` = (a, b) of the carried rows, decayed by `decay` to each."""
    states = _states(ctx, out.device)
    cumulative = [log_decay[a:b].cumsum(0) for a, b in states.carried_spans]
    transition = (torch.stack([c[-1] for c in cumulative]).exp() if cumulative
                  else log_decay.new_zeros((0,) + tuple(log_decay.shape[1:])))
    compose = lambda p, s: p.reshape(tuple(p.shape) + (1,) * (s.ndim - p.ndim)) * s  # noqa: E731
    starts, gathered = carried_start_states(ctx, final, transition, compose, order_after)
    if starts is None:
        return after(out, gathered)
    added = [contribution(span, cum.exp(), state) for span, cum, state in zip(states.carried_spans, cumulative, starts)]
    return _add_rows(out, states.carried_rows, torch.cat(added))


def ssd_with_states(ctx: MixerContext, kernel: MixerKernelRecord, x, dt, A, B, C, D, torch_scan, chunk_size: int, order_after):
    """This rank's rows of Mamba2's SSD scan over documents spread across ranks -> `[L, H, P]`.
    x `[L, H, P]`, dt `[L, H]` (after bias, softplus, clamp), A, D `[H]`, B, C `[L, G, N]`. The transition
    of a run is a scalar per head, exp(sum dt·A), and a start state S adds C_t·S, decayed from the run's
    start to row t, to each row t: no second scan."""
    states = _states(ctx, x.device)
    local = ctx.table("local_runs", lambda: states.plan.runs, x.device)
    out, final = kernel.fn(x, dt, A, B, C, D, local, None, True, torch_scan, chunk_size)
    rows, heads = states.carried_rows, x.shape[1]
    c_rows = C.index_select(0, rows).float().repeat_interleave(heads // C.shape[1], dim=1)  # [R, H, N]

    def contribution(span, decay, state):
        return torch.einsum("thn,hpn->thp", c_rows[span[0] : span[1]], state) * decay[..., None]

    log_decay = dt.index_select(0, rows).float() * A.float()  # [R, H], as the torch scan forms dt·A
    return _decay_with_states(ctx, out, final, log_decay, contribution, order_after)


def selective_scan_with_states(ctx: MixerContext, kernel: MixerKernelRecord, x, dt, A, B, C, D, torch_scan, order_after):
    """This rank's rows of Mamba1's selective scan over documents spread across ranks -> `[L, Dc]`.
    x, dt `[L, Dc]` (dt after bias and softplus), A `[Dc, N]`, B, C `[L, N]`, D `[Dc]`. The transition of
    a run is exp(A·sum dt) per channel and state entry; a start state S adds Σ_n C_t[n]·S[:, n] decayed
    from the run's start to row t."""
    states = _states(ctx, x.device)
    local = ctx.table("local_runs", lambda: states.plan.runs, x.device)
    out, final = kernel.fn(x, dt, A, B, C, D, local, None, True, torch_scan)
    rows = states.carried_rows
    c_rows = C.index_select(0, rows).float()  # [R, N]

    def contribution(span, decay, state):
        return torch.einsum("tn,tdn->td", c_rows[span[0] : span[1]], decay * state)

    log_decay = dt.index_select(0, rows).float()[:, :, None] * A.float()  # [R, Dc, N], as the torch scan
    return _decay_with_states(ctx, out, final, log_decay, contribution, order_after)


def lightning_with_states(ctx: MixerContext, kernel: MixerKernelRecord, q, k, v, slope, block_size: int):
    """This rank's rows of MiniMax's lightning attention over documents spread across ranks -> `[L, H, Dv]`.
    q, k `[L, H, Dk]`, v `[L, H, Dv]`, slope `[H]`. The transition of a run of n rows is λ^n per head
    (λ = exp(-slope)), and a start state S adds λ^(t+1)·q_t·S to its row t (counted from the run's
    start). The layer has no earlier collective: the state gather is ordered after `q`, which every rank
    trains through, so a rank whose runs are all padding (no final state with a gradient) still runs
    the gather's backward."""
    states = _states(ctx, q.device)
    local = ctx.table("local_runs", lambda: states.plan.runs, q.device)
    out, final = kernel.fn(q, k, v, slope, local, None, True, block_size)
    rows = states.carried_rows
    q_rows = q.index_select(0, rows).float()

    def contribution(span, decay, state):
        return torch.einsum("thk,hkv->thv", q_rows[span[0] : span[1]], state) * decay[..., None]

    log_decay = (-slope.detach().float()).expand(rows.numel(), -1)  # [R, H]
    return _decay_with_states(ctx, out, final, log_decay, contribution, q)


def _add_rows(out, rows, added):
    """`out` with `added` (fp32) added to its `rows`."""
    return out.index_copy(0, rows, (out.index_select(0, rows).float() + added).to(out.dtype))

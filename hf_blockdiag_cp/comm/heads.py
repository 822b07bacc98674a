"""Head-parallel transport (Ulysses-style): sequence shards <-> head shards, differentiable.

Each of the G ranks of a CP group holds L rows of the padded pack (its layout slots) and every
head. `seq_to_heads` gives each rank the whole pack for its own group of heads: rank j sends to
rank i the channels of head group i for its L rows, one `all_to_all_single`. The result comes
in slot order (rank-major); with `to_pack` (the layout's `slot_of_position`) it is put back in
pack order, so a per-document token mixer can run over consecutive positions. `heads_to_seq`
is the reverse: pack order back to slots (`to_slots`, the layout's flattened `slot_positions`),
then the all-to-all returns every head group of this rank's L rows.

An all-to-all with equal splits is its own adjoint, so backward runs the same collective on the
gradient. Buffers handed to the collective are made contiguous explicitly (gloo writes
contiguous bytes into whatever it is given; docs/design.md). Every rank issues one collective
per call whatever its rows hold, padding-only ranks and activation-checkpoint recompute
included (I5). Used by the gated delta-rule patch (`model_patches.gated_delta`) and by the
`heads` exchange of softmax attention (`comm.exchanges.heads`); an optional `ExchangeMeter`
counts the bytes this rank receives, forward and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .exchange import ExchangeMeter
from .group import group_ref, resolve_group
from .failure import guarded


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[G, ...] contiguous -> [G, ...]: block i goes to rank i; block i of the result came from rank i."""
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    guarded("heads all-to-all", group, dist.all_to_all_single, out, x, None, None, group)
    return out


def _foreign_bytes(x: torch.Tensor) -> int:
    """Bytes of the blocks of `x [G, ...]` that come from the other ranks."""
    return (x.shape[0] - 1) * x[0].numel() * x.element_size()


class _AllToAll(torch.autograd.Function):
    """Equal-split all-to-all over dim 0; backward is the same all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group, meter):
        ctx.group_ref = group_ref(group)  # weakly: a graph kept after a failure must not keep the group alive
        ctx.meter = meter
        out = _all_to_all(x.detach().contiguous(), group)
        if meter is not None:
            meter.forward_bytes += _foreign_bytes(out)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = _all_to_all(grad.contiguous(), resolve_group(ctx.group_ref))
        if ctx.meter is not None:
            ctx.meter.backward_bytes += _foreign_bytes(out)
        return out, None, None


def all_to_all_blocks(x: torch.Tensor, group, world_size: int, meter: ExchangeMeter | None = None) -> torch.Tensor:
    """Differentiable all-to-all of `x [G, ...]` (block i to rank i); identity when G = 1."""
    if x.shape[0] != world_size:
        raise ValueError(f"all_to_all_blocks: dim 0 of x must be the group size {world_size}; got shape {tuple(x.shape)}")
    if world_size == 1:
        return x
    return _AllToAll.apply(x, group, meter)


def seq_to_heads(
    x: torch.Tensor, group, world_size: int, to_pack: torch.Tensor | None = None, meter: ExchangeMeter | None = None
) -> torch.Tensor:
    """`x [L, G, C]` (this rank's rows; channels of head group i at [:, i]) -> `[G·L, C]`: every
    rank's rows for this rank's head group, in slot order, or in pack order with `to_pack`."""
    rows, groups, channels = x.shape
    if groups != world_size:
        raise ValueError(f"seq_to_heads: x must be [rows, {world_size} head groups, channels]; got {tuple(x.shape)}")
    out = all_to_all_blocks(x.transpose(0, 1).contiguous(), group, world_size, meter).reshape(world_size * rows, channels)
    return out if to_pack is None else out.index_select(0, to_pack)


def heads_to_seq(
    y: torch.Tensor, group, world_size: int, to_slots: torch.Tensor | None = None, meter: ExchangeMeter | None = None
) -> torch.Tensor:
    """`y [G·L, C]` (this rank's head group for every row; pack order with `to_slots`, else slot
    order) -> `[L, G, C]`: this rank's rows, head group i at [:, i]."""
    total, channels = y.shape
    if total % world_size:
        raise ValueError(f"heads_to_seq: {total} rows do not split over {world_size} ranks")
    if to_slots is not None:
        y = y.index_select(0, to_slots)
    out = all_to_all_blocks(y.reshape(world_size, total // world_size, channels).contiguous(), group, world_size, meter)
    return out.transpose(0, 1)

"""Head-parallel transport (Ulysses-style): sequence shards <-> head shards, differentiable.

Each of the G ranks of a CP group holds L rows of the padded pack (its layout slots) and every
head. `seq_to_heads` gives each rank the whole pack for its own group of heads: rank j sends to
rank i the channels of head group i for its L rows, one `all_to_all_single`. The result comes
in slot order (rank-major); with `to_pack` (the layout's `slot_of_position`) it is put back in
pack order, so a per-document token mixer can run over consecutive positions. `heads_to_seq`
is the reverse: pack order back to slots (`to_slots`, the layout's flattened `slot_positions`),
then the all-to-all returns every head group of this rank's L rows.

The collective is `blocks.all_to_all_blocks`: every rank issues one per call whatever its rows
hold, padding-only ranks and activation-checkpoint recompute included (I5). Used by the
head-parallel transport of recurrent token mixers (`mixers`) and by the `heads` exchange of
softmax attention (`comm.exchanges.heads`); an optional `ExchangeMeter` counts the bytes this
rank receives, forward and backward.
"""

from __future__ import annotations

import torch

from .blocks import all_to_all_blocks
from .exchange import ExchangeMeter


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

"""Recurrent token mixers (gated delta rule, short convolution) under CP, the pure part: the runs a
mixer restarts at, the two transports and what each costs.

A recurrent mixer restarts at every document: zero state at its first token, and a causal
convolution window that holds no token of the previous document. Under CP a document may start
on one rank and continue on others. Two transports make that exact:

- `heads` (head-parallel, as Megatron-Core does): one all-to-all gives every rank the whole pack,
  in pack order, for its share of the heads; the mixer runs over the pack's segments
  (`pack_runs`); a second all-to-all returns this rank's rows. Needs the heads divisible by G.
- `states` (state passing, as `fla.ops.cp` does): every rank runs the mixer over its own rows
  from a zero state (`StatePassingPlan.runs`). A run that continues a document from an earlier
  piece of the pack (`carried`) gets its true initial state after one all-gather of every
  piece's final state and transition: the state at the end of a run is affine in the state it
  starts from, S_end = P·S_start + F, so a carried run's state is the chain of the document's
  earlier pieces (`chains`), composed in pack order. The convolution gets the `width` rows before
  each piece from the pieces that hold them (`ConvHaloPlan`), by another all-gather. Any G, any
  layout; the gathers are the same size on every rank (`slots` blocks), padding-only ranks included.

`choose_mixer_transport` picks the cheaper for a step by `MixerCost` (bytes and mixer rows of the
busiest rank), as `auto` picks a K/V exchange. Pure: CPU integer tensors, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from .layout import Layout

MIXER_TRANSPORTS = ("heads", "states")
MIXER_DECAYS = ("matrix", "head", "entry")  # MixerShape.decay


@dataclass(frozen=True)
class MixerRuns:
    """Runs of consecutive rows a per-document mixer treats as one sequence: `boundaries [n + 1]`
    (host int64 offsets over the rows) and whether each run is a document (`is_document [n]`,
    bool). A padding run's output is zero. Rows of one document may form several runs (one per
    piece under state passing)."""

    boundaries: torch.Tensor
    is_document: torch.Tensor

    def __post_init__(self):
        b = self.boundaries
        if b.ndim != 1 or b.numel() < 2 or int(b[0]) != 0 or bool((b.diff() <= 0).any()):
            raise ValueError(f"MixerRuns: boundaries must be increasing offsets from 0; got {b.tolist()[:8]}")
        if self.is_document.shape != (b.numel() - 1,) or self.is_document.dtype != torch.bool:
            raise ValueError(f"MixerRuns: is_document must be bool [{b.numel() - 1}]; got {self.is_document.shape}")

    @property
    def num_rows(self) -> int:
        return int(self.boundaries[-1])

    @property
    def lengths(self) -> torch.Tensor:
        return self.boundaries.diff()

    @cached_property
    def row_is_document(self) -> torch.Tensor:
        """`[rows]` bool: whether each row lies in a document run."""
        return torch.repeat_interleave(self.is_document, self.lengths)

    @staticmethod
    def documents(cu_seqlens: torch.Tensor, num_rows: int, field_name: str = "cu_seq_lens_q") -> "MixerRuns":
        """Every run a document, from offsets such as Transformers' `cu_seq_lens_q` of a packed row."""
        bounds = cu_seqlens.detach().reshape(-1).to("cpu", torch.int64)
        if bounds.numel() < 2 or int(bounds[0]) != 0 or int(bounds[-1]) != num_rows or bool((bounds.diff() <= 0).any()):
            raise ValueError(
                f"{field_name} must be increasing offsets from 0 to the row length {num_rows}; got {bounds.tolist()[:8]}"
            )
        return MixerRuns(bounds, torch.ones(bounds.numel() - 1, dtype=torch.bool))


def pack_runs(layout: Layout) -> MixerRuns:
    """The padded pack's segments, in pack order: what the head-parallel transport's mixer runs over."""
    bounds = layout.segments.boundaries
    return MixerRuns(bounds, layout.document_ids[bounds[:-1]] > 0)


@dataclass(frozen=True)
class Piece:
    """A maximal run of consecutive pack positions held by one rank: `[start, stop)`, its local rows
    from `row`, and its block in the gathers (`rank`·slots + `slot`)."""

    rank: int
    slot: int
    start: int
    stop: int
    row: int


def pieces(layout: Layout) -> list[Piece]:
    """Every rank's pieces, in pack order."""
    out = []
    for rank in range(layout.cp_size):
        row = 0
        for slot, (start, stop) in enumerate(layout.held_intervals(rank).tolist()):
            out.append(Piece(rank, slot, start, stop, row))
            row += stop - start
    return sorted(out, key=lambda p: p.start)


def slots_per_rank(layout: Layout) -> int:
    """Blocks per rank in the state-passing gathers: the most pieces any rank holds."""
    return max(layout.held_intervals(r).shape[0] for r in range(layout.cp_size))


@dataclass(frozen=True)
class StatePassingPlan:
    """Rank `rank`'s recurrence under state passing.

    runs: its rows split at its pieces and at segments (`Layout.query_runs`), each run from a zero
      state in the local pass.
    carried: `[c]` the runs that continue a document from an earlier piece; `chains[i]` the gathered
      blocks (rank·slots + slot) of that document's earlier pieces in pack order: the first holds the
      document's start and sends its final state F; each later one lies inside the document and sends
      its transition P too. The state entering carried run i is F[c0], then P[c]·S + F[c] for the rest.
    export_final: `[slots]` the run whose final state each of this rank's blocks sends (-1: none, the
      piece's last run does not continue on a later piece). export_transition: `[slots]` the carried
      run whose transition the block sends (-1: none; only a piece that is one carried run that continues).
    """

    rank: int
    cp_size: int
    slots: int
    runs: MixerRuns
    carried: torch.Tensor
    chains: tuple[tuple[int, ...], ...]
    export_final: torch.Tensor
    export_transition: torch.Tensor

    @property
    def carried_rows(self) -> int:
        """Rows of the carried runs: what the transition pass runs over on this rank."""
        return int(self.runs.lengths[self.carried].sum()) if self.carried.numel() else 0


def _local_runs(layout: Layout, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(boundaries, first pack position, is document) of `rank`'s runs."""
    first, last = layout.query_runs(rank)
    pos = layout.slot_positions[rank]
    bounds = torch.cat([first, last[-1:] + 1])
    return bounds, pos[first], layout.document_ids[pos[first]] > 0


def plan_state_passing(layout: Layout, rank: int) -> StatePassingPlan:
    """`rank`'s `StatePassingPlan` for `layout` (see there). Every rank derives its plan from the
    same layout, so the blocks one rank reads are the ones their owners send."""
    seg = layout.segments
    slots = slots_per_rank(layout)
    all_pieces = pieces(layout)
    bounds, first_pos, is_doc = _local_runs(layout, rank)
    run_stop_pos = first_pos + bounds.diff()
    doc_stop = seg.boundaries[seg.segment_ids[first_pos] + 1]  # where each run's segment ends in the pack
    carried_mask = is_doc & (seg.segment_starts[first_pos] < first_pos)
    carried = torch.nonzero(carried_mask).reshape(-1)
    chains = []
    for i in carried.tolist():
        start = int(seg.segment_starts[first_pos[i]])
        before = [p for p in all_pieces if p.stop > start and p.start < int(first_pos[i])]
        chains.append(tuple(p.rank * slots + p.slot for p in before))
    export_final = torch.full((slots,), -1, dtype=torch.long)
    export_transition = torch.full((slots,), -1, dtype=torch.long)
    mine = [p for p in all_pieces if p.rank == rank]
    for piece in mine:
        last = int(torch.searchsorted(first_pos, torch.tensor(piece.stop), right=False)) - 1  # the piece's last run
        if not (bool(is_doc[last]) and int(run_stop_pos[last]) == piece.stop and int(doc_stop[last]) > piece.stop):
            continue
        export_final[piece.slot] = last
        if int(first_pos[last]) == piece.start and bool(carried_mask[last]):
            export_transition[piece.slot] = int((carried == last).nonzero()[0, 0])
    return StatePassingPlan(rank, layout.cp_size, slots, MixerRuns(bounds, is_doc), carried, tuple(chains),
                            export_final, export_transition)


@dataclass(frozen=True)
class ConvHaloPlan:
    """Rank `rank`'s causal convolution of `width` = kernel - 1 rows of history under state passing.

    Every rank sends the last `width` rows of each of its pieces (`send_rows [slots·width]`, local row
    indices, -1: a zero row) in one all-gather. The rank then convolves an extended sequence: before
    each of its pieces the `width` pack rows that precede it, taken from the gathered tails when they
    lie in the same document and zero otherwise (`ext_index` into [local rows; gathered rows; one
    zero row]); each piece's halo joins its first run (`ext_runs`), so zero rows change nothing, and
    `keep [L]` selects the local rows' outputs.
    """

    width: int
    send_rows: torch.Tensor
    ext_index: torch.Tensor
    ext_runs: MixerRuns
    keep: torch.Tensor


def plan_conv_halo(layout: Layout, rank: int, width: int) -> ConvHaloPlan:
    """`rank`'s `ConvHaloPlan` for a convolution with `width` rows of history (kernel size - 1)."""
    if width < 0:
        raise ValueError(f"plan_conv_halo: width must be >= 0; got {width}")
    seg, local = layout.segments, layout.local_len
    slots = slots_per_rank(layout)
    all_pieces = pieces(layout)
    starts = torch.tensor([p.start for p in all_pieces])
    zero = local + layout.cp_size * slots * width
    send = torch.full((slots, width), -1, dtype=torch.long)
    index, keep, run_bounds, run_doc = [], [], [0], []
    bounds, _, is_doc = _local_runs(layout, rank)
    for piece in (p for p in all_pieces if p.rank == rank):
        tail = torch.arange(max(piece.start, piece.stop - width), piece.stop) - piece.start + piece.row
        if width:
            send[piece.slot, width - tail.numel():] = tail
        doc_start = int(seg.segment_starts[piece.start]) if bool(layout.document_ids[piece.start] > 0) else piece.start
        for pos in range(piece.start - width, piece.start):
            if pos < doc_start:
                index.append(zero)
                continue
            owner = all_pieces[int(torch.searchsorted(starts, torch.tensor(pos), right=True)) - 1]
            index.append(local + (owner.rank * slots + owner.slot) * width + width - (owner.stop - pos))
        ext_start = len(index)
        index.extend(range(piece.row, piece.row + piece.stop - piece.start))
        keep.extend(range(ext_start, len(index)))
        inner = [int(b) for b in bounds.tolist() if piece.row < b < piece.row + piece.stop - piece.start]
        for b in inner + [piece.row + piece.stop - piece.start]:
            run_bounds.append(ext_start + b - piece.row)
        first_run = int(torch.searchsorted(bounds, torch.tensor(piece.row), right=True)) - 1
        run_doc.extend(is_doc[first_run : first_run + len(inner) + 1].tolist())
    ext_runs = MixerRuns(torch.tensor(run_bounds, dtype=torch.long), torch.tensor(run_doc, dtype=torch.bool))
    return ConvHaloPlan(width, send.reshape(-1), torch.tensor(index, dtype=torch.long), ext_runs,
                        torch.tensor(keep, dtype=torch.long))


# --------------------------------------------------------------------------- cost and choice


@dataclass(frozen=True)
class MixerShape:
    """One mixer layer's sizes: key heads and dim, value heads and dim, convolution channels and
    kernel size (0: none), the bytes of an activation element (2 in bf16). `decay`: what a run's
    transition is per value head: a [Dk, Dk] matrix (`"matrix"`, the delta rule), one number
    (`"head"`, Mamba2's SSD: key heads and dim are B and C's groups and state size) or one number per
    state entry (`"entry"`, Mamba1: one head of Dv channels, Dk state entries each);
    `head_parallel`: whether the mixer has the head-parallel transport; `gate_width`: the channels
    of the decay's gate input per value head (1; KDA: Dk, a decay per key channel)."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_channels: int = 0
    conv_kernel: int = 0
    bytes_per_element: int = 2
    decay: str = "matrix"
    head_parallel: bool = True
    gate_width: int = 1

    def __post_init__(self):
        if self.decay not in MIXER_DECAYS:
            raise ValueError(f"MixerShape: decay must be one of {', '.join(MIXER_DECAYS)}; got {self.decay!r}")

    @property
    def input_channels(self) -> int:
        """Per row into the mixer: q, k, v (the convolution's channels), one rate and `gate_width` decay
        gate inputs per value head."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim + (1 + self.gate_width) * self.value_heads

    @property
    def state_elements(self) -> int:
        """One transition and one final state per value head, fp32: [Hv, Dk, Dk + Dv] (`decay` "matrix"),
        [Hv, 1 + Dk·Dv] ("head") or [Hv, 2·Dk·Dv] ("entry")."""
        transition = {"matrix": self.key_dim * self.key_dim, "head": 1, "entry": self.key_dim * self.value_dim}
        return self.value_heads * (transition[self.decay] + self.key_dim * self.value_dim)


@dataclass(frozen=True)
class MixerCost:
    """Seconds per step of a mixer transport: bytes received over `bytes_per_second`, plus rows × value
    heads of mixer work (forward + backward) at `seconds_per_row_head` for 128 × 128 heads, scaled by
    Dk·Dv. Defaults: NCCL all-to-all between two H200s (assumed) and fla's chunked delta rule on an
    H200 (docs/models.md, "CP transports"); `mixer_cost_for` gives the one of a group's backend."""

    bytes_per_second: float = 150e9
    seconds_per_row_head: float = 2.7e-8

    def seconds(self, received_bytes: float, row_heads: float, shape: MixerShape) -> float:
        scale = shape.key_dim * shape.value_dim / (128 * 128)
        return received_bytes / self.bytes_per_second + row_heads * self.seconds_per_row_head * scale


DEFAULT_MIXER_COST = MixerCost()
# gloo sends CUDA tensors through host copies and TCP: about 1 GB/s between ranks on one H200, measured
# by benchmarks/mixer_transports.py (docs/models.md, "CP transports")
MIXER_COSTS = {"nccl": DEFAULT_MIXER_COST, "gloo": MixerCost(bytes_per_second=1e9)}


def mixer_cost_for(backend: str) -> MixerCost:
    """The `MixerCost` of a process group whose backend is `backend` (`torch.distributed.get_backend`);
    NCCL's for any backend without its own."""
    return MIXER_COSTS.get(backend, DEFAULT_MIXER_COST)


def heads_split_reason(shape: MixerShape, cp_size: int) -> str | None:
    """Why the head-parallel transport cannot split this layer over `cp_size` ranks, or None."""
    if not shape.head_parallel:
        return "this mixer has no head-parallel transport"
    if shape.key_heads % cp_size or shape.value_heads % cp_size:
        return (f"head-parallel needs the key heads ({shape.key_heads}) and value heads ({shape.value_heads}) "
                f"divisible by the CP size G={cp_size}")
    return None


def transport_bytes(layout: Layout, shape: MixerShape) -> dict[str, int]:
    """Bytes the busiest rank receives per layer, forward and backward together, for each transport that
    can run this layer over `layout`'s ranks: the head-parallel all-to-alls' rows, or state passing's
    gathered states (fp32) and convolution halos."""
    g, local = layout.cp_size, layout.local_len
    out = {}
    if heads_split_reason(shape, g) is None:
        out["heads"] = 2 * (g - 1) * local * (shape.input_channels + shape.value_heads * shape.value_dim) // g * shape.bytes_per_element
    halo = max(shape.conv_kernel - 1, 0) * shape.conv_channels * shape.bytes_per_element
    out["states"] = 2 * (g - 1) * slots_per_rank(layout) * (4 * shape.state_elements + halo)
    return out


def transport_seconds(layout: Layout, shape: MixerShape, cost: MixerCost = DEFAULT_MIXER_COST) -> dict[str, float]:
    """Predicted seconds of the busiest rank per layer (forward + backward) for each transport that can
    run this layer: `transport_bytes` plus the mixer rows it computes (the whole pack for its heads, or
    its own rows and, again, the carried ones for their transitions)."""
    g, moved = layout.cp_size, transport_bytes(layout, shape)
    out = {}
    if "heads" in moved:
        out["heads"] = cost.seconds(moved["heads"], layout.padded_seq_len * shape.value_heads / g, shape)
    busiest = max(plan_state_passing(layout, r).carried_rows for r in range(g))
    out["states"] = cost.seconds(moved["states"], (layout.local_len + busiest) * shape.value_heads, shape)
    return out


def choose_mixer_transport(requested: str, layout: Layout, shape: MixerShape, cost: MixerCost = DEFAULT_MIXER_COST) -> str:
    """The transport a mixer layer runs with: `requested` ("heads" or "states") if it can, else raise;
    "auto": the cheaper by `transport_seconds` (ties: states). One rank: "local". Deterministic in the
    layout, so every rank of a group chooses alike."""
    if layout.cp_size == 1:
        return "local"
    if requested == "heads":
        reason = heads_split_reason(shape, layout.cp_size)
        if reason is not None:
            raise ValueError(f"mixer_transport='heads' cannot run this layer: {reason}; use 'states' or 'auto'")
        return "heads"
    if requested == "states":
        return "states"
    if requested != "auto":
        raise ValueError(f"mixer_transport={requested!r} is not supported; accepted values: auto, {', '.join(MIXER_TRANSPORTS)}")
    seconds = transport_seconds(layout, shape, cost)
    return min(sorted(seconds, reverse=True), key=seconds.get)  # "states" first: it wins ties

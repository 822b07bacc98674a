"""One record per exchange, and the choice among them.

An exchange moves K/V rows over the CP group so that each rank's kernel gets the keys its
queries need, or (a head-parallel record, `heads`) moves q, k, v so that each rank attends over
the whole pack for its share of the heads. Its `ExchangeRecord` says how: a pure per-rank `plan` (which rows the exchange
returns to the rank and the tables its transport runs with), the rows it moves per layer
(`rows_per_layer`, read by `planning.cost` and by `auto`), when it cannot serve a layout
(`unsupported_reason`, with a `fallback`), its requirements (`needs_single_node`), its place
in `auto`, and the differentiable `transport` (forward collective, reverse in backward).

Adding an exchange: write one module under `hf_blockdiag_cp/comm/exchanges/` that defines its
transport and registers its record with `register_exchange`, add its import line to
`comm/exchanges/__init__.py`, and write its tests (the exchange tests iterate the registry,
so parity, bytes and fault tests cover it at once). Nothing else names an exchange: CPConfig's
`kv_exchange` spellings, the step's choice and consensus, and `planning.cost` read the records.

The registry lives here, below comm, so that pure planning (`planning.cost`) can read the
records; the records themselves are registered by the comm modules (`import hf_blockdiag_cp`
registers them all).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..registry import AUTO, Registry
from .exchange_plan import AttentionShape, ExchangeBytes, ExchangePlan, RankExchange
from .layout import Layout



@dataclass(frozen=True)
class ExchangeRecord:
    """An exchange and what it needs.

    plan(layout, exchange_plan, rank) -> RankExchange: pure; the rows returned to `rank` (pack
      positions, in the order the transport returns them: what a kernel with `takes_all_rows`
      receives), this rank's attention plan over those rows (the other kernels get the rows its
      `key_rows` select), and the transport's tables. `exchange_plan` is None when `needs_plan`
      is False.
    rows_per_layer(exchange_plan, rank) -> (forward, backward): rows `rank` receives per
      attention layer (K/V rows, then gradients of the rows it sent).
    transport(k, v, group, world_size, routes, meter) -> (k_rows, v_rows): differentiable; takes
      this rank's K `[L, Hkv, Dk]`, V `[L, Hkv, Dv]` and returns one row per `row_positions`
      entry. Every rank of the group issues the same collectives in the same order (I5).
    head_parallel: the record moves q, k, v to head shards and the outputs back, around the
      kernel: `transport(q, k, v, attend, group, world_size, routes, meter) -> [L, H, Dv]` from
      q `[L, H, Dk]`, k `[L, Hkv, Dk]`, v `[L, Hkv, Dv]`, where `attend(q, k, v, heads)` runs the
      local kernel over what the rank received (`heads`: the slice of query heads it holds). Its
      `plan` covers every query the rank's kernel sees (`plan_queries`), the whole pack.
    unsupported_heads(heads, kv_heads, cp_size) -> str | None: why a layer with these head counts
      cannot run over `cp_size` ranks (None: any; K/V exchanges never look at heads).
    row_bytes(shape, cp_size) -> int: bytes of one row `rows_per_layer` counts, when the rows are
      not K/V rows (`AttentionShape`; None: a K/V row, `shape.kv_row_bytes`).
    unsupported_reason(exchange_plan) -> str | None: why the exchange cannot serve a layout (None:
      any layout). An explicit request it cannot serve runs `fallback` (None: raise).
    begin(k, v, group, world_size, routes, meter) -> pending: the transport started without waiting
      (`comm.pending`; None: the exchange cannot overlap); `pending.wait(out)` returns `(k_rows, v_rows, out)`,
      the rows `transport` returns and `out` (the attention computed meanwhile) unchanged. Its
      backward starts the reverse collective once the rows' and `out`'s gradients are in, and
      waits for it only after `out`'s own backward ran (`CPConfig.overlap`, `planning.overlap`).
    needs_plan: whether `plan` reads the `ExchangePlan` (False: a step asked for this exchange by
      name skips planning the needed keys; such an exchange serves every layout).
    needs_single_node: `auto` skips it on a CP group over several nodes unless
      `CPConfig.allow_cross_node_a2a`.
    auto_priority: `auto` takes the cheapest exchange that serves the step (busiest rank's forward
      + backward rows); ties go to the lowest priority. None: never chosen by `auto`. A record
      with `row_bytes` cannot have one: the step chooses before any layer's head counts are known.
    """

    name: str
    plan: Callable[[Layout, ExchangePlan | None, int], RankExchange]
    rows_per_layer: Callable[[ExchangePlan, int], tuple[int, int]]
    transport: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    aliases: tuple[str, ...] = ()
    unsupported_reason: Callable[[ExchangePlan], str | None] | None = None
    fallback: str | None = None
    needs_plan: bool = True
    needs_single_node: bool = False
    auto_priority: int | None = None
    head_parallel: bool = False
    unsupported_heads: Callable[[int, int, int], str | None] | None = None
    row_bytes: Callable[[AttentionShape, int], int] | None = None
    begin: Callable[..., object] | None = None

    def __post_init__(self):
        if not self.needs_plan and self.unsupported_reason is not None:
            raise ValueError(f"exchange {self.name!r}: an exchange that needs no plan must serve every layout")
        if self.fallback == self.name:
            raise ValueError(f"exchange {self.name!r} cannot fall back to itself")
        if self.row_bytes is not None and self.auto_priority is not None:
            raise ValueError(
                f"exchange {self.name!r}: `auto` compares K/V rows before any layer's heads are known, so a record "
                "whose rows are not K/V rows (row_bytes) needs auto_priority=None"
            )
        if self.head_parallel and self.begin is not None:
            raise ValueError(f"exchange {self.name!r}: `begin` overlaps K/V rows with attention; a head-parallel record has none")
        if self.head_parallel and (self.unsupported_heads is None or self.row_bytes is None):
            raise ValueError(f"exchange {self.name!r}: a head-parallel record needs unsupported_heads and row_bytes")

    def reason(self, plan: ExchangePlan | None) -> str | None:
        """Why this exchange cannot serve the layout of `plan`, or None if it can."""
        return None if self.unsupported_reason is None else self.unsupported_reason(plan)

    def heads_reason(self, heads: int, kv_heads: int, cp_size: int) -> str | None:
        """Why this exchange cannot run a layer of `heads` query and `kv_heads` kv heads over `cp_size` ranks, or None."""
        return None if self.unsupported_heads is None else self.unsupported_heads(heads, kv_heads, cp_size)

    def plan_queries(self, layout: Layout) -> int:
        """Queries in a rank's plan: its L rows, or the whole pack for a head-parallel exchange."""
        return layout.padded_seq_len if self.head_parallel else layout.local_len

    def bytes_per_layer(self, plan: ExchangePlan, rank: int, row_bytes: int) -> ExchangeBytes:
        """Bytes `rank` receives per attention layer; `row_bytes` = Hkv·(Dk+Dv)·element size (`kv_row_bytes`).
        K/V exchanges only: the others' bytes depend on the query heads (`layer_bytes`)."""
        if self.row_bytes is not None:
            raise ValueError(
                f"exchange {self.name!r} moves more than K/V rows; its bytes need the layer's heads: "
                "use layer_bytes(plan, rank, AttentionShape(...))"
            )
        forward, backward = self.rows_per_layer(plan, rank)
        return ExchangeBytes(forward * row_bytes, backward * row_bytes)

    def layer_bytes(self, plan: ExchangePlan, rank: int, shape: AttentionShape) -> ExchangeBytes:
        """Bytes `rank` receives per attention layer of `shape`, for any exchange."""
        row = shape.kv_row_bytes if self.row_bytes is None else self.row_bytes(shape, plan.cp_size)
        forward, backward = self.rows_per_layer(plan, rank)
        return ExchangeBytes(forward * row, backward * row)

    def max_rows(self, plan: ExchangePlan) -> int:
        """Forward + backward rows received by the busiest rank: the cost `auto` compares."""
        return max(sum(self.rows_per_layer(plan, r)) for r in range(plan.cp_size))


EXCHANGES: Registry[ExchangeRecord] = Registry("kv_exchange", "an exchange")


def register_exchange(record: ExchangeRecord) -> ExchangeRecord:
    """Add (or replace, by name) an exchange; its name and aliases become accepted `kv_exchange` spellings."""
    return EXCHANGES.register(record)


def unregister_exchange(name: str) -> ExchangeRecord | None:
    """Remove exchange `name` and its spellings; return its record (None if it was not registered)."""
    return EXCHANGES.unregister(name)


def exchange_names() -> tuple[str, ...]:
    """The registered exchanges, in registration order."""
    return EXCHANGES.names()


def exchange_records() -> tuple[ExchangeRecord, ...]:
    return EXCHANGES.records()


def get_exchange(name: str) -> ExchangeRecord:
    return EXCHANGES.get(name)


def canonical_exchange_name(spelling: str) -> str:
    """The canonical name (or "auto") for any accepted spelling of `kv_exchange` (case and '-'/'_' insensitive)."""
    return EXCHANGES.canonical(spelling)


def auto_order() -> list[ExchangeRecord]:
    """The records `auto` may choose, in tie-break order."""
    return EXCHANGES.auto_order()


def choose_exchange(requested: str, plan: ExchangePlan | None, cross_node_ok: bool = True) -> str:
    """The exchange a step runs, from the configured name (canonical, or "auto") and the plan.

    - a named exchange: itself if it serves the layout, else its `fallback` (halo hands over to
      a2a), so a long document never makes a step fail; `plan` may be None if it `needs_plan` not;
    - `auto`: among the records with an `auto_priority` that serve the layout (and, unless
      `cross_node_ok`, do not need a single node), the cheapest by the busiest rank's forward +
      backward rows; ties go to the lowest priority (with the shipped records: halo when it is
      valid and cheaper than allgather, else a2a when cheaper, else allgather).
    Deterministic in the plan, so every rank of a group that agrees on the pack agrees here.
    """
    if requested != AUTO:
        record, tried = get_exchange(requested), {}
        while (reason := EXCHANGES.refusal(record, lambda r: r.reason(plan))) is not None:
            tried[record.name] = reason
            if record.fallback is None or record.fallback in tried:
                why = "; ".join(f"{name}: {r}" for name, r in tried.items())
                raise ValueError(f"kv_exchange={requested!r} cannot serve this layout ({why})")
            record = get_exchange(record.fallback)
        return record.name
    if plan is None:
        raise ValueError("kv_exchange='auto' needs the step's exchange plan")
    candidates, skipped = [], []
    for record in auto_order():
        reason = EXCHANGES.refusal(record, lambda r: r.reason(plan))
        if reason is None and record.needs_single_node and not cross_node_ok:
            reason = "needs a single node (set allow_cross_node_a2a=True to allow it across nodes)"
        if reason is None:
            candidates.append(record)
        else:
            skipped.append(f"{record.name}: {reason}")
    if not candidates:
        raise ValueError(f"kv_exchange='auto' found no exchange for this layout: {'; '.join(skipped)}")
    return min(candidates, key=lambda r: r.max_rows(plan)).name  # min keeps the first of equals

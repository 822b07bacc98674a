"""Overlap plans: what of a rank's attention can run while its K/V exchange is in flight.

Split by queries (`plan_overlap`, `CPConfig(overlap="queries")`). A query run (consecutive local
queries of one segment, `plan_rank`) whose keys all lie on the rank itself, or a run of padding
(which attends over the padding rows the rank holds: its output reaches no real token), needs
nothing from the exchange: its attention can run before the exchange has delivered.
`plan_overlap` splits a rank's plan into that *local* part and the *remote* rest, each a
`RankPlan` of its own over a subset of the query runs:

- local: key rows index the rank's own L rows (its shard of K and V, as the model computed them);
- remote: key rows index the rows the exchange returns, as in the full plan.

Each query keeps all its keys inside one part, so each part's kernel computes complete
softmax rows and the parts' outputs are simply put back in query order: exact by construction,
for every kernel, with no log-sum-exp merge. The gain is the local part's share of the work
(most of a rank's documents in a contiguous or balanced layout; none on a rank whose every
query continues a document begun on another rank).

Split by keys (`plan_key_overlap`, `CPConfig(overlap="keys")`). Every query attends over the keys
its rank holds while the exchange is in flight (the *local* part: all query runs, causal, since
a run's own positions end its local keys and every other local key precedes them), then over the
keys of other ranks once they arrived (the *remote* part: the runs that have such keys, and only
those keys, which all precede the run's queries: `RankPlan.causal` False). The two partial
softmaxes are merged by their log-sum-exp (`kernels.attention.lse`). The gain is the work over held keys
(`planning.key_local_work`), never less than the query split's. Padding runs attend over the
padding rows the rank holds, in the local part only, as in the query split.

Pure: CPU integer tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import Layout
from .rank_plan import RankPlan, offsets, range_or_index
from .segments import ranges


@dataclass(frozen=True)
class QueryPart:
    """One part of a rank's queries: which local query rows (`queries`, a range or an index, in
    increasing order), their attention plan (`plan`, key rows into `row_positions`), and the pack
    position of every row its kernel receives (`row_positions`)."""

    queries: tuple[int, int] | torch.Tensor
    plan: RankPlan
    row_positions: torch.Tensor

    @property
    def num_queries(self) -> int:
        return int(self.plan.q_positions.numel())


@dataclass(frozen=True)
class OverlapPlan:
    """A rank's queries split into the part that attends during the exchange and the part after it.

    `local` / `remote` is None when it has no query. Split by queries: `merge_index` puts
    `cat([local_out, remote_out])` back in query order (None: already in order, e.g. a contiguous
    shard whose first run continues a document is `remote_first`). Split by keys (`by_keys`): the
    local part holds every query and the remote part's outputs merge into its rows by log-sum-exp."""

    local: QueryPart | None
    remote: QueryPart | None
    merge_index: torch.Tensor | None
    remote_first: bool = False
    by_keys: bool = False

    @property
    def local_queries(self) -> int:
        return 0 if self.local is None else self.local.num_queries


def _run_of_key(plan: RankPlan) -> torch.Tensor:
    cu_k = plan.cu_seqlens_k.long()
    return torch.repeat_interleave(torch.arange(cu_k.numel() - 1), cu_k[1:] - cu_k[:-1])


def _part(plan: RankPlan, keep: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor, row_positions: torch.Tensor,
          causal: bool = True):
    """The runs `keep` of `plan`, with the keys `keys` (a mask over the plan's keys that keeps, of
    each kept run, a subset ending with the run's own positions; with `causal` False, a subset
    before them), as a plan of their own whose keys are read from `key_rows` (one row per key of
    `plan`); None without a run."""
    if not bool(keep.any()):
        return None
    cu_q = plan.cu_seqlens_q.long()
    q_lens = (cu_q[1:] - cu_q[:-1])[keep]
    q_index = ranges(cu_q[:-1][keep], q_lens)
    run = _run_of_key(plan)
    k_index = torch.nonzero(keys & keep[run]).reshape(-1)
    k_lens = torch.bincount(run[k_index], minlength=keep.numel())[keep]
    sub = RankPlan(
        rank=plan.rank,
        q_positions=plan.q_positions[q_index],
        q_segments=plan.q_segments[q_index],
        key_rows=range_or_index(key_rows[k_index]),
        k_positions=plan.k_positions[k_index],
        k_segments=plan.k_segments[k_index],
        cu_seqlens_q=offsets(q_lens),
        cu_seqlens_k=offsets(k_lens),
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(k_lens.max()),
        causal=causal,
    )
    return QueryPart(range_or_index(q_index), sub, row_positions)


def _all_rows(key_rows: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    return torch.arange(*key_rows) if isinstance(key_rows, tuple) else key_rows.long()


def _index(queries) -> torch.Tensor:
    return torch.arange(*queries) if isinstance(queries, tuple) else queries


def _keys_on_rank(layout: Layout, rank: int, plan: RankPlan):
    """Per key of `plan`: its slot, and whether `rank` holds it; per run: whether it is padding and
    whether every one of its keys is on `rank`."""
    slot = layout.slot_of_position[plan.k_positions]
    on_rank = slot // layout.local_len == rank
    cu_q, cu_k = plan.cu_seqlens_q.long(), plan.cu_seqlens_k.long()
    foreign = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum((~on_rank).long(), 0)])
    padding = layout.document_ids[plan.q_positions[cu_q[:-1]]] == 0
    return slot, on_rank, padding, foreign[cu_k[1:]] == foreign[cu_k[:-1]]


def plan_overlap(layout: Layout, rank: int, plan: RankPlan, row_positions: torch.Tensor) -> OverlapPlan:
    """Split `rank`'s `plan` (key rows into the exchange's rows, `row_positions`) into the query runs
    whose keys are all on `rank` and the others."""
    local_len = layout.local_len
    slot, on_rank, padding, all_held = _keys_on_rank(layout, rank, plan)
    # A run is local when no key is foreign; a padding run always is, over the padding rows this
    # rank holds (its output reaches no real token, as in the needed-keys exchanges' plans).
    local_runs = all_held | padding
    local_keys = on_rank | ~padding[_run_of_key(plan)]
    local = _part(plan, local_runs, local_keys, slot - rank * local_len, layout.slot_positions[rank])
    everything = torch.ones_like(on_rank)
    remote = _part(plan, ~local_runs, everything, _all_rows(plan.key_rows), row_positions)
    merge_index, remote_first = None, False
    if local is not None and remote is not None:
        lq, rq = _index(local.queries), _index(remote.queries)
        if int(rq[-1]) < int(lq[0]):
            remote_first = True
        elif not int(lq[-1]) < int(rq[0]):
            order = torch.cat([lq, rq])
            merge_index = torch.empty_like(order)
            merge_index[order] = torch.arange(order.numel())
    return OverlapPlan(local, remote, merge_index, remote_first)


def plan_key_overlap(layout: Layout, rank: int, plan: RankPlan, row_positions: torch.Tensor) -> OverlapPlan:
    """Split `rank`'s `plan` (key rows into the exchange's rows, `row_positions`) by keys: every run
    over the keys `rank` holds (read from its own rows), and the runs with keys on other ranks over
    those keys alone (read from the exchange's rows, all before the run: not causal)."""
    slot, on_rank, padding, all_held = _keys_on_rank(layout, rank, plan)
    every_run = torch.ones_like(padding)
    local = _part(plan, every_run, on_rank, slot - rank * layout.local_len, layout.slot_positions[rank])
    remote = _part(plan, ~all_held & ~padding, ~on_rank, _all_rows(plan.key_rows), row_positions, causal=False)
    return OverlapPlan(local, remote, None, by_keys=True)

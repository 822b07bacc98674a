"""A bad plan on one rank of a real gloo group makes every rank of the CP group raise at the
step's consensus, before any exchange; nothing hangs (invariants I5 and I7, docs/design.md),
whichever exchange the step runs. The host-side plan validation itself is in
unit/test_plan_validation.py."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import ExchangeRecord, exchange_names, exchange_records
from helpers.exchanges import registered_exchange
from helpers.packs import make_pack


def _corrupted(record: ExchangeRecord) -> ExchangeRecord:
    """`record` whose per-rank plans claim one key too many as the longest key run."""

    def plan(layout, exchange_plan, rank):
        mine = record.plan(layout, exchange_plan, rank)
        return dataclasses.replace(mine, rank_plan=dataclasses.replace(mine.rank_plan, max_seqlen_k=mine.rank_plan.max_seqlen_k + 1))

    return dataclasses.replace(record, plan=plan)


def bad_plan_case(rank, world_size, group, exchange, failing_rank):
    _, batch = make_pack("span_all", world_size)
    with contextlib.ExitStack() as stack:
        if rank == failing_rank:
            for record in exchange_records():
                stack.enter_context(registered_exchange(_corrupted(record)))
        bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=bdcp.CPConfig(attn_backend="dense", kv_exchange=exchange))
    return "finished"


@pytest.mark.parametrize("exchange", exchange_names())
def test_bad_plan_on_one_rank_fails_every_rank_at_the_consensus(gloo, exchange):
    world_size = 2
    pool = gloo(world_size)
    results, errors = pool.run_collecting(bad_plan_case, timeout=120.0, exchange=exchange, failing_rank=1)
    assert not results, f"ranks {sorted(results)} did not raise: {results}"
    assert "ValueError" in errors[1] and "max_seqlen_k must be the exact maximum" in errors[1], errors[1]
    assert "another rank of the CP group rejected its batch" in errors[0], errors[0]

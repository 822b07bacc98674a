"""A bad plan on one rank of a real gloo group makes every rank of the CP group raise at the
step's consensus, before any exchange; nothing hangs (invariants I5 and I7, docs/design.md).
The host-side plan validation itself is in unit/test_plan_validation.py."""

from __future__ import annotations

import dataclasses

import hf_blockdiag_cp as bdcp
from helpers.packs import make_pack


def bad_plan_case(rank, world_size, group, failing_rank):
    import hf_blockdiag_cp.step.build as build

    original = build.plan_rank

    def corrupted(layout, r):
        plan = original(layout, r)
        return dataclasses.replace(plan, max_seqlen_k=plan.max_seqlen_k + 1) if rank == failing_rank else plan

    build.plan_rank = corrupted
    try:
        _, batch = make_pack("span_all", world_size)
        bdcp.make_cp_blockdiag_batch_and_ctx(
            group, None, batch, config=bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather")
        )
    finally:
        build.plan_rank = original
    return "finished"


def test_bad_plan_on_one_rank_fails_every_rank_at_the_consensus(gloo):
    world_size = 2
    pool = gloo(world_size)
    results, errors = pool.run_collecting(bad_plan_case, timeout=120.0, failing_rank=1)
    assert not results, f"ranks {sorted(results)} did not raise: {results}"
    assert "ValueError" in errors[1] and "max_seqlen_k must be the exact maximum" in errors[1], errors[1]
    assert "another rank of the CP group rejected its batch" in errors[0], errors[0]

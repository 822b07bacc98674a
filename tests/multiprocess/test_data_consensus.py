"""CP ranks of a real gloo group that receive different or malformed packs all raise a clear
error instead of hanging, and the group stays usable (invariants I5 and I7, docs/design.md);
CP peers whose samplers agree run every step. The samplers themselves are tested in
unit/test_data_distribution.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import PackedBatchSampler, packed_dataloader
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from helpers.data import random_lengths


def _docs(seed: int, n: int = 30) -> list[dict]:
    return [{"input_ids": [t % 97 + 1 for t in range(seed * 1000 + 50 * i, seed * 1000 + 50 * i + n_tok)]}
            for i, n_tok in enumerate(random_lengths(n, 30, seed))]


def _outcome(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects every rank's error
        return type(exc).__name__, str(exc)
    return "ok", ""


def _group_still_in_step(group, world_size) -> bool:
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t) == world_size


def mismatched_packs_case(rank, world_size, group, presharded):
    """Every rank collates a different pack (same shape): all must raise, then the group still works."""
    docs = _docs(seed=rank)
    collator = BlockdiagCPCollator(32, cp_size=world_size, cp_rank=rank if presharded else None)
    batch = collator(docs[:1])
    result = _outcome(lambda: bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch))
    return result, _group_still_in_step(group, world_size)


@pytest.mark.parametrize("presharded", [False, True])
def test_mismatched_packs_raise_on_every_cp_rank(gloo, presharded):
    results = gloo(2).run(mismatched_packs_case, timeout=60, presharded=presharded)
    for rank, ((kind, message), in_step) in enumerate(results):
        assert kind == "RuntimeError", f"rank {rank}: {kind} {message}"
        assert "received different packs" in message and "input ids" in message, message
        assert in_step, f"rank {rank}: the group fell out of step after the error"


def dataloader_steps_case(rank, world_size, group, seeds):
    """CP peers each build their own loader (seed per rank) and run the shard step on every batch."""
    docs = _docs(seed=0, n=60)
    loader = packed_dataloader(docs, 48, cp_size=world_size, cp_rank=rank, seed=seeds[rank], buffer_size=16)
    steps = 0
    for batch in loader:
        kind, message = _outcome(lambda: bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch))
        if kind != "ok":
            return steps, kind, message, _group_still_in_step(group, world_size)
        steps += 1
    return steps, "ok", "", _group_still_in_step(group, world_size)


def test_cp_peers_with_equal_sampler_arguments_agree_every_step(gloo):
    results = gloo(2).run(dataloader_steps_case, timeout=60, seeds=[5, 5])
    n_steps = len(PackedBatchSampler([len(d["input_ids"]) for d in _docs(0, 60)], 48, seed=5, buffer_size=16))
    assert n_steps > 5
    assert [r[:3] for r in results] == [(n_steps, "ok", "")] * 2 and all(r[3] for r in results)


def test_cp_peers_with_different_seeds_fail_at_the_first_step(gloo):
    results = gloo(2).run(dataloader_steps_case, timeout=60, seeds=[5, 6])
    for rank, (steps, kind, message, in_step) in enumerate(results):
        assert (steps, kind) == (0, "RuntimeError"), f"rank {rank}: {steps} {kind} {message}"
        assert "received different packs" in message
        assert in_step


def malformed_batch_case(rank, world_size, group):
    """Rank 1's labels are one token short; rank 0's batch is fine."""
    batch = BlockdiagCPCollator(16)([{"input_ids": list(range(1, 11))}])
    if rank == 1:
        batch["labels"] = batch["labels"][:, :-1]
    result = _outcome(lambda: bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch))
    return result, _group_still_in_step(group, world_size)


def test_malformed_batch_on_one_rank_raises_on_every_rank(gloo):
    (ok_rank, in_step0), (bad_rank, in_step1) = gloo(2).run(malformed_batch_case, timeout=60)
    assert bad_rank[0] == "ValueError" and "batch['labels'] has sequence length 15, expected 16" in bad_rank[1], bad_rank
    assert ok_rank[0] == "RuntimeError" and "another rank of the CP group rejected its batch" in ok_rank[1], ok_rank
    assert in_step0 and in_step1

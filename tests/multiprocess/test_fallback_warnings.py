"""Fallbacks that change what runs are WARNINGs, once per run, on rank 0 only (comm/notice.py): a
row without document boundaries trained as one document, a named `halo` exchange that hands a
pack over to `a2a`, `overlap="keys"` taking another kernel than `auto` takes otherwise (one whose
log-sum-exp is verified), and documents split at the pack size. Each case runs twice on every
rank of a fresh pool (the notices are once per process, so no earlier test may have seen them)."""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data import PackedBatchSampler
from helpers.dist_pool import GlooPool
from helpers.logs import library_logs
from helpers.reference import build_models, make_pack

WORLD_SIZE = 3


def _no_boundaries(group):
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    bdcp.make_cp_blockdiag_batch_and_ctx(group, None, {"input_ids": ids, "labels": ids.clone()})


def _halo_fallback(group):
    _, batch = make_pack("span_all", WORLD_SIZE)  # one document over every rank: beyond halo's left neighbours
    _, _, layout = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=bdcp.CPConfig(kv_exchange="halo"))
    assert layout.cp_size == WORLD_SIZE


def _split_documents(group):
    PackedBatchSampler([5, 37, 11, 50], 24)


def _overlap_keys_kernel(group):
    """`auto` prefers a kernel without a log-sum-exp output (registered for this case: on CPU `auto` has
    only `dense`), so the split by keys runs `dense` instead: what fa4 at an unverified head dim does."""
    from hf_blockdiag_cp.kernels.attention import get_kernel, registry

    dense = get_kernel("dense")
    record = registry.KernelRecord(name="no_lse_case", fn=dense.fn, check=lambda *args: None, auto_priority=-1,
                                   auto_devices=None)
    registry.register_kernel(record)
    try:
        _, model = build_models("llama")
        _, batch = make_pack("span_all", WORLD_SIZE)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch,
                                                                   config=bdcp.CPConfig(overlap="keys"))
        with train_ctx() as step:
            model(**local).loss.backward()
        assert step.choices.kernels == ("dense",), step.choices
    finally:  # the pool's processes serve no other test, but leave the registry as it was
        registry.KERNELS.unregister(record.name)


CASES = {
    "one document": (_no_boundaries, "treated as ONE document"),
    "halo": (_halo_fallback, "kv_exchange='halo' cannot serve some packs of this run"),
    "split documents": (_split_documents, "2 of 4 documents (87 tokens) are longer than max_tokens=24"),
    "overlap keys": (_overlap_keys_kernel, "overlap='keys' runs the dense kernel instead of no_lse_case"),
}


def fallback_case(rank, world_size, group, case):
    run, _ = CASES[case]
    with library_logs() as messages:
        for _ in range(2):
            run(group)
    return messages


@pytest.fixture(scope="module")
def fresh_pool():
    pool = GlooPool(WORLD_SIZE)
    yield pool
    pool.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_fallback_warns_once_on_rank_0(fresh_pool, case):
    _, expected = CASES[case]
    for rank, messages in enumerate(fresh_pool.run(fallback_case, case=case)):
        matching = [m for m in messages if expected in m]
        assert len(matching) == (1 if rank == 0 else 0), f"rank {rank}: {messages}"

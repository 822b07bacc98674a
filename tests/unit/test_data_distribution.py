"""Data distribution: DP replicas get disjoint packs that together are the epoch, CP peers
get identical packs, and a pre-sharded batch keeps its layout. CP ranks of a real gloo group
that receive different or malformed packs: multiprocess/test_data_consensus.py."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.comm import DPCPCoordinates
from hf_blockdiag_cp.data import DocumentPiece, PackedBatchSampler, packed_dataloader
from hf_blockdiag_cp.data.packing import PackingStats
from helpers.data import random_lengths


def pack_key(pack) -> tuple:
    return tuple((i.index, i.start) if isinstance(i, DocumentPiece) else (i, 0) for i in pack)


@settings(max_examples=100, deadline=None)
@given(dp_size=st.integers(1, 8), cp_size=st.integers(1, 8))
def test_dp_cp_coordinates_cp_fastest(dp_size, cp_size):
    """Every rank gets one (dp_rank, cp_rank) cell of the dp x cp grid, and consecutive ranks share a
    CP group: rank = dp_rank * cp_size + cp_rank, the group being the ranks with its dp_rank."""
    world_size = dp_size * cp_size
    table = [DPCPCoordinates(world_size, r, cp_size) for r in range(world_size)]
    assert {c.dp_size for c in table} == {dp_size}
    assert [c.dp_rank * cp_size + c.cp_rank for c in table] == list(range(world_size))
    assert all(0 <= c.dp_rank < dp_size and 0 <= c.cp_rank < cp_size for c in table)
    for c in table:
        assert c.cp_group_ranks == [r for r in range(world_size) if table[r].dp_rank == c.dp_rank]
        assert c.cp_group_ranks[c.cp_rank] == c.rank


def test_dp_cp_coordinates_invalid_arguments_name_the_field():
    with pytest.raises(ValueError, match="world size 6 is not divisible by cp_size=4"):
        DPCPCoordinates(6, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, world_size=4\)"):
        DPCPCoordinates(4, 4, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        DPCPCoordinates(4, 0, 0)
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        DPCPCoordinates(0, 0, 1)


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 250), max_tokens=st.integers(1, 96), seed=st.integers(0, 2**16), buffer_size=st.integers(1, 80),
       dp_size=st.integers(1, 4), drop_last=st.booleans())
def test_replicas_get_disjoint_packs_that_cover_the_epoch(n, max_tokens, seed, buffer_size, dp_size, drop_last):
    # Lengths up to 2.5 x max_tokens (oversized examples are split into pieces), plus one exactly full.
    lengths = random_lengths(n, 5 * max_tokens // 2 + 1, seed=seed) + [max_tokens]
    args = dict(buffer_size=buffer_size, seed=seed, dp_size=dp_size, drop_last=drop_last)
    samplers = [PackedBatchSampler(lengths, max_tokens, dp_rank=r, **args) for r in range(dp_size)]
    per_replica = [[pack_key(p) for p in s] for s in samplers]
    epoch = [pack_key(p) for p in samplers[0].epoch_packs()]
    assert len(set(epoch)) == len(epoch)
    assert len({len(packs) for packs in per_replica}) == 1, "every replica steps the same number of times"
    assert all(len(s) == len(per_replica[0]) for s in samplers)
    owners = {}
    for rank, packs in enumerate(per_replica):
        for p in packs:
            owners.setdefault(p, set()).add(rank)
    if drop_last:
        assert all(len(o) == 1 for o in owners.values()), "replicas must not share packs"
        assert len(owners) == len(epoch) - len(epoch) % dp_size
        assert set(owners) <= set(epoch)
    else:
        assert set(owners) == set(epoch), "the union of the replicas' packs is the epoch"
        repeated = sum(len(packs) for packs in per_replica) - len(epoch)
        assert repeated == (-len(epoch)) % dp_size, "only the last round is filled, by repeating packs"
    total = PackingStats()
    for s in samplers:
        total = total + s.stats
    assert total.packs == sum(len(p) for p in per_replica)
    assert total.pack_tokens == max_tokens * total.packs
    if dp_size == 1:
        assert total.real_tokens == sum(lengths)


@settings(max_examples=20, deadline=None)
@given(lengths_seed=st.integers(0, 2**16), seed=st.integers(0, 2**16))
def test_cp_peers_identical_and_epochs_reshuffle_yet_cover_everything(lengths_seed, seed):
    """150 documents make about 70 packs: two epochs' shuffles coincide with a negligible probability."""
    lengths = random_lengths(150, 40, seed=lengths_seed)
    peers = [PackedBatchSampler(lengths, 48, seed=seed, dp_size=2, dp_rank=1, buffer_size=64) for _ in range(2)]
    assert list(peers[0]) == list(peers[1])
    epoch0 = list(peers[0])
    for s in peers:
        s.set_epoch(1)
    epoch1 = list(peers[0])
    assert epoch1 == list(peers[1]) and epoch1 != epoch0
    peers[0].set_epoch(0)
    assert list(peers[0]) == epoch0, "an epoch's packs are reproducible"
    solo = PackedBatchSampler(lengths, 48, seed=seed, buffer_size=64)
    for epoch in (0, 1):
        solo.set_epoch(epoch)
        assert sorted(i for pack in solo for i in pack) == list(range(150))
        assert all(sum(lengths[i] for i in pack) <= 48 for pack in solo)
    unshuffled = PackedBatchSampler(lengths, 48, shuffle=False, buffer_size=64)
    assert all(pack == sorted(pack) for pack in unshuffled)


def test_dataset_lengths_from_columns():
    datasets = pytest.importorskip("datasets")
    rows = [{"input_ids": list(range(n)), "length": n} for n in (3, 0, 7, 5)]
    ds = datasets.Dataset.from_list(rows).select([2, 0, 3, 1])
    from hf_blockdiag_cp.data import dataset_lengths

    assert dataset_lengths(ds) == [7, 3, 5, 0]
    assert dataset_lengths(ds, "length") == [7, 3, 5, 0]
    assert dataset_lengths(rows) == [3, 0, 7, 5]
    with pytest.raises(ValueError, match="length_key='tokens' is not a column"):
        dataset_lengths(ds, "tokens")
    with pytest.raises(ValueError, match=r"lengths has 2 entries; expected 4"):
        packed_dataloader(ds, 8, lengths=[1, 2])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"buffer_size": 0}, "buffer_size must be a positive integer"),
        ({"dp_size": 2, "dp_rank": 2}, r"dp_rank must be an integer in \[0, dp_size=2\)"),
        ({"oversize": "drop"}, "oversize must be one of"),
    ],
)
def test_sampler_invalid_arguments_name_the_field(kwargs, message):
    args = {"max_tokens": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        PackedBatchSampler([1, 2, 3], **args)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a non-negative integer"):
        PackedBatchSampler([1, -2], 8)


def test_a_presharded_batch_keeps_its_layout():
    """A batch sharded by the collator (or `shard_batch`) keeps the layout it was sharded with: the
    step's config shards only full packs."""
    import hf_blockdiag_cp as bdcp

    full = bdcp.BlockdiagCPCollator(max_tokens=16)([{"input_ids": list(range(1, 10))}, {"input_ids": [3, 4, 5]}])
    local = bdcp.shard_batch(full, 1, 0, config=bdcp.CPConfig(layout="balanced"))
    for config in (None, bdcp.CPConfig(layout="contiguous")):
        _, _, layout = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, local, config=config)
        assert layout.strategy == "balanced"
    _, _, layout = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, full, config=bdcp.CPConfig(layout="balanced"))
    assert layout.strategy == "balanced"

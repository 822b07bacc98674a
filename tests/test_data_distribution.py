"""Data distribution: DP replicas get disjoint packs that together are the epoch, CP peers
get identical packs, and (real gloo group) CP ranks that receive different or malformed
packs all raise a clear error instead of hanging."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from hf_blockdiag_cp.data import DocumentPiece, PackedBatchSampler, dp_cp_coordinates, packed_dataloader
from hf_blockdiag_cp.data.packing import PackingStats


def random_lengths(n: int, max_len: int, seed: int) -> list[int]:
    return torch.randint(1, max_len + 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pack_key(pack) -> tuple:
    return tuple((i.index, i.start) if isinstance(i, DocumentPiece) else (i, 0) for i in pack)


def test_dp_cp_coordinates_cp_fastest():
    table = [dp_cp_coordinates(8, r, 2) for r in range(8)]
    assert table == [(4, r // 2, r % 2) for r in range(8)]
    assert dp_cp_coordinates(6, 5, 3) == (2, 1, 2)
    assert dp_cp_coordinates(4, 3, 1) == (4, 3, 0)
    with pytest.raises(ValueError, match="world_size=6 must be divisible by cp_size=4"):
        dp_cp_coordinates(6, 0, 4)
    with pytest.raises(ValueError, match=r"rank must be an integer in \[0, world_size=4\)"):
        dp_cp_coordinates(4, 4, 2)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        dp_cp_coordinates(4, 0, 0)


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
def test_replicas_get_disjoint_packs_that_cover_the_epoch(dp_size, drop_last):
    lengths = random_lengths(203, 90, seed=dp_size) + [150, 64]  # one split example, one exactly full
    args = dict(buffer_size=50, seed=7, dp_size=dp_size, drop_last=drop_last)
    samplers = [PackedBatchSampler(lengths, 64, dp_rank=r, **args) for r in range(dp_size)]
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
    assert total.pack_tokens == 64 * total.packs
    if dp_size == 1:
        assert total.real_tokens == sum(lengths)


def test_cp_peers_identical_and_epochs_reshuffle_yet_cover_everything():
    lengths = random_lengths(150, 40, seed=0)
    peers = [PackedBatchSampler(lengths, 48, seed=3, dp_size=2, dp_rank=1, buffer_size=64) for _ in range(2)]
    assert list(peers[0]) == list(peers[1])
    epoch0 = list(peers[0])
    for s in peers:
        s.set_epoch(1)
    epoch1 = list(peers[0])
    assert epoch1 == list(peers[1]) and epoch1 != epoch0
    peers[0].set_epoch(0)
    assert list(peers[0]) == epoch0, "an epoch's packs are reproducible"
    solo = PackedBatchSampler(lengths, 48, seed=3, buffer_size=64)
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


# --------------------------------------------------------------------------- real gloo group


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


def test_explicit_strategy_must_match_a_presharded_batch():
    """A batch sharded by the collator keeps its layout; asking for another one is an error (I7)."""
    import hf_blockdiag_cp as bdcp

    full = bdcp.BlockdiagCPCollator(max_tokens=16)([{"input_ids": list(range(1, 10))}, {"input_ids": [3, 4, 5]}])
    local = bdcp.shard_batch(full, 1, 0, strategy="balanced")
    _, _, layout = bdcp.make_cp_blockdiag_batch_and_ctx(None, None, local)
    assert layout.strategy == "balanced"
    with pytest.raises(ValueError, match="already sharded with strategy='balanced'"):
        bdcp.make_cp_blockdiag_batch_and_ctx(None, None, local, strategy="contiguous")

"""I5 under failure: one rank raises inside the attention kernel, after the layer's K/V exchange
(with overlap: while it is in flight); every rank of the CP group must end with an error, none may
hang, for every registered exchange.

What ends the peers is what ends them in production: a rank whose step raised exits, and a
dead process closes its gloo sockets, so peers waiting for it in any later collective raise
at once ("Connection closed by peer"; under NCCL, torchrun stops the other workers and the
watchdog's process-group timeout bounds the rest). The pool's workers must survive the test,
so each case runs on a throw-away subgroup and a rank "exits" by releasing that subgroup
(destroy it, drop every reference): its sockets close exactly as at process exit. The
subgroup's timeout is longer than the test's, so the test fails if anything relies on it.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref
from datetime import timedelta

import pytest
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp import kernels
from hf_blockdiag_cp.planning import choose_exchange, exchange_names, get_exchange, plan_exchange, plan_layout
from hf_blockdiag_cp.step import document_ids_of
from helpers.exchanges import heads_refusal
from helpers.packs import make_pack
from helpers.reference import build_models

CASE_TIMEOUT = 120.0  # seconds the pool waits for every rank (then it fails the test)


class InjectedFault(RuntimeError):
    pass


def fault_case(rank, world_size, group, exchange, layout, failing_rank, overrides, overlap=False):
    sub = dist.new_group(backend="gloo", timeout=timedelta(seconds=10 * CASE_TIMEOUT))
    original = kernels.get_kernel("dense")

    def faulty_kernel(q, k, v, step, **kwargs):
        if rank == failing_rank:
            raise InjectedFault(f"injected failure in the kernel on rank {rank}, after (overlap: during) the exchange")
        return original.fn(q, k, v, step, **kwargs)

    config = bdcp.CPConfig("dense", exchange, overlap=overlap)
    kernels.register_kernel(dataclasses.replace(original, fn=faulty_kernel))
    error, refused_again, ran = None, None, None
    try:
        for _ in range(2):  # a rank that depends on nobody who failed meets the others at the next step
            _, model = build_models("llama", **overrides)
            _, batch = make_pack(layout, world_size)
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(sub, None, batch, config=config)
            ran = local["blockdiag_cp_step"].kv_exchange
            with train_ctx():
                model(**local).loss.backward()
            del model, batch, train_ctx, local
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test checks
        error = f"{type(exc).__name__}: {exc}\n" + "\n".join(getattr(exc, "__notes__", []))
        if rank != failing_rank:
            try:  # a group whose collective failed is refused at once, without a collective
                bdcp.make_cp_blockdiag_batch_and_ctx(sub, None, make_pack(layout, world_size)[1], config=config)
            except RuntimeError as again:
                refused_again = str(again)
    finally:
        kernels.register_kernel(original)
        # This rank "exits": release the subgroup so its sockets close, as at process exit.
        model = batch = train_ctx = local = None
        dist.destroy_process_group(sub)
        alive = weakref.ref(sub)
        del sub
        gc.collect()
        # A gloo group's sockets close only when its last reference goes; a reference that outlives
        # the case (a cycle through C++ that gc cannot see) leaves peers waiting on this rank.
        released = alive() is None
    if error is None:
        return f"rank {rank} finished its steps ({ran}) although rank {failing_rank} failed"
    raise RuntimeError(f"[exchange {ran}] [subgroup released: {released}] {error}\n[second attempt] {refused_again}")


WORLD_SIZE = 3


def fault_cases():
    """(exchange, layout, failing rank, model overrides) per registered exchange: a document over
    every rank, or, for an exchange that cannot serve that (halo), short documents across shard
    boundaries, where only rank 1 talks to rank 2, so the failure reaches rank 0 through rank 1. A
    head-parallel exchange, which cannot split the tiny model's 4 query heads over 3 ranks, runs it
    with 6 query / 3 kv heads. An exchange that can overlap attention runs again with overlap, split by
    queries and by keys: the failing rank then raises while its exchange is still in flight."""
    cases = []
    for name in exchange_names():
        overrides = {} if heads_refusal(name, WORLD_SIZE) is None else {"num_attention_heads": 6, "num_key_value_heads": 3}
        for layout, failing_rank in (("span_all", 1), ("straddle", 2)):
            _, batch = make_pack(layout, WORLD_SIZE)
            ids = document_ids_of(batch, batch["input_ids"].shape[1])
            if choose_exchange(name, plan_exchange(plan_layout(ids, WORLD_SIZE))) == name:
                cases.append((name, layout, failing_rank, overrides, False))
                if get_exchange(name).begin is not None:
                    cases += [(name, layout, failing_rank, overrides, split) for split in ("queries", "keys")]
                break
    return cases


@pytest.mark.parametrize("exchange, layout, failing_rank, overrides, overlap", fault_cases())
def test_failure_after_exchange_ends_every_rank(gloo, exchange, layout, failing_rank, overrides, overlap):
    world_size = WORLD_SIZE
    pool = gloo(world_size)
    results, errors = pool.run_collecting(
        fault_case, timeout=CASE_TIMEOUT, exchange=exchange, layout=layout, failing_rank=failing_rank, overrides=overrides,
        overlap=overlap,
    )
    assert not results, f"ranks {sorted(results)} did not raise: {results}"
    assert sorted(errors) == list(range(world_size))
    assert f"[exchange {exchange}]" in errors[failing_rank]
    assert "InjectedFault: injected failure in the kernel" in errors[failing_rank]
    # Every rank must let its group go: the failing rank's closed sockets are what end the peers, and
    # a peer's graph that outlives the step (under halo, rank 0's, held from C++ by a checkpoint frame)
    # must not keep its group (exchange flights hold it weakly).
    for rank in range(world_size):
        assert "[subgroup released: True]" in errors[rank], f"rank {rank} kept its subgroup alive:\n{errors[rank]}"
    for rank, tb in errors.items():
        if rank == failing_rank:
            continue
        assert "Connection" in tb and "by peer" in tb, f"rank {rank} did not fail in a collective:\n{tb}"
        assert "a peer rank of the CP group has probably raised or exited" in tb, f"rank {rank}:\n{tb}"
        assert "failed in an earlier step" in tb, f"rank {rank} could reuse a failed group:\n{tb}"
    # the pool's own group is untouched
    assert pool.run(_world_still_works) == [world_size] * world_size


def _world_still_works(rank, world_size, group):
    import torch

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return int(t.item())

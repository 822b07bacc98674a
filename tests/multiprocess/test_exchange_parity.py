"""Exactness (I1, I2; docs/design.md) with every registered exchange and `auto`: the same loss
and gradients as the stock model on each document separately, at world sizes 2-4, with and
without activation checkpointing (the parity case of helpers/parity.py), including a document
over three or more ranks (halo hands over to a2a) and a rank that holds only padding; the bytes
each step moves equal its record's plan; ranks that would run different exchanges raise. A
head-parallel exchange is skipped where the tiny models' query heads do not split over G (it
raises then; tests/multiprocess/test_heads_exchange.py covers that and G = 3 with 6 heads)."""

from __future__ import annotations

import pytest

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import choose_exchange, exchange_names, plan_exchange, plan_layout
from hf_blockdiag_cp.step import document_ids_of
from helpers.exchanges import heads_refusal
from helpers.packs import make_pack
from helpers.parity import TOL, exchange_step_case, parity_case

# (layout, world size) -> the exchange that `halo` and `auto` must run. span_all puts one
# document on every rank: at G = 2 it spans two ranks (halo), from G = 3 on three or more (a2a).
EXPECTED_HALO_AND_AUTO = {
    ("span_all", 2): "halo",
    ("span_all", 3): "a2a",
    ("span_all", 4): "a2a",
    ("padding_rank", 2): "halo",
    ("padding_rank", 3): "halo",
    ("padding_rank", 4): "halo",
    ("straddle", 3): "halo",
}


def expected_exchange(layout: str, world_size: int, exchange: str) -> str:
    """What a step runs for a configured name: the table above for halo and auto, else the name's record's choice."""
    if exchange in ("halo", "auto"):
        return EXPECTED_HALO_AND_AUTO[(layout, world_size)]
    _, batch = make_pack(layout, world_size)
    ids = document_ids_of(batch, batch["input_ids"].shape[1])
    return choose_exchange(exchange, plan_exchange(plan_layout(ids, world_size)))


def _check(results):
    for rank, worst in enumerate(results):
        for variant, (err, name, loss_err) in worst.items():
            assert err <= TOL, f"rank {rank} {variant}: {name} relative error {err:.2e} > {TOL}"
            assert loss_err <= TOL, f"rank {rank} {variant}: loss relative error {loss_err:.2e}"


@pytest.mark.parametrize("exchange", ["auto", *exchange_names()])
@pytest.mark.parametrize("layout", ["span_all", "padding_rank"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchange_parity(gloo, world_size, layout, exchange):
    reason = None if exchange == "auto" else heads_refusal(exchange, world_size)
    if reason is not None:
        pytest.skip(f"kv_exchange={exchange!r} cannot run the tiny models at G={world_size}: {reason}")
    pool = gloo(world_size)
    chosen = pool.run(exchange_step_case, layout=layout, exchange=exchange)
    want = expected_exchange(layout, world_size, exchange)
    for rank, (name, measured, planned) in enumerate(chosen):
        assert name == want, f"rank {rank}: kv_exchange={exchange!r} ran {name!r}, expected {want!r}"
        assert measured == planned, f"rank {rank}: exchanged bytes (fwd, bwd) {measured} != plan {planned}"
    _check(pool.run(parity_case, layout=layout, exchange=exchange))


def test_halo_straddle_three_ranks(gloo):
    """Short documents straddling rank boundaries at G = 3: a real left halo (not only padding)."""
    pool = gloo(3)
    chosen = pool.run(exchange_step_case, layout="straddle", exchange="halo")
    assert {c[0] for c in chosen} == {"halo"}
    assert any(c[1][0] > 0 for c in chosen), "the halo moved no rows; the layout no longer tests a halo"
    _check(pool.run(parity_case, layout="straddle", exchange="halo"))


@pytest.mark.parametrize("exchange", exchange_names())
def test_gqa_exchange_parity(gloo, exchange):
    """Grouped K/V heads travel un-repeated: 4 kv heads, 8 query heads (GQA 2), at G = 3 with a
    document over every rank."""
    reason = heads_refusal(exchange, 3, (8, 4))
    if reason is not None:
        pytest.skip(f"kv_exchange={exchange!r} cannot split 8 query heads over G=3: {reason}")
    families = (("llama", {"num_key_value_heads": 4, "num_attention_heads": 8}),)
    _check(gloo(3).run(parity_case, layout="span_all", families=families, exchange=exchange))


def disagreeing_config_case(rank, world_size, group):
    """Rank 0 asks for a2a, the others for allgather: every rank must raise before any exchange."""
    config = bdcp.CPConfig(attn_backend="dense", kv_exchange="a2a" if rank == 0 else "allgather")
    try:
        _, batch = make_pack("span_all", world_size)
        bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    except RuntimeError as exc:
        return str(exc)
    return None


def test_ranks_that_disagree_on_the_exchange_raise(gloo):
    messages = gloo(3).run(disagreeing_config_case)
    assert all(m is not None and "different kv_exchange" in m for m in messages), messages


def cross_node_case(rank, world_size, group, local_world_size, allow):
    """What `auto` picks when LOCAL_WORLD_SIZE says the group spans nodes (one rank per node when 1)."""
    import os

    previous = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    config = bdcp.CPConfig(attn_backend="dense", kv_exchange="auto", allow_cross_node_a2a=allow)
    try:
        _, batch = make_pack("span_all", world_size)
        _, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
        return local["blockdiag_cp_step"].kv_exchange
    finally:
        if previous is None:
            os.environ.pop("LOCAL_WORLD_SIZE")
        else:
            os.environ["LOCAL_WORLD_SIZE"] = previous


@pytest.mark.parametrize("local_world_size, allow, want", [(2, False, "halo"), (1, False, "allgather"), (1, True, "halo")])
def test_auto_keeps_allgather_across_nodes_unless_allowed(gloo, local_world_size, allow, want):
    assert gloo(2).run(cross_node_case, local_world_size=local_world_size, allow=allow) == [want, want]

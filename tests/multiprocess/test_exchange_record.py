"""An exchange is a record: a toy exchange defined here (gather every rank's rows with the
all-gather's transport, then keep the rows this rank needs) is registered, runs a CP step as
exactly as the shipped ones (fp32 loss and gradients against the stock model on each document
separately, dense kernel, real gloo groups of 2 and 3 ranks, with and without activation
checkpointing) and moves the bytes its record says, then is unregistered. Nothing in the
library names it."""

from __future__ import annotations

import pytest

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import ExchangePlan, ExchangeRecord, RankExchange, exchange_names, get_exchange, needed_rank_plan
from hf_blockdiag_cp.planning.segments import expand
from helpers.exchanges import registered_exchange
from helpers.parity import TOL, exchange_step_case, parity_case


def plan_gather_then_index(layout, plan: ExchangePlan, rank: int) -> RankExchange:
    """The needed keys (in pack order), read out of the all-gather's slot-ordered rows."""
    needed = expand(plan.needed[rank])
    return RankExchange(needed_rank_plan(layout, plan, rank), needed, routes=layout.slot_of_position[needed])


def gather_then_index(k, v, group, world_size, routes, meter):
    """All-gather every rank's rows (autograd: reduce-scatter back), then index the needed ones."""
    all_k, all_v = get_exchange("allgather").transport(k, v, group, world_size, None, meter)
    return all_k.index_select(0, routes), all_v.index_select(0, routes)


TOY = ExchangeRecord(
    name="gather_then_index",
    aliases=("gather-index",),
    plan=plan_gather_then_index,
    rows_per_layer=lambda plan, rank: ((plan.cp_size - 1) * plan.local_len,) * 2,
    transport=gather_then_index,
)


@pytest.fixture
def toy_registered():
    with registered_exchange(TOY):
        yield TOY
    assert TOY.name not in exchange_names()


def toy_case(rank, world_size, group, layout):
    """On every rank: register the toy, run the parity case and one metered step with it."""
    with registered_exchange(TOY):
        worst = parity_case(rank, world_size, group, layout, families=(("llama", {}),), exchange="gather-index")
        ran = exchange_step_case(rank, world_size, group, layout, exchange="Gather_Index")
    return worst, ran, TOY.name in exchange_names()


def test_the_registry_takes_a_toy_and_gives_it_back(toy_registered):
    assert bdcp.CPConfig(kv_exchange="GATHER-INDEX").kv_exchange == "gather_then_index"
    assert exchange_names() == ("allgather", "halo", "a2a", "heads", "gather_then_index")


def test_config_refuses_the_toy_when_it_is_not_registered():
    with pytest.raises(ValueError, match="kv_exchange='gather-index' is not supported; accepted values: auto, allgather, halo, a2a, heads "):
        bdcp.CPConfig(kv_exchange="gather-index")


@pytest.mark.parametrize("world_size, layout", [(2, "straddle"), (3, "span_all")])
def test_a_toy_exchange_is_exact(gloo, world_size, layout):
    results = gloo(world_size).run(toy_case, layout=layout)
    for rank, (worst, (name, metered, planned), still_registered) in enumerate(results):
        assert name == "gather_then_index", (rank, name)
        assert metered == planned, f"rank {rank}: metered (fwd, bwd) {metered} != record {planned}"
        assert not still_registered, f"rank {rank} kept the toy registered"
        for variant, (err, what, loss_err) in worst.items():
            assert err <= TOL, f"rank {rank} {variant}: {what} relative error {err:.2e} > {TOL}"
            assert loss_err <= TOL, f"rank {rank} {variant}: loss relative error {loss_err:.2e}"

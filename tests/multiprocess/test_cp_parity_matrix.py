"""Exactness (I1, I2; docs/design.md) over the whole matrix on real gloo groups at G = 2, 3 and 4:
for every exchange x layout (a head-parallel one where G divides the 4 query heads; the K/V
exchanges also overlapped, split by queries and by keys), on packs with documents across shard boundaries, a rank holding
only padding and one document over every rank, the dense kernel's loss and every parameter
gradient under CP (activation checkpointing on) equal the stock model run on each document
separately, fp32, <= 1e-4. tests/gpu/test_nccl_parity.py runs the same matrix on NCCL."""

from __future__ import annotations

import pytest

from helpers.cp_parity import LAYOUTS, PACKS, matrix_modes, parity_matrix_case

TOL = 1e-4


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_exchange_and_layout_matches_the_stock_model(gloo, world_size):
    per_rank = gloo(world_size).run(parity_matrix_case, timeout=600, kernels=("dense",))
    rows = per_rank[0]
    assert all(r == rows for r in per_rank), "ranks disagree on the mean-over-ranks errors"
    assert [(r["pack"], r["exchange"], r["overlap"], r["layout"]) for r in rows] == [
        (p, x, o, lay) for p in PACKS for x, o in matrix_modes(world_size) for lay in LAYOUTS]
    for r in rows:
        assert r["loss_err"] <= TOL and r["grad_err_max_param"] <= TOL, r
    # Overlap rows ran queries during the exchange (the straddle pack has documents inside every shard); no other row did.
    assert all(r["overlapped_queries"] > 0 for r in rows if r["overlap"] and r["pack"] == "straddle")
    assert all(r["overlapped_queries"] == 0 for r in rows if not r["overlap"])
    # The packs test what they are named for.
    assert any(r["padding_ranks"] >= 1 for r in rows if r["pack"] == "padding_rank" and r["layout"] == "contiguous")
    assert all(r["permuted"] for r in rows if r["layout"] == "balanced" and r["pack"] == "span_all")
    span_halo = {r["exchange_taken"] for r in rows
                 if r["pack"] == "span_all" and r["exchange"] == "halo" and r["layout"] == "contiguous"}
    assert span_halo == {"halo" if world_size == 2 else "a2a"}  # a document over three or more ranks hands over to a2a

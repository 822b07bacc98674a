"""Exactness (I1, I2; docs/design.md): loss and every gradient under CP equal the stock model on
each document separately, at world sizes 1-4, with real gloo groups."""

from __future__ import annotations

import pytest

import hf_blockdiag_cp as bdcp
from helpers.packs import LAYOUTS, make_pack
from helpers.parity import TOL, parity_case
from helpers.reference import build_models


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_dense_parity(gloo, world_size, layout):
    results = gloo(world_size).run(parity_case, layout=layout)
    for rank, worst in enumerate(results):
        for variant, (err, name, loss_err) in worst.items():
            assert err <= TOL, f"rank {rank} {variant}: {name} relative error {err:.2e} > {TOL}"
            assert loss_err <= TOL, f"rank {rank} {variant}: loss relative error {loss_err:.2e}"


def forward_case(rank, world_size, group, layout, backend):
    """Forward only: every real local row's logits and the mean-over-ranks loss vs the reference."""
    import torch

    from helpers.reference import mean_over_group, rel_err

    ref, model = build_models("llama")
    docs, batch = make_pack(layout, world_size)
    config = bdcp.CPConfig(attn_backend=backend, kv_exchange="allgather")
    with torch.no_grad():
        ref_logits = torch.cat([ref(input_ids=d[None]).logits[0] for d in docs])
        train_ctx, local, lay = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
        with train_ctx():
            out = model(**local)
    rows = lay.token_indices[rank]
    real = rows >= 0
    # document tokens in pack order are exactly the concatenated documents (no padding inside these packs)
    logit_err = rel_err(out.logits[0][real], ref_logits[rows[real]])
    loss = mean_over_group(out.loss, group, world_size)
    return logit_err, float(loss)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_flex_forward_parity_cpu(gloo, world_size):
    """FlexAttention has no CPU backward; its forward must match the reference on CPU."""
    dense = gloo(world_size).run(forward_case, layout="span_all", backend="dense")
    flex = gloo(world_size).run(forward_case, layout="span_all", backend="flex")
    for (err_d, loss_d), (err_f, loss_f) in zip(dense, flex):
        assert err_d <= TOL and err_f <= TOL, (err_d, err_f)
        assert abs(loss_f - loss_d) <= TOL * abs(loss_d)

"""The dense parity case shared by the parity tests (exactness, invariants I1 and I2 in
docs/design.md): loss and every gradient under CP against the stock model run on each
document separately, fp32, with and without activation checkpointing."""

from __future__ import annotations

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.planning import PAIR_COUNT  # permuted layouts even for packs shorter than a tile
from helpers.packs import make_pack
from helpers.reference import build_models, compare_with_reference, reference_loss_and_grads

TOL = 1e-4
FAMILIES = (("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5}))


def parity_case(
    rank, world_size, group, layout, families=FAMILIES, backend="dense", exchange="allgather", strategy="contiguous",
    kv_chunks=bdcp.CPConfig.kv_chunks,
):
    """For every family and with/without activation checkpointing: the worst relative error."""
    config = bdcp.CPConfig(attn_backend=backend, kv_exchange=exchange, kernel_cost=PAIR_COUNT, kv_chunks=kv_chunks)
    worst = {}
    for family, overrides in families:
        for checkpointing in (False, True):
            ref, model = build_models(family, **overrides)
            docs, batch = make_pack(layout, world_size)
            ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, strategy=strategy, config=config)
            with train_ctx():
                loss = model(**local).loss
                loss.backward()
            errors = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
            name = max(errors, key=errors.get)
            worst[f"{family}{'+ac' if checkpointing else ''}"] = (errors[name], name, errors["loss"])
    return worst

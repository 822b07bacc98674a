"""The dense parity case shared by the parity tests (exactness, invariants I1 and I2 in
docs/design.md): loss and every gradient under CP against the stock model run on each
document separately, fp32, with and without activation checkpointing; and the metered step of
the exchange tests (the bytes a step moved against its exchange record)."""

from __future__ import annotations

import copy

import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.planning import PAIR_COUNT  # permuted layouts even for packs shorter than a tile
from hf_blockdiag_cp.planning import AttentionShape, get_exchange, plan_exchange
from helpers.packs import make_pack
from helpers.reference import build_models, compare_with_reference, reference_loss_and_grads

TOL = 1e-4
FAMILIES = (("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 5}))


_REFERENCES = {}  # (family, overrides, layout, world size) -> reference loss and gradients, per process


def _reference(family, overrides, layout, docs, group, world_size):
    """The stock model per document on the named pack, built by the ranks together once per process:
    the exchange, layout and overlap variants of one pack share it (every rank of a pool runs the same
    cases in the same order, so all of them find it or all build it)."""
    key = (family, tuple(sorted(overrides.items())), layout, world_size)
    if key not in _REFERENCES:
        ref, _ = build_models(family, **overrides)
        _REFERENCES[key] = reference_loss_and_grads(ref, docs, group=group)
    return _REFERENCES[key]


def parity_case(
    rank, world_size, group, layout, families=FAMILIES, backend="dense", exchange="allgather", layout_strategy="contiguous"
):
    """For every family and with/without activation checkpointing: the worst relative error."""
    config = bdcp.CPConfig(attn_backend=backend, kv_exchange=exchange, layout=layout_strategy, kernel_cost=PAIR_COUNT)
    worst = {}
    docs, batch = make_pack(layout, world_size)
    for family, overrides in families:
        ref_loss, ref_grads = _reference(family, overrides, layout, docs, group, world_size)
        _, fresh = build_models(family, **overrides)
        for checkpointing in (False, True):
            model = copy.deepcopy(fresh)
            if checkpointing:
                enable_activation_checkpointing(model, use_reentrant=False)
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
            with train_ctx():
                loss = model(**local).loss
                loss.backward()
            errors = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
            name = max(errors, key=errors.get)
            worst[f"{family}{'+ac' if checkpointing else ''}"] = (errors[name], name, errors["loss"])
    return worst


def exchange_step_case(rank, world_size, group, layout, exchange, overlap=False):
    """The exchange the step runs, and the bytes it moved in one llama fwd+bwd with
    checkpointing, against its record's plan (forward twice: once more in recompute)."""
    _, model = build_models("llama")
    enable_activation_checkpointing(model, use_reentrant=False)
    _, batch = make_pack(layout, world_size)
    config = bdcp.CPConfig(attn_backend="dense", kv_exchange=exchange, overlap=overlap)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    step = local["blockdiag_cp_step"]
    with train_ctx():
        model(**local).loss.backward()
    cfg = model.config
    shape = AttentionShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim, torch.float32.itemsize)
    layers = cfg.num_hidden_layers
    plan = get_exchange(step.kv_exchange).layer_bytes(plan_exchange(step.layout), rank, shape)
    meter = step.exchange_bytes
    return step.kv_exchange, (meter.forward_bytes, meter.backward_bytes), (2 * layers * plan.forward, layers * plan.backward)

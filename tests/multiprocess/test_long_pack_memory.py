"""The long-pack memory helpers (integrations/memory.py) leave training exact: with activation
checkpointing, a sequence-tiled MLP and host offload of checkpointed layer inputs, alone and
together and under `compile_model` with the exchange overlapped, give the loss and every gradient of
the stock eager model run on each document separately, at cp = 1, 2 and 3 (documents over every rank,
tiles smaller than a shard). Compiled without overlap and without these helpers:
tests/multiprocess/test_compile.py."""

from __future__ import annotations

import inspect

import pytest
import torch

import hf_blockdiag_cp as bdcp
from helpers.reference import build_models, compare_with_reference, make_pack, reference_loss_and_grads
from helpers.trainer import tiny_model
from hf_blockdiag_cp.compat.transformers import checkpoint_function, enable_activation_checkpointing
from hf_blockdiag_cp.integrations.memory import CheckpointOffload, enable_checkpoint_offload, enable_tiled_mlp

TOL = 1e-5
VARIANTS = {"tiled": (True, False), "offload": (False, True), "both": (True, True), "both+compile+overlap": (True, True)}


def memory_case(rank, world_size, group, variant):
    tiled, offload = VARIANTS[variant]
    ref, model = build_models("llama")
    docs, batch = make_pack("span_all", world_size)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs, group=group)
    enable_activation_checkpointing(model, use_reentrant=False)
    if "+compile" in variant:  # compiled first: the offload goes inside compile_model's checkpoint wrapper
        bdcp.compile_model(model, "layers", backend="aot_eager")
    counts = (enable_tiled_mlp(model, tile_tokens=3) if tiled else 0, enable_checkpoint_offload(model) if offload else 0)
    config = bdcp.CPConfig(attn_backend="dense", overlap=variant.endswith("+overlap"))
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    assert local["input_ids"].shape[1] > 3, "a tile must be smaller than the shard"
    with train_ctx():
        loss = model(**local).loss
        loss.backward()
    return counts, compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)


@pytest.mark.parametrize("variant,world_size", [("tiled", 2), ("offload", 2), ("both", 1), ("both", 3),
                                                ("both+compile+overlap", 3)])
def test_memory_helpers_stay_exact(gloo, world_size, variant):
    layers = tiny_model().config.num_hidden_layers
    for rank, (counts, errors) in enumerate(gloo(world_size).run(memory_case, variant=variant)):
        tiled, offload = VARIANTS[variant]
        assert counts == (layers if tiled else 0, layers if offload else 0)
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"rank {rank} {variant} G={world_size}: {worst} relative error {errors[worst]:.2e}"


def test_offload_needs_non_reentrant_checkpointing():
    model = tiny_model()
    with pytest.raises(ValueError, match="no layer checkpoints"):
        enable_checkpoint_offload(model)
    enable_activation_checkpointing(model, use_reentrant=True)
    with pytest.raises(ValueError, match="use_reentrant=False"):
        enable_checkpoint_offload(model)
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.23
    if enable is not None and "offload" in inspect.signature(enable).parameters:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, offload=True)
        with pytest.raises(ValueError, match=r"activation_checkpointing_enable\(offload=True\)"):
            enable_checkpoint_offload(model)


def test_tiled_mlp_refuses_bad_tiles_and_non_tensor_outputs():
    model = tiny_model()
    with pytest.raises(ValueError, match="tile_tokens=0 must be a positive int"):
        enable_tiled_mlp(model, tile_tokens=0)
    mlp = model.model.layers[0].mlp
    mlp.forward = lambda x: (x, None)  # what a mixture-of-experts block with router outputs returns
    enable_tiled_mlp(model, tile_tokens=2)
    with pytest.raises(TypeError, match="expected a tensor of its input's shape"):
        model(input_ids=torch.randint(1, 50, (1, 5)), labels=torch.randint(1, 50, (1, 5))).loss.backward()


def test_helpers_are_idempotent():
    """Enabling twice wraps once: the tiled MLP calls the stock forward, one offload object per model."""
    model = tiny_model()
    enable_activation_checkpointing(model, use_reentrant=False)
    stock = model.model.layers[0].mlp.forward
    enable_tiled_mlp(model, 4)
    enable_tiled_mlp(model, 4)
    assert model.model.layers[0].mlp.forward.args[1] == stock
    enable_checkpoint_offload(model)
    first = [checkpoint_function(layer) for layer in model.model.layers]
    enable_checkpoint_offload(model)
    assert [checkpoint_function(layer) for layer in model.model.layers] == first
    assert len({id(f) for f in first}) == 1 and isinstance(first[0], CheckpointOffload)


def second_backward_case(rank, world_size, group):
    """Two backwards through one offloaded graph (retain_graph=True, then the last): each adds the
    reference gradient once more, and the last one frees the host copies."""
    import gc
    import weakref

    ref, model = build_models("llama")
    docs, batch = make_pack("span_all", world_size)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs, group=group)
    enable_activation_checkpointing(model, use_reentrant=False)
    enable_checkpoint_offload(model)
    offload = checkpoint_function(model.model.layers[0])
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=bdcp.CPConfig(attn_backend="dense"))
    with train_ctx():
        loss = model(**local).loss
        loss.backward(retain_graph=True)
        first = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
        entries = [weakref.ref(e()) for e in offload.entries if e() is not None]
        loss.backward()
    for p in model.parameters():
        p.grad /= 2  # two backwards: twice the gradient
    second = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
    gc.collect()
    return first, second, len(entries), sum(e() is not None for e in entries)


def test_offload_survives_a_second_backward(gloo):
    layers = tiny_model().config.num_hidden_layers
    for rank, (first, second, offloaded, alive) in enumerate(gloo(2).run(second_backward_case)):
        for name, errors in (("first backward", first), ("both backwards / 2", second)):
            worst = max(errors, key=errors.get)
            assert errors[worst] <= TOL, f"rank {rank} {name}: {worst} relative error {errors[worst]:.2e}"
        assert offloaded == layers, f"rank {rank}: {offloaded} offloaded inputs, expected one per layer ({layers})"
        assert alive == 0, f"rank {rank}: {alive} host copies outlive the graph's last backward"

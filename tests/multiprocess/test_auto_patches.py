"""Model patches apply themselves wherever the library sees the model (docs/models.md, "Model
patches"): a Phi-3 LongRoPE model that nobody patched, given to the shard step as `model=` or
wrapped by accelerate's `wrap_model`, trains exactly like the stock model on the same pack, and
the patch is logged once; a model type the library refuses raises its NotImplementedError on
every rank at the first step, before any attention call (a pure RWKV model has none)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, RwkvConfig

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.comm import DPCPCoordinates, build_dp_cp_mesh
from hf_blockdiag_cp.integrations.accelerate import wrap_model
from helpers.logs import library_logs
from helpers.model_packs import family_pack, packed_stock_reference
from helpers.model_zoo import tiny_config
from helpers.reference import compare_with_reference

TOL = 1e-4
APPLIED = "applied the model patch"


def _unpatched_phi3():
    """(stock eager reference, the same weights with attn_implementation="blockdiag_cp"), no patch applied."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config("phi3"), attn_implementation="eager", dtype=torch.float32)
    ref.train()
    model = copy.deepcopy(ref)
    model.set_attn_implementation(bdcp.ATTN_IMPLEMENTATION)
    return ref, model


def unpatched_phi3_case(rank, world_size, group, entry):
    """Two steps of an unpatched Phi-3 LongRoPE model seen through `entry` ("step": `model=`;
    "wrap_model": DDP from `wrap_model`): worst relative error against the stock packed run, and
    the log lines that say a patch was applied."""
    ref, model = _unpatched_phi3()
    # A mixed pack at G = 3: rank 0 holds only short positions, so its own max(position_ids) would pick
    # LongRoPE's short factors while the pack (and the stock run) uses the long ones.
    docs, batch, _, _ = family_pack("phi3", world_size, mixed_longrope=True)
    ref_loss, ref_grads = packed_stock_reference(ref, docs)
    with library_logs(logging.INFO) as messages:
        if entry == "wrap_model":
            mesh = build_dp_cp_mesh(DPCPCoordinates(world_size, rank, world_size), "cpu")
            runner, named = wrap_model(model, mesh), None
        else:
            runner, named = model, model
        errors = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, model=named)
            with train_ctx():
                loss = runner(**local).loss
                loss.backward()
            # Under DDP the gradients are already the mean over the ranks; the mean of equal values is that mean.
            errors.append(compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size))
    return errors, [m for m in messages if APPLIED in m], sorted(model._blockdiag_cp_patches)


@pytest.mark.parametrize("entry", ["step", "wrap_model"])
def test_unpatched_model_is_patched_where_the_library_sees_it(gloo, entry):
    for rank, (errors, logged, patches) in enumerate(gloo(3).run(unpatched_phi3_case, entry=entry)):
        for step, step_errors in enumerate(errors):
            worst = max(step_errors, key=step_errors.get)
            assert step_errors[worst] <= TOL, f"{entry} rank {rank} step {step}: {worst} relative error {step_errors[worst]:.2e}"
        assert patches == ["global_rope"], patches
        assert len(logged) == 1 and "'global_rope'" in logged[0] and "Phi3ForCausalLM" in logged[0], logged


def _rwkv():
    config = RwkvConfig(vocab_size=101, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32,
                        intermediate_size=64, context_length=64, pad_token_id=0)
    return AutoModelForCausalLM.from_config(config)


def refused_model_case(rank, world_size, group, entry):
    """The error a pure RWKV model (no attention call) gets from `entry`, or None if it trained."""
    model = _rwkv()
    ids = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone(), "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])}
    try:
        if entry == "wrap_model":
            model = wrap_model(model, build_dp_cp_mesh(DPCPCoordinates(world_size, rank, world_size), "cpu"))
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, model=model)
        with train_ctx():
            model(**local).loss.backward()
    except Exception as exc:  # noqa: BLE001 - the test checks which error each rank got
        return f"{type(exc).__name__}: {exc}"
    return None


@pytest.mark.parametrize("entry", ["step", "wrap_model"])
def test_refused_model_type_raises_at_the_first_step(gloo, entry):
    for rank, message in enumerate(gloo(2).run(refused_model_case, entry=entry)):
        assert message is not None and message.startswith("NotImplementedError: blockdiag_cp: model_type 'rwkv' is "
                                                          "not supported"), f"rank {rank}: {message!r}"

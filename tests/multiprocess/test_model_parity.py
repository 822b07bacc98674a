"""Model coverage (docs/models.md): every family trains exactly under blockdiag_cp.

Gloo parity (I1, I2; docs/design.md): loss and every gradient under CP, with and without
activation checkpointing, equal the stock model with `eager` on each document separately, at
world sizes chosen so that each family runs at two sizes (one >= 3) and every size 1-4 is
covered; with guards on the test data itself (windows smaller than a shard, a mixed LongRoPE
pack whose reference differs from the per-document one); the attention features also with
`CPConfig(overlap=True)`. The single-process tests of the
attention features are in unit/test_model_features.py, the CUDA flex ones in
gpu/test_flex_features_cuda.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.planning import plan_layout
from helpers.model_packs import family_pack, packed_stock_reference
from helpers.model_zoo import WINDOW, build_pair, reference_loss_and_grads
from helpers.reference import compare_with_reference, rel_err

TOL = 1e-4

# family -> world sizes (each family at two sizes, one >= 3; every size 1-4 covered).
WORLD_SIZES = {
    "mistral": (2, 4),
    "qwen2": (1, 3),
    "qwen3": (3, 4),
    "gemma2": (2, 3),
    "gpt_oss": (1, 4),
    "deepseek_v3": (2, 3),
    "granite": (1, 4),
    "olmo2": (2, 3),
    "phi3": (2, 4),
    "qwen2_vl": (1, 3),  # text stack, 3-D positions given
    "qwen2_vl_image": (2, 4),  # with images: vision tower unsharded on every rank
}
CASES = [(family, g) for family, sizes in WORLD_SIZES.items() for g in sizes]


def model_parity_case(rank, world_size, group, family, mixed_longrope=False, overlap=False):
    """Worst relative error per variant (plain, activation checkpointing) for one family."""
    config = bdcp.CPConfig(attn_backend="auto", kv_exchange="allgather", overlap=overlap)
    ref, model = build_pair(family)
    docs, batch, extra, shard_primary = family_pack(family, world_size, mixed_longrope, ref)
    if mixed_longrope:
        ref_loss, ref_grads = packed_stock_reference(ref, docs)
    else:
        ref_loss, ref_grads = reference_loss_and_grads(ref, docs, extra, group=group)
    results = {}
    for checkpointing in (False, True):
        m = copy.deepcopy(model)
        if checkpointing:
            enable_activation_checkpointing(m, use_reentrant=False)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(
            group, None, batch, shard_primary=shard_primary, config=config
        )
        with train_ctx() as step:
            loss = m(**local).loss
            loss.backward()
        errors = compare_with_reference(m, ref_loss, ref_grads, loss, group, world_size)
        worst = max(errors, key=errors.get)
        results["ac" if checkpointing else "plain"] = {
            "worst": (errors[worst], worst),
            "loss": errors["loss"],
            "sinks": {n: e for n, e in errors.items() if n.endswith("sinks")},
            "attention_calls": step.attention_calls,
            "overlapped_queries": step.overlapped_queries,
        }
    results["sink_grad_norms"] = [float(g.norm()) for n, g in ref_grads.items() if n.endswith("sinks")]
    return results


def _assert_parity(results, family):
    for rank, res in enumerate(results):
        for variant in ("plain", "ac"):
            err, name = res[variant]["worst"]
            assert res[variant]["attention_calls"] > 0
            assert res[variant]["loss"] <= TOL, f"{family} rank {rank} {variant}: loss relative error {res[variant]['loss']:.2e}"
            assert err <= TOL, f"{family} rank {rank} {variant}: {name} relative error {err:.2e} > {TOL}"


@pytest.mark.parametrize("family,world_size", CASES, ids=[f"{f}-G{g}" for f, g in CASES])
def test_model_parity(gloo, family, world_size):
    results = gloo(world_size).run(model_parity_case, family=family)
    _assert_parity(results, family)
    if family == "gpt_oss":  # the sinks are trained: their gradient is non-zero and exact
        assert all(n > 1e-4 for n in results[0]["sink_grad_norms"]) and len(results[0]["sink_grad_norms"]) == 2
        for variant in ("plain", "ac"):
            assert len(results[0][variant]["sinks"]) == 2
            assert max(results[0][variant]["sinks"].values()) <= TOL


# The attention features under CPConfig(overlap=...): softcap and windows (gemma2), sinks and
# windows (gpt_oss), Dk != Dv with K/V pre-expanded (deepseek_v3). Split by queries each query
# attends in one part; split by keys the softcap applies in both parts, the sinks join the local
# part once, and the windowed layers attend in order.
OVERLAP_CASES = [("gemma2", 2), ("gpt_oss", 3), ("deepseek_v3", 2)]


@pytest.mark.parametrize("split", ["queries", "keys"])
@pytest.mark.parametrize("family,world_size", OVERLAP_CASES, ids=[f"{f}-G{g}" for f, g in OVERLAP_CASES])
def test_model_parity_with_overlap(gloo, family, world_size, split):
    results = gloo(world_size).run(model_parity_case, family=family, overlap=split)
    _assert_parity(results, f"{family} (overlap by {split})")
    assert sum(res["ac"]["overlapped_queries"] for res in results) > 0


def test_phi3_longrope_mixed_pack_matches_stock_packed_run(gloo):
    """Documents on both sides of the original context: the pack's longest document picks the
    long factors for the whole pack (stock packed semantics); CP at G = 3 must agree."""
    results = gloo(3).run(model_parity_case, family="phi3", mixed_longrope=True)
    _assert_parity(results, "phi3 (mixed pack)")


def rotary_under_no_grad_case(rank, world_size, group):
    """phi3's parity with the rotary forward declared as transformers < 5.18 declares it:
    torch.no_grad() around dynamic_rope_update around the body."""
    from unittest import mock

    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    with mock.patch.object(Phi3RotaryEmbedding, "forward", torch.no_grad()(Phi3RotaryEmbedding.forward)):
        return model_parity_case(rank, world_size, group, family="phi3")


def test_phi3_longrope_with_the_rotary_forward_under_no_grad(gloo):
    """At G = 4 rank 0 holds positions 0..7 only; its frequency update must stay the pack's. With
    transformers 5.17's torch.no_grad() wrapper the patch once ran the update again on the shard's
    own positions (loss 6.5e-4 off on rank 0)."""
    _assert_parity(gloo(4).run(rotary_under_no_grad_case), "phi3 (rotary under no_grad)")


def test_phi3_mixed_pack_reference_differs_per_document():
    """The mixed-pack reference is not the per-document one (so the test above can tell them apart)."""
    ref, _ = build_pair("phi3")
    docs, _, _, _ = family_pack("phi3", 3, mixed_longrope=True)
    _, packed_grads = packed_stock_reference(ref, docs)
    _, per_doc_grads = reference_loss_and_grads(ref, docs)
    assert max(rel_err(packed_grads[n], per_doc_grads[n]) for n in packed_grads) > 100 * TOL


def test_window_is_smaller_than_every_shard():
    """Guard on the test data itself: the parity cases exercise windows smaller than a shard."""
    for family, sizes in WORLD_SIZES.items():
        for g in sizes:
            _, batch, _, _ = family_pack(family, g, model=build_pair(family)[0] if "image" in family else None)
            local = plan_layout(batch["document_ids"][0] if "document_ids" in batch else torch.ones(batch["input_ids"].shape[1]), g).local_len
            assert WINDOW < local


def qwen2_vl_sharded_primary_case(rank, world_size, group):
    _, model = build_pair("qwen2_vl")
    _, batch, _, _ = family_pack("qwen2_vl", world_size)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, shard_primary=True)
    with train_ctx():
        model(**local).loss.backward()


def test_qwen2_vl_needs_the_full_pack(gloo):
    """Qwen2-VL sharded like a text model (shard_primary=True) is refused on every rank, by name."""
    results, errors = gloo(2).run_collecting(qwen2_vl_sharded_primary_case)
    assert not results and sorted(errors) == [0, 1]
    for tb in errors.values():
        assert "ValueError" in tb and "shard_primary=False" in tb, tb[-800:]

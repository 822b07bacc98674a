"""The hybrids whose mixers cross ranks only by state passing train exactly under CP (I1, I2, I5):
LFM2 and LFM2-MoE (short gated convolutions: the halo of kernel - 1 rows before each piece), the
Mamba2 (SSD) ones (NemotronH, GraniteMoeHybrid, Bamba, FalconH1, Zamba2, Mamba2), the Mamba1
(selective-scan) ones (Jamba, FalconMamba, Mamba: the run states, and the convolution's halo) and
MiniMax (lightning attention: the run states, no convolution).

Gloo parity: loss and every gradient at G = 1-4, against the stock model with `eager` attention
run on each document separately. The pack holds 1-token documents and a document over three ranks
(two at G = 2) that crosses many 16-row chunks of the Mamba2 scan; contiguous and balanced layouts,
with and without activation checkpointing; plus a pack whose last rank holds only padding. Every
rank ends with a gradient on every parameter the reference trains (DDP and FSDP expect it). Also:
asking for `heads` raises on every rank (no hang).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.planning import PAIR_COUNT
from helpers.model_zoo import CONV_FAMILIES, LIGHTNING_FAMILIES, MAMBA1_FAMILIES, MAMBA2_FAMILIES, build_hybrid_pair
from helpers.packs import long_pack, make_pack
from helpers.reference import compare_with_reference, reference_loss_and_grads

TOL = 1e-4
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather", kernel_cost=PAIR_COUNT)
VARIANTS = (("long", "contiguous", False), ("long", "balanced", True), ("padding_rank", "contiguous", True))


def _run(model, batch, group, strategy, checkpointing, config=CONFIG):
    model = copy.deepcopy(model)
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=dataclasses.replace(config, layout=strategy))
    with train_ctx() as step:
        loss = model(**local).loss
        loss.backward()
    return model, loss, step.choices.mixers


def parity_case(rank, world_size, group, family):
    """Worst relative error of every variant, and what the token mixers ran."""
    ref, model = build_hybrid_pair(family)
    results, references = {}, {}
    for pack, strategy, checkpointing in VARIANTS[: 2 if world_size == 1 else None]:  # one rank holds more than padding
        docs, batch = long_pack(world_size) if pack == "long" else make_pack(pack, world_size)
        if pack not in references:  # the variants of one pack share its reference, which the ranks build together
            references[pack] = reference_loss_and_grads(ref, docs, group=group)
        ref_loss, ref_grads = references[pack]
        trained, loss, mixers = _run(model, batch, group, strategy, checkpointing)
        errors = compare_with_reference(trained, ref_loss, ref_grads, loss, group, world_size)
        # (Zamba2's adapters of other layers have no gradient in the stock model either)
        errors["parameters without a gradient"] = float(sum(p.grad is None for n, p in trained.named_parameters() if n in ref_grads))
        worst = max(errors, key=errors.get)
        results[f"{pack}/{strategy}{'+ac' if checkpointing else ''}"] = (errors[worst], worst, errors["loss"], mixers)
    return results


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("family", CONV_FAMILIES + MAMBA2_FAMILIES + MAMBA1_FAMILIES + LIGHTNING_FAMILIES)
def test_matches_per_document_reference(gloo, family, world_size):
    transport = "local" if world_size == 1 else "states"
    for rank, results in enumerate(gloo(world_size).run(parity_case, family=family)):
        for variant, (err, name, loss_err, mixers) in results.items():
            assert mixers.endswith(f"transport={transport}"), f"{variant}: {mixers}"
            assert loss_err <= TOL, f"{family} G={world_size} rank {rank} {variant}: loss relative error {loss_err:.2e}"
            assert err <= TOL, f"{family} G={world_size} rank {rank} {variant}: {name} relative error {err:.2e}"


def heads_refused_case(rank, world_size, group, family):
    _, model = build_hybrid_pair(family)
    _, batch = long_pack(world_size)
    try:
        _run(model, batch, group, "contiguous", False, dataclasses.replace(CONFIG, mixer_transport="heads"))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("family, layer, why", [("lfm2", "Lfm2ShortConv", "state passing"),
                                                ("nemotron_h", "NemotronHMamba2Mixer", "no head-parallel transport"),
                                                ("minimax", "MiniMaxLightningAttention", "no head-parallel transport")])
def test_heads_transport_is_refused_on_every_rank(gloo, family, layer, why):
    for rank, message in enumerate(gloo(2).run(heads_refused_case, family=family)):
        assert message is not None, f"rank {rank} did not raise"
        for part in (layer, why, "'states'"):
            assert part in message, f"rank {rank}: {part!r} missing from {message!r}"

"""Gated delta-rule and KDA hybrids (Qwen3.5, Qwen3-Next, Qwen3.5-MoE, OLMo-Hybrid; Kimi Linear,
Bailing-Hybrid) train exactly under CP (I1, I2, I5).

Gloo parity: loss and every gradient at G = 1-4, against the stock model with `eager` attention
run on each document separately. The linear layers have 2 key heads, so G = 3 and 4 run by state
passing alone; G = 2 runs both transports (head-parallel and state passing). The pack holds 1-token
documents and a document over three ranks (two at G = 2) that crosses several 64-token chunks of
the delta rule; contiguous and balanced layouts, with and without activation checkpointing; plus
a pack whose last rank holds only padding. Also: `heads` asked for where the heads do not split
raises on every rank (no hang), and a few optimizer steps at cp = 2 give the losses of cp = 1.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.comm.head_shards import heads_to_seq, seq_to_heads
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.mixers import MixerContext
from hf_blockdiag_cp.planning import PAIR_COUNT, document_ids_from_lengths
from hf_blockdiag_cp.planning.mixer_plan import MixerShape, choose_mixer_transport, mixer_cost_for
from hf_blockdiag_cp.step import STEP_KWARG
from helpers.model_zoo import HYBRID_FAMILIES, KDA_FAMILIES, build_hybrid_pair
from helpers.packs import long_pack, make_pack
from helpers.reference import fp32_references, mean_over_group, within_rounding

TOL = 1e-4  # relative: the loss against the float64 reference, and cp = 2 against cp = 1 in training
CONFIG = bdcp.CPConfig(attn_backend="dense", kv_exchange="allgather", kernel_cost=PAIR_COUNT)


def heads_transport_case(rank, world_size, group):
    """comm.head_shards against the same tensors indexed on one process: rank r holds rows
    [r·L, (r+1)·L) of X [G·L, G, C]; seq_to_heads must return X[perm, r], its gradient
    (through every rank's loss) W[inverse perm] for this rank's rows, and heads_to_seq undo it."""
    rows, channels = 5, 3
    g = torch.Generator().manual_seed(11)
    full = torch.randn(world_size * rows, world_size, channels, generator=g)
    weight = torch.randn(channels, world_size, world_size * rows, generator=g).permute(2, 1, 0)  # non-contiguous
    perm = torch.randperm(world_size * rows, generator=g)
    inverse = torch.argsort(perm)
    x = full[rank * rows : (rank + 1) * rows].clone().requires_grad_(True)
    out = seq_to_heads(x, group, world_size, to_pack=perm)
    (out * weight[:, rank]).sum().backward()
    back = heads_to_seq(out.detach(), group, world_size, to_slots=inverse)
    mine = slice(rank * rows, (rank + 1) * rows)
    return (
        torch.equal(out.detach(), full[perm, rank]),
        torch.equal(x.grad, weight[inverse][mine]),
        torch.equal(back, full[mine]),
    )


@pytest.mark.parametrize("world_size", [2, 3])
def test_heads_transport_matches_indexing(gloo, world_size):
    for rank, checks in enumerate(gloo(world_size).run(heads_transport_case)):
        assert checks == (True, True, True), f"rank {rank}: (values, gradient, round trip) = {checks}"


def _run(model, batch, group, strategy, checkpointing, transport="auto"):
    model = copy.deepcopy(model)
    if checkpointing:
        enable_activation_checkpointing(model, use_reentrant=False)
    config = dataclasses.replace(CONFIG, layout=strategy, mixer_transport=transport)
    train_ctx, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    with train_ctx():
        loss = model(**local).loss
        loss.backward()
    moved = not torch.equal(layout.slot_positions.reshape(-1), torch.arange(layout.padded_seq_len))
    return model, loss, moved


def _variants(world_size: int):
    """(pack, layout, activation checkpointing, mixer transport) of one parity case."""
    transports = ["states", "heads"] if world_size == 2 else ["states"]
    out = [("long", "contiguous", False, t) for t in transports] + [("long", "balanced", True, t) for t in transports]
    return out + [("padding_rank", "contiguous", True, "auto")] * (world_size > 1)  # one rank holds more than padding


def hybrid_parity_case(rank, world_size, group, family):
    """Per variant: `within_rounding`'s loss error and worst parameter and this rank's parameters left
    without a gradient; and whether the balanced layout permuted the pack. The ranks build the
    references together, each running a share of the documents (`fp32_references`)."""
    ref, model = build_hybrid_pair(family)
    results, permuted, references = {}, False, {}
    for pack, strategy, checkpointing, transport in _variants(world_size):
        docs, batch = long_pack(world_size) if pack == "long" else make_pack(pack, world_size)
        if pack not in references:  # the variants of one pack share its references
            references[pack] = fp32_references(ref, docs, group=group)
        trained, loss, moved = _run(model, batch, group, strategy, checkpointing, transport)
        permuted |= moved and strategy == "balanced"
        errors = within_rounding(trained, loss, references[pack], group, world_size)
        # DDP and FSDP expect a gradient of every parameter on every rank, a padding-only rank's too
        errors["without gradient"] = [n for n, p in trained.named_parameters() if p.grad is None]
        results[f"{pack}/{strategy}{'+ac' if checkpointing else ''}/{transport}"] = errors
    return results, permuted


def auto_transport_case(rank, world_size, group):
    """What a step's `auto` takes for the 1.13B bench layer's shape on one 64k document, and what the
    planner gives at gloo's and NCCL's byte rates."""
    shape = MixerShape(8, 128, 16, 128, 4096, 4)
    ids = torch.zeros(1, 65536, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids, "document_ids": document_ids_from_lengths([65536])[None]}
    _, local, layout = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch)
    step = MixerContext.from_step(local[STEP_KWARG]).transport_for(shape)
    return step, choose_mixer_transport("auto", layout, shape, mixer_cost_for("gloo")), choose_mixer_transport("auto", layout, shape)


def test_auto_weighs_bytes_at_the_groups_backend_rate(gloo):
    """On a gloo group the step's `auto` prices the all-to-alls at gloo's rate: state passing for one
    long document, where NCCL's rate would go head-parallel (docs/models.md, "CP transports")."""
    for rank, (step, at_gloo, at_nccl) in enumerate(gloo(2).run(auto_transport_case)):
        assert (step, at_gloo, at_nccl) == ("states", "states", "heads"), f"rank {rank}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("family", HYBRID_FAMILIES + KDA_FAMILIES)
def test_hybrid_matches_per_document_reference(gloo, family, world_size):
    """Loss within TOL and every gradient within fp32 rounding of the stock model (docs/testing.md, "The
    reference"), both against the stock model run per document in float64."""
    outputs = gloo(world_size).run(hybrid_parity_case, family=family)
    for rank, (results, permuted) in enumerate(outputs):
        for variant, errors in results.items():
            where = f"{family} G={world_size} rank {rank} {variant}"
            assert not errors["without gradient"], f"{where}: no gradient for {errors['without gradient']}"
            assert errors["loss"] <= TOL, f"{where}: loss relative error {errors['loss']:.2e}"
            name, ours, stock, bound = errors["worst"]
            assert ours <= bound, (
                f"{where}: {name} relative error {ours:.2e} against float64, above {bound:.2e} "
                f"(the stock fp32 model's error {stock:.2e})")
        if world_size > 1:  # the balanced layout really reordered the pack (else it tested nothing new)
            assert permuted, f"G={world_size}: the balanced layout left the pack contiguous"


def indivisible_heads_case(rank, world_size, group):
    """2 key heads do not split over G = 3: asking for `heads` must raise on every rank, none may hang."""
    _, model = build_hybrid_pair("qwen3_5")
    _, batch = long_pack(world_size)
    try:
        _run(model, batch, group, "contiguous", False, transport="heads")
    except ValueError as exc:
        return str(exc)
    return None


def test_heads_asked_where_they_do_not_split_raise_on_every_rank(gloo):
    for rank, message in enumerate(gloo(3).run(indivisible_heads_case)):
        assert message is not None, f"rank {rank} did not raise"
        for part in ("Qwen3_5GatedDeltaNet", "key heads (2)", "G=3", "'states'"):
            assert part in message, f"rank {rank}: {part!r} missing from {message!r}"


def _train(model, batch, group, world_size, steps: int):
    """`steps` SGD steps on one pack; gradients averaged over the CP group as DDP would. Logged
    loss per step: the mean over the group (I2)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=CONFIG)
        with train_ctx():
            loss = model(**local).loss
            loss.backward()
        for p in model.parameters():
            if p.grad is not None and world_size > 1:
                dist.all_reduce(p.grad, group=group)
                p.grad /= world_size
        losses.append(float(mean_over_group(loss, group, world_size)))
        optimizer.step()
    return losses


def training_case(rank, world_size, group):
    """Losses of 4 optimizer steps at cp = world_size and, on this rank alone, at cp = 1. The
    model has the usual small initialisation: with the parity tests' large one, training is
    chaotic (a 1e-6 weight perturbation grows to 3e-4 in the loss within 3 steps at cp = 1)."""
    _, model = build_hybrid_pair("qwen3_5", initializer_range=0.02)
    _, batch = long_pack(world_size)
    cp1 = _train(copy.deepcopy(model), batch, None, 1, 4)
    cp = _train(model, batch, group, world_size, 4)
    return cp1, cp


def test_cp2_training_matches_cp1(gloo):
    for rank, (cp1, cp2) in enumerate(gloo(2).run(training_case)):
        assert cp1[-1] < cp1[0], f"the loss did not move: {cp1}"
        for step, (a, b) in enumerate(zip(cp1, cp2)):
            assert abs(a - b) <= TOL * abs(a), f"rank {rank} step {step}: cp=1 loss {a:.6f}, cp=2 loss {b:.6f}"

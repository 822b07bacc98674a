"""The head-parallel exchange (`kv_exchange="heads"`, docs/kernels.md) on real gloo groups.

- Attention alone, every rank's rows against the fp64 per-document reference over the whole pack
  (outputs and the gradients of q, k, v and the sinks): GQA with as many, more and fewer kv heads
  than ranks (kv heads < G, MQA, and a G that does not divide the kv heads), MHA, sliding window,
  softcap, sinks, Dv != Dk, contiguous, balanced and head-tail layouts, G = 2, 3, 4; and the bytes
  the step's meter counts against the record's `layer_bytes`.
- Whole models (I1, I2, docs/design.md): loss and every gradient against the stock model run on
  each document separately, fp32, with and without activation checkpointing, at G = 2 and 4,
  contiguous and balanced layouts, GQA (4 query / 2 kv heads: kv heads < G at G = 4), MHA and a
  sliding window, on a pack with a document over every rank and one with a padding-only rank.
- A layer whose query heads G does not divide raises a clear error on every rank, before any
  collective of the layer (nothing hangs, I5).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.attention import AttentionFeatures, blockdiag_attention
from hf_blockdiag_cp.planning import AttentionShape, get_exchange, plan_exchange, plan_layout
from hf_blockdiag_cp.step import build_step, document_ids_of
from helpers.kernel_inputs import naive_attention
from helpers.layouts import make_layout, pack_ids
from helpers.packs import make_pack
from helpers.parity import TOL, parity_case
from helpers.reference import build_models, rel_err

# Documents across every shard boundary, padding between documents and at the end.
RUNS = [(False, 5), (False, 19), (True, 2), (False, 3), (False, 11), (True, 1), (False, 7)]

# (query heads, kv heads) per world size: GQA with G dividing the kv heads, kv heads < G (repeated),
# MQA, a G that does not divide the kv heads (12 / 6 at G = 4: each kv head sent twice), and MHA.
HEADS_BY_WORLD_SIZE = {
    2: [(4, 2), (8, 1), (4, 4)],
    3: [(6, 3), (3, 1), (6, 2)],
    4: [(4, 2), (8, 1), (12, 6), (4, 4)],
}
# (sliding window, softcap, sinks) per (heads, kv heads) case, taken in turn.
FEATURES = [(None, None, False), (4, None, True), (None, 0.7, True)]
DK, DV = 8, 6


def attention_case(rank, world_size, group):
    """Every head configuration of this world size x layout kind: the worst relative errors of this
    rank's outputs and q/k/v gradients, of the summed sinks gradient, and (metered, planned) bytes."""
    report = []
    ids = pack_ids(RUNS)
    for i, (heads, kv_heads) in enumerate(HEADS_BY_WORLD_SIZE[world_size]):
        window, softcap, use_sinks = FEATURES[i % len(FEATURES)]
        for kind in ("contiguous", "balanced", "headtail"):
            layout = make_layout(ids, world_size, kind)
            g = torch.Generator().manual_seed(100 * heads + kv_heads)
            s_pad = layout.padded_seq_len
            full = [torch.randn(s_pad, h, d, generator=g, dtype=torch.float64) for h, d in ((heads, DK), (kv_heads, DK), (kv_heads, DV))]
            sinks = torch.randn(heads, generator=g, dtype=torch.float64) if use_sinks else None
            cot = torch.randn(s_pad, heads, DV, generator=g, dtype=torch.float64) * (layout.document_ids > 0)[:, None, None]
            leaves = [t.clone().requires_grad_() for t in full] + ([sinks.clone().requires_grad_()] if use_sinks else [])
            want = naive_attention(*leaves[:3], layout.document_ids, scale=0.4, window=window, softcap=softcap,
                                   sinks=leaves[3] if use_sinks else None)
            want_grads = torch.autograd.grad((want * cot).sum(), leaves)

            mine = layout.slot_positions[rank]
            local = [t[mine].clone().requires_grad_() for t in full]
            local_sinks = sinks.clone().requires_grad_() if use_sinks else None
            step = build_step(layout, rank, group, torch.device("cpu"), "dense", "heads")
            q, k, v = (t[None].transpose(1, 2) for t in local)  # Transformers' [1, H, L, D] views
            out = blockdiag_attention(step, q, k, v, scale=0.4, sliding_window=window,
                                      features=AttentionFeatures(softcap, local_sinks))[0]
            (out * cot[mine]).sum().backward()
            real = layout.document_ids[mine] > 0  # the reference joins padding runs into one document
            errors = [rel_err(out.detach()[real], want.detach()[mine][real])]
            errors += [rel_err(t.grad, w[mine]) for t, w in zip(local, want_grads)]
            if use_sinks:
                summed = local_sinks.grad.clone()
                dist.all_reduce(summed, group=group)
                errors.append(rel_err(summed, want_grads[3]))
            shape = AttentionShape(heads, kv_heads, DK, DV, torch.float64.itemsize)
            planned = get_exchange("heads").layer_bytes(plan_exchange(layout), rank, shape)
            metered = step.exchange_bytes
            report.append(((heads, kv_heads, kind), max(errors), (metered.forward_bytes, metered.backward_bytes),
                           (planned.forward, planned.backward), metered.calls))
    return report


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_head_parallel_attention_matches_fp64(gloo, world_size):
    results = gloo(world_size).run(attention_case)
    for rank, report in enumerate(results):
        assert len(report) == 3 * len(HEADS_BY_WORLD_SIZE[world_size])
        for case, err, metered, planned, calls in report:
            assert err <= 1e-10, f"rank {rank} {case}: relative error {err:.2e}"
            assert metered == planned, f"rank {rank} {case}: metered (fwd, bwd) bytes {metered} != record {planned}"
            assert calls == 1 and metered[0] > 0, (rank, case, calls, metered)


# --------------------------------------------------------------------------- whole models

FAMILIES = (("llama", {}), ("qwen2", {"num_key_value_heads": 4}), ("mistral", {"sliding_window": 5}))  # GQA, MHA, window


@pytest.mark.parametrize("layout_strategy", ["contiguous", "balanced"])
@pytest.mark.parametrize("pack", ["span_all", "padding_rank"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_heads_exchange_matches_the_stock_model(gloo, world_size, pack, layout_strategy):
    _, batch = make_pack(pack, world_size)
    layout = plan_layout(document_ids_of(batch, batch["input_ids"].shape[1]), world_size)
    if pack == "padding_rank":  # the pack tests what it is named for (contiguous: a rank of padding only)
        assert 0 in layout.real_tokens_per_rank(), layout.real_tokens_per_rank()
    results = gloo(world_size).run(parity_case, layout=pack, families=FAMILIES, exchange="heads", layout_strategy=layout_strategy)
    for rank, worst in enumerate(results):
        assert set(worst) == {f"{f}{ac}" for f, _ in FAMILIES for ac in ("", "+ac")}
        for variant, (err, name, loss_err) in worst.items():
            assert err <= TOL, f"rank {rank} {variant}: {name} relative error {err:.2e} > {TOL}"
            assert loss_err <= TOL, f"rank {rank} {variant}: loss relative error {loss_err:.2e}"


# --------------------------------------------------------------------------- heads G does not divide


def indivisible_heads_case(rank, world_size, group):
    """A tiny Llama (4 query / 2 kv heads) at G = 3 under `heads`: the error, and what the step's
    exchange meter saw before it (nothing: no all-to-all of the layer ran)."""
    _, model = build_models("llama")
    _, batch = make_pack("span_all", world_size)
    config = bdcp.CPConfig(attn_backend="dense", kv_exchange="heads")
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
    meter = local["blockdiag_cp_step"].exchange_bytes
    try:
        with train_ctx():
            model(**local).loss.backward()
    except ValueError as exc:
        return str(exc), meter.calls, meter.forward_bytes
    return None, meter.calls, meter.forward_bytes


def test_heads_not_divisible_by_g_raise_on_every_rank(gloo):
    results, errors = gloo(3).run_collecting(indivisible_heads_case, timeout=120.0)
    assert not errors, errors
    for rank in range(3):
        message, calls, moved = results[rank]
        assert message is not None, f"rank {rank} did not raise"
        for part in ("LlamaAttention (layer 0)", "4 query heads and 2 kv heads", "kv_exchange='heads'", "G=3"):
            assert part in message, (rank, message)
        assert (calls, moved) == (0, 0), f"rank {rank} ran a collective of the layer before raising"

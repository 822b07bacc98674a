"""`CPConfig(overlap=True)` on real gloo groups (docs/kernels.md, "Overlap"). The parity matrix
(test_cp_parity_matrix.py) and the feature families (test_model_parity.py) check its exactness;
here, what the overlap itself promises:

- the order, split by queries and by keys: the local part attends between the start and the end of
  the exchange (all-gather, all-to-all-v), and in backward the reverse collective starts before the
  local part's backward and is waited for after it;
- the bytes: the step's meter counts the plan's bytes, as without overlap;
- a rank whose every query reads the gathered rows, one whose queries read none, and frozen K/V
  projections (no reduce-scatter at all): every rank finishes, gradients exact;
- FlexAttention, which attends over every row the exchange returns: forward equal to the plain order.
"""

from __future__ import annotations

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from hf_blockdiag_cp.attention import dispatch as entry
from hf_blockdiag_cp.comm.pending import PendingExchange
from helpers.packs import make_pack
from helpers.parity import exchange_step_case
from helpers.reference import build_models, compare_with_reference, reference_loss_and_grads

TOL = 1e-4


def _events_case(rank, world_size, group, exchange, split):
    """This rank's sequence of collective starts / waits and attention parts, forward and backward,
    for one llama step with activation checkpointing on the straddle pack."""
    events = []
    launch, collect, attend = PendingExchange.launch, PendingExchange.collect, entry.local_attention

    def traced_launch(self, what, *args, **kwargs):
        events.append(f"start {what}")
        return launch(self, what, *args, **kwargs)

    def traced_collect(self):
        events.append(f"wait {self.in_flight}")
        return collect(self)

    def traced_attend(step, q, k, v, **kwargs):
        part = "local" if kwargs.get("part") is step.overlap.local else "remote"
        events.append(f"forward {part}")
        # A view made here: its hook fires once the kernel's backward gave q's gradient (a hook on q
        # itself would wait for q's producer, recorded before the exchange started).
        q = q.view_as(q)
        q.register_hook(lambda grad: events.append(f"backward {part}"))
        return attend(step, q, k, v, **kwargs)

    PendingExchange.launch, PendingExchange.collect = traced_launch, traced_collect
    entry.local_attention = traced_attend
    try:
        _, model = build_models("llama")
        enable_activation_checkpointing(model, use_reentrant=False)
        _, batch = make_pack("straddle", world_size)
        config = bdcp.CPConfig(attn_backend="dense", kv_exchange=exchange, overlap=split)
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
        with train_ctx() as step:
            model(**local).loss.backward()
        return events, step.overlap.local is not None, step.overlap.remote is not None
    finally:
        PendingExchange.launch, PendingExchange.collect = launch, collect
        entry.local_attention = attend


@pytest.mark.parametrize("split", ["queries", "keys"])
@pytest.mark.parametrize("exchange,names", [("allgather", ("all-gather", "reduce-scatter")),
                                            ("a2a", ("a2a exchange", "a2a exchange backward"))])
def test_local_attention_runs_while_the_collectives_are_in_flight(gloo, exchange, names, split):
    layers = build_models("llama")[1].config.num_hidden_layers
    results = gloo(2).run(_events_case, exchange=exchange, split=split)
    assert [parts for _, *parts in results] == [[True, False], [True, True]]  # rank 0 needs no foreign key
    fwd, bwd = names
    for rank, (events, has_local, has_remote) in enumerate(results):
        local, remote = ["local"] * has_local, ["remote"] * has_remote
        forward = [f"start {fwd}", *(f"forward {p}" for p in local), f"wait {fwd}", *(f"forward {p}" for p in remote)]
        backward = [*(f"backward {p}" for p in remote), f"start {bwd}", *(f"backward {p}" for p in local), f"wait {bwd}"]
        # Forward of every layer, then per layer (last first): recompute, then its backward.
        assert events == forward * layers + (forward + backward) * layers, f"rank {rank}: {events}"


@pytest.mark.parametrize("exchange", ["allgather", "halo", "a2a"])
@pytest.mark.parametrize("layout", ["straddle", "span_all"])
def test_overlap_moves_the_planned_bytes(gloo, layout, exchange):
    # halo hands a document over three ranks (span_all at G = 3) to a2a, which moves the same rows.
    taken = "a2a" if (exchange, layout) == ("halo", "span_all") else exchange
    for rank, (ran, metered, planned) in enumerate(gloo(3).run(exchange_step_case, layout=layout, exchange=exchange, overlap=True)):
        assert ran == taken and metered == planned, f"rank {rank} {ran}: metered {metered}, planned {planned}"


def _frozen_kv_case(rank, world_size, group, pack):
    """Loss and gradient errors against the per-document reference with K/V projections frozen
    (the all-gather's rows need no gradient: no reduce-scatter on any rank), and the parts per rank."""
    ref, model = build_models("llama")
    for m in (ref, model):
        for name, p in m.named_parameters():
            if "k_proj" in name or "v_proj" in name:
                p.requires_grad_(False)
    docs, batch = make_pack(pack, world_size)
    ref_loss, ref_grads = reference_loss_and_grads(ref, docs)
    enable_activation_checkpointing(model, use_reentrant=False)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=bdcp.CPConfig(overlap=True))
    with train_ctx() as step:
        loss = model(**local).loss
        loss.backward()
    errors = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
    return max(errors.values()), step.overlap.local is not None, step.overlap.remote is not None


@pytest.mark.parametrize("pack", ["span_all", "padding_rank"])
def test_frozen_kv_and_one_sided_ranks_finish_exactly(gloo, pack):
    results = gloo(3).run(_frozen_kv_case, pack=pack, timeout=120)
    for rank, (err, _, _) in enumerate(results):
        assert err <= TOL, f"rank {rank}: relative error {err:.2e}"
    parts = [(has_local, has_remote) for _, has_local, has_remote in results]
    if pack == "span_all":  # the middle rank holds only the long document's middle: every query is remote
        assert parts[1] == (False, True), parts
    else:  # the last rank holds only padding, which needs nothing from other ranks
        assert parts[-1] == (True, False), parts


def _flex_forward_case(rank, world_size, group):
    """Logits of one forward with flex, overlapped and in order, and with the dense kernel."""
    _, model = build_models("llama")
    _, batch = make_pack("straddle", world_size)
    logits = {}
    for name, config in (("dense", bdcp.CPConfig(attn_backend="dense")),
                         ("flex", bdcp.CPConfig(attn_backend="flex")),
                         ("flex+overlap", bdcp.CPConfig(attn_backend="flex", overlap=True))):
        train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch, config=config)
        with torch.no_grad(), train_ctx():
            logits[name] = model(**local).logits
    return logits


def test_flex_attends_over_each_parts_rows(gloo):
    for rank, logits in enumerate(gloo(2).run(_flex_forward_case, timeout=300)):
        assert torch.allclose(logits["flex+overlap"], logits["flex"], atol=1e-5, rtol=1e-5), rank
        assert torch.allclose(logits["flex+overlap"], logits["dense"], atol=1e-5, rtol=1e-5), rank


def test_overlap_needs_an_exchange_that_can_overlap_and_by_keys_a_kernel_with_its_lse():
    for split in (True, "keys"):
        with pytest.raises(ValueError, match="needs a kv_exchange that can overlap.*got kv_exchange='heads'"):
            bdcp.CPConfig(kv_exchange="heads", overlap=split)
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="overlap must be False, True, 'queries' or 'keys'"):
            bdcp.CPConfig(overlap=bad)
    with pytest.raises(ValueError, match="overlap='keys' merges .* attn_backend='flex' does not return .*use overlap='queries'"):
        bdcp.CPConfig(attn_backend="flex", overlap="keys")
    assert bdcp.CPConfig(overlap=True).overlap == "queries" and bdcp.CPConfig(attn_backend="dense", overlap="keys").overlap == "keys"
    assert bdcp.CPConfig(kv_exchange="auto", overlap=True).overlap  # auto: overlapped when it picks allgather

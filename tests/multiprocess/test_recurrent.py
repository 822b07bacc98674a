"""Worked example: a model-owned recurrent layer made exact under CP with `current_blockdiag_cp_state()`.

Recurrent / linear-attention layers do not go through the attention interface, so
`blockdiag_cp` cannot fix them; the model has to. `current_blockdiag_cp_state()` gives what
such a layer needs during a CP step: the CP group and the global packed document boundaries
(`packed_cu_seqlens`, on the device, and `packed_cu_seqlens_cpu`). `ToyRecurrence` below uses
them to (1) reset its state at every global document start, wherever it falls in the shard,
and (2) carry the state across shard boundaries: each rank receives the previous rank's
final state (`dist.recv`) before its scan and sends its own (`dist.send`) after it; the
backward runs the same chain in reverse, rank G-1 first. Every rank issues the same
point-to-point operations whatever the documents (I5); a document start simply multiplies
the carried state by zero.

The layout is the contiguous one (rank r holds pack rows [r·L, (r+1)·L)). The test checks
loss and every gradient against the same model run on each document separately, unsharded.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.step import STEP_KWARG
from helpers.packs import make_pack
from helpers.reference import compare_with_reference, make_docs

TOL = 1e-4


# --------------------------------------------------------------------------- carrying state across ranks


class _ReceiveCarry(torch.autograd.Function):
    """Forward: the previous rank's final state (zeros on rank 0). Backward: its gradient goes back there."""

    @staticmethod
    def forward(ctx, anchor, group, rank, world_size, shape):
        ctx.group, ctx.rank = group, rank
        carry = anchor.new_zeros(shape)
        if rank > 0:
            dist.recv(carry, src=dist.get_global_rank(group, rank - 1), group=group)
        return carry

    @staticmethod
    def backward(ctx, grad_carry):
        if ctx.rank > 0:
            dist.send(grad_carry.contiguous(), dst=dist.get_global_rank(ctx.group, ctx.rank - 1), group=ctx.group)
        return None, None, None, None, None


class _SendCarry(torch.autograd.Function):
    """Forward: send this rank's final state to the next rank, pass `outputs` through. Backward:
    receive that state's gradient from the next rank (zeros on the last rank)."""

    @staticmethod
    def forward(ctx, outputs, final_state, group, rank, world_size):
        ctx.group, ctx.rank, ctx.world_size = group, rank, world_size
        if rank < world_size - 1:
            dist.send(final_state.detach().contiguous(), dst=dist.get_global_rank(group, rank + 1), group=group)
        return outputs.view_as(outputs)

    @staticmethod
    def backward(ctx, grad_outputs, *_):
        grad_final = grad_outputs.new_zeros(grad_outputs.shape[-1:])
        if ctx.rank < ctx.world_size - 1:
            dist.recv(grad_final, src=dist.get_global_rank(ctx.group, ctx.rank + 1), group=ctx.group)
        return grad_outputs, grad_final, None, None, None


class ToyRecurrence(nn.Module):
    """h_t = a ⊙ h_{t-1} + W x_t, with h reset to 0 at every document start; output h_t."""

    def __init__(self, dim: int):
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.decay_logit = nn.Parameter(torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [1, L, D]
        u = self.inp(x)[0]
        decay = torch.sigmoid(self.decay_logit)
        length = u.shape[0]
        state = bdcp.current_blockdiag_cp_state()
        starts = torch.zeros(length, dtype=torch.bool)
        if state is None:  # unsharded, one document
            starts[0] = True
            carry = u.new_zeros(u.shape[-1])
        else:
            group = state.group
            rank, world = (0, 1) if group is None else (dist.get_rank(group), dist.get_world_size(group))
            first = rank * length  # contiguous layout
            bounds = state.packed_cu_seqlens_cpu
            local = bounds[(bounds >= first) & (bounds < first + length)] - first
            starts[local] = True
            anchor = torch.zeros((), dtype=u.dtype, requires_grad=True)  # puts the receive into the graph
            carry = _ReceiveCarry.apply(anchor, group, rank, world, u.shape[-1:]) if group is not None else u.new_zeros(u.shape[-1])
        h, outputs = carry, []
        for t in range(length):
            h = (h * decay) * (~starts[t]) + u[t]
            outputs.append(h)
        out = torch.stack(outputs)
        if state is not None and state.group is not None:
            out = _SendCarry.apply(out, h, state.group, rank, world)
        return out[None]


class HybridToy(nn.Module):
    """Embedding -> recurrence -> block-diagonal attention (cp_blockdiag_sdpa) -> head."""

    def __init__(self, vocab=101, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.recurrence = ToyRecurrence(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, shift_labels=None, num_items_in_batch=None, **kwargs):
        x = self.embed(input_ids)
        x = x + self.recurrence(x)
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        step = {STEP_KWARG: kwargs[STEP_KWARG]} if STEP_KWARG in kwargs else {}
        attn = bdcp.cp_blockdiag_sdpa(q, k, v, is_causal=True, **step)
        x = x + attn.transpose(1, 2).reshape(b, s, d)
        logits = self.head(x)
        if shift_labels is None:
            return logits, None
        loss = F.cross_entropy(logits[0], shift_labels[0], ignore_index=-100, reduction="sum") / num_items_in_batch
        return logits, loss


def _reference(model, docs):
    model.zero_grad(set_to_none=True)
    total, count = 0.0, 0
    for d in docs:
        logits, _ = model(d[None])
        total = total + F.cross_entropy(logits[0, :-1], d[1:], reduction="sum")
        count += d.numel() - 1
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def recurrent_case(rank, world_size, group, layout):
    torch.manual_seed(0)
    ref = HybridToy()
    model = HybridToy()
    model.load_state_dict(ref.state_dict())
    docs, batch = make_pack(layout, world_size)
    ref_loss, ref_grads = _reference(ref, docs)
    train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, batch)
    local = {k: v for k, v in local.items() if k in ("input_ids", "shift_labels", "num_items_in_batch", STEP_KWARG)}
    with train_ctx():
        _, loss = model(**local)
        loss.backward()
    errors = compare_with_reference(model, ref_loss, ref_grads, loss, group, world_size)
    worst = max(errors, key=errors.get)
    return errors[worst], worst, errors["loss"]


@pytest.mark.parametrize("layout", ["span_all", "padding_rank"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_recurrent_layer_matches_unsharded(gloo, world_size, layout):
    for rank, (err, name, loss_err) in enumerate(gloo(world_size).run(recurrent_case, layout=layout)):
        assert loss_err <= TOL, f"rank {rank}: loss relative error {loss_err:.2e}"
        assert err <= TOL, f"rank {rank}: {name} relative error {err:.2e}"


def test_state_is_none_outside_a_step_and_reset_matters():
    """Outside a step the layer sees no CP state; a pack run without resets differs from the reference
    (so the test above is sensitive to the boundary handling)."""
    assert bdcp.current_blockdiag_cp_state() is None
    torch.manual_seed(0)
    model = HybridToy()
    docs = make_docs([5, 7])
    ref_loss, _ = _reference(model, docs)
    logits, _ = model(torch.cat(docs)[None])  # one causal row: recurrence and attention cross the boundary
    pack = torch.cat(docs)
    loss = (F.cross_entropy(logits[0, :4], pack[1:5], reduction="sum") + F.cross_entropy(logits[0, 5:11], pack[6:12], reduction="sum")) / 10
    assert abs(loss.item() - float(ref_loss)) > 1e-3

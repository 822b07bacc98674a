"""Partial softmaxes: a kernel's log-sum-exp output, and the merge of two parts of one query's keys.

A kernel record with an `lse_check` takes `return_lse=True` and then returns `(out [L,H,Dv],
lse [L,H])`: `lse` in float32 (float64 for float64 inputs), natural log, of the query's scaled (and
softcapped) scores over the keys it attended, attention sinks included; gradients flow through
both. A split by keys (`CPConfig(overlap="keys")`, `planning.overlap`) attends over two disjoint
key sets and merges:

    lse = logaddexp(lse_a, lse_b),  w_x = exp(lse_x - lse),  out = w_a · out_a + w_b · out_b

which is the softmax over the union exactly. Its gradients: d out / d out_x = w_x and
d out / d lse_x = w_x · (out_x - out); with each kernel's backward through its `lse` (verified per
kernel: tests/gpu/test_lse_kernels_gpu.py) they are the exact gradients of the whole attention.
"""

from __future__ import annotations

import torch


def _weights(lse_a, lse_b, acc):
    lse = torch.logaddexp(lse_a.to(acc), lse_b.to(acc))
    return torch.exp(lse_a.to(acc) - lse).unsqueeze(-1), torch.exp(lse_b.to(acc) - lse).unsqueeze(-1)


def merge_into(out, lse, rows, other_out, other_lse) -> torch.Tensor:
    """`out` [L,H,Dv] (lse [L,H]) with its `rows` (a `(start, stop)` range or an index of n rows)
    merged with `other_out` [n,H,Dv] (`other_lse` [n,H]) over other keys -> a new [L,H,Dv].

    One autograd function: forward copies `out` once and writes the merged rows; backward copies
    the gradient once and scales the merged rows, and gives the lse gradients of those rows. As
    plain tensor ops the slices' backward would build several zero-filled gradients of `out`'s size."""
    return _MergeInto.apply(out, lse, other_out, other_lse, slice(*rows) if isinstance(rows, tuple) else rows)


class _MergeInto(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, other_out, other_lse, rows):
        acc = torch.promote_types(out.dtype, torch.float32)
        mine = out[rows].to(acc)
        weight_a, weight_b = _weights(lse[rows], other_lse, acc)
        merged = weight_a * mine + weight_b * other_out.to(acc)
        result = out.clone()
        result[rows] = merged.to(out.dtype)
        ctx.save_for_backward(mine, other_out, weight_a, weight_b, merged)
        ctx.rows, ctx.lse_meta = rows, (lse.shape, lse.dtype, other_lse.dtype)
        return result

    @staticmethod
    def backward(ctx, grad):
        mine, other_out, weight_a, weight_b, merged = ctx.saved_tensors
        rows, (lse_shape, lse_dtype, other_lse_dtype) = ctx.rows, ctx.lse_meta
        g = grad[rows].to(merged.dtype)
        grad_out = grad.clone()
        grad_out[rows] = (g * weight_a).to(grad.dtype)
        grad_lse = torch.zeros(lse_shape, dtype=lse_dtype, device=grad.device)
        grad_lse[rows] = (weight_a.squeeze(-1) * (g * (mine - merged)).sum(-1)).to(lse_dtype)
        grad_other_lse = (weight_b.squeeze(-1) * (g * (other_out.to(merged.dtype) - merged)).sum(-1)).to(other_lse_dtype)
        return grad_out, grad_lse, (g * weight_b).to(other_out.dtype), grad_other_lse, None

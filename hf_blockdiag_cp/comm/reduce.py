"""A differentiable SUM all-reduce over the CP group, for sums that several ranks' shards add to.

Each rank holds its shard's partial sums (e.g. per-document log-probs of the tokens it holds); the
forward adds them over the group, so every rank holds the same totals. If every rank then computes
the same loss from the totals, the backward all-reduce hands each rank the sum of the group's
upstream gradients, G times the one gradient; DDP / FSDP average over the G ranks, so the mean
gradient is the non-CP one, and the mean of the per-rank losses is the non-CP loss (invariant I2).
Buffers are made contiguous explicitly (docs/design.md: gloo writes contiguous bytes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = values.detach().clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total, None


def all_reduce_sum(values: torch.Tensor, group) -> torch.Tensor:
    """`values` summed over `group` (None: this process alone, returned as is), with gradients: the
    backward sums the upstream gradients over the group. Every rank must call it, and, when it
    needs a gradient, reach its backward."""
    if group is None or dist.get_world_size(group) == 1:
        return values
    return _AllReduceSum.apply(values, group)

"""Imported by the gloo pool's fork server (`dist_pool.PRELOAD`): one tiny `torch.compile` there does
dynamo's and AOT autograd's one-time set-up (about 2 s on two cores), which every worker forked
from it inherits instead of paying at its first compiled case. Nothing of it stays in dynamo's
cache (`torch.compiler.reset()`); its running counters do, so tests count compilations as differences."""

import torch


def _silu_sum(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x).sum()


torch.compile(_silu_sum, backend="aot_eager")(torch.ones(2, requires_grad=True)).backward()
torch.compiler.reset()

"""One small all-reduce per step that keeps the CP group in lock step (invariant I5).

Each rank contributes a short vector of integers (an error flag, shapes, checksums of the
pack, the exchange it would choose). One MAX all-reduce over `[v, -v]` yields both the
maximum and the minimum of every entry, so every rank learns whether any rank failed and
whether all ranks agree, and all of them raise together instead of leaving peers blocked in
the next collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreement:
    maximum: list[int]
    minimum: list[int]

    @property
    def any_failed(self) -> bool:
        return self.maximum[0] != 0

    def disagreeing(self, names: list[str]) -> list[str]:
        """Names of the entries (after the error flag) on which ranks differ."""
        return [n for n, hi, lo in zip(names, self.maximum[1:], self.minimum[1:]) if hi != lo]


def collective_device(group) -> torch.device:
    """Device for small control tensors: CUDA for NCCL groups, CPU otherwise."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, failed: bool, values: list[int]) -> Agreement:
    """All-reduce `[failed, *values]` (MAX and MIN at once); every rank gets the same answer."""
    vec = torch.tensor([int(failed), *values], dtype=torch.int64)
    if group is None:
        return Agreement(vec.tolist(), vec.tolist())
    both = torch.cat([vec, -vec]).to(collective_device(group))
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    both = both.cpu()
    n = vec.numel()
    return Agreement(both[:n].tolist(), (-both[n:]).tolist())


def checksum(t: torch.Tensor) -> int:
    """Cheap position-sensitive checksum of an integer tensor (same on every rank for the same data)."""
    flat = t.reshape(-1).long().cpu()
    weights = torch.arange(flat.numel(), dtype=torch.int64) % 65521 + 1
    return int(((flat % 1000003) * weights).sum() % (2**61 - 1))

"""One small all-reduce per step that keeps the CP group in lock step (invariant I5, docs/design.md).

Each rank contributes named integers (an error flag, shapes, checksums of the pack, the
exchange it would choose). One MAX all-reduce over `[v, -v]` yields both the maximum and the
minimum of every entry, so every rank learns whether any rank failed and on which entries
the ranks disagree, and all of them raise together instead of leaving peers blocked in the
next collective.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreement:
    """The group-wide maximum and minimum of every named value, and whether any rank failed."""

    names: tuple[str, ...]
    maximum: tuple[int, ...]
    minimum: tuple[int, ...]
    any_failed: bool

    def disagreeing(self) -> list[str]:
        """Names of the values on which ranks differ."""
        return [n for n, hi, lo in zip(self.names, self.maximum, self.minimum) if hi != lo]

    def value(self, name: str) -> tuple[int, int]:
        """(minimum, maximum) of one named value over the group."""
        i = self.names.index(name)
        return self.minimum[i], self.maximum[i]


def collective_device(group) -> torch.device:
    """Device for small control tensors: CUDA for NCCL groups, CPU otherwise."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group, failed: bool, values) -> Agreement:
    """All-reduce `failed` and the named integers `values` (a mapping or a dataclass of ints),
    MAX and MIN at once; every rank of `group` (None: this process alone) gets the same answer."""
    if dataclasses.is_dataclass(values):
        values = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    if not isinstance(values, Mapping):
        raise TypeError(f"agree takes named values (a mapping or a dataclass of ints); got {type(values).__name__}")
    names = tuple(values)
    vec = torch.tensor([int(failed), *(int(values[n]) for n in names)], dtype=torch.int64)
    if group is not None:
        both = torch.cat([vec, -vec]).to(collective_device(group))
        dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
        both = both.cpu()
        hi, lo = both[: vec.numel()], -both[vec.numel():]
    else:
        hi = lo = vec
    return Agreement(names, tuple(hi[1:].tolist()), tuple(lo[1:].tolist()), bool(hi[0] != 0))


def checksum(t: torch.Tensor) -> int:
    """Cheap position-sensitive checksum of an integer tensor (same on every rank for the same data)."""
    flat = t.reshape(-1).long().cpu()
    weights = torch.arange(flat.numel(), dtype=torch.int64) % 65521 + 1
    return int(((flat % 1000003) * weights).sum() % (2**61 - 1))

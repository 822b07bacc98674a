"""Deprecated names of the dp × cp placement, kept for one release: use `ParallelDims`
(`hf_blockdiag_cp.comm.parallel_dims`, also at the package root), which adds tp and dp_replicate.

| old name                                   | new name                                              |
|--------------------------------------------|-------------------------------------------------------|
| `DPCPCoordinates(world_size, rank, cp_size)` | `ParallelDims(cp=cp_size, world_size=..., rank=...)` |
| `DPCPMesh`                                 | `ParallelMesh`                                        |
| `build_dp_cp_mesh(coords, device_type)`    | `dims.build_mesh(device_type)`                        |
| `integrations.accelerate.init_distributed` | `integrations.accelerate.init_parallel`               |

The placement is unchanged: with tp = 1 (all the old names know) CP is the fastest-varying
dimension, and the CP group of global rank r is `[dp_rank * cp, (dp_rank + 1) * cp)`.
"""

from __future__ import annotations

from .parallel_dims import ParallelDims, ParallelMesh, _is_int, _positive_int, world_size_error

__all__ = ["DPCPCoordinates", "DPCPMesh", "build_dp_cp_mesh", "world_size_error"]


class DPCPCoordinates(ParallelDims):
    """Deprecated alias (one release) of `ParallelDims(cp=cp_size, world_size=world_size, rank=rank)`:
    global `rank` of `world_size` processes in a grid of `world_size // cp_size` DP replicas × `cp_size`.
    It is a `ParallelDims` (dp_shard = the replicas, tp = 1) and keeps the old positional signature
    and error messages."""

    def __init__(self, world_size: int, rank: int, cp_size: int):
        _positive_int("world_size", world_size)
        _positive_int("cp_size", cp_size)
        reason = world_size_error(world_size, cp_size)
        if reason is not None:
            raise ValueError(reason)
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}); got {rank!r}")
        super().__init__(cp=cp_size, world_size=world_size, rank=rank)


DPCPMesh = ParallelMesh  # deprecated alias (one release): `.cp`, `.dp`, `.dp_cp` and `.mesh` as before


def build_dp_cp_mesh(coords: ParallelDims, device_type: str) -> ParallelMesh:
    """Deprecated alias (one release) of `coords.build_mesh(device_type)`: the meshes of the grid
    of `coords` (a `DPCPCoordinates` or any `ParallelDims`)."""
    if not isinstance(coords, ParallelDims):
        raise TypeError(f"coords must be a ParallelDims (or DPCPCoordinates); got {type(coords).__name__}")
    return coords.build_mesh(device_type)

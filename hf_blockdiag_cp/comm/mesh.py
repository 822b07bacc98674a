"""Where a rank sits in the dp × cp grid, and the one DeviceMesh builder for that grid.

CP is the fastest-varying dimension: the CP group of global rank r is the ranks
`[dp_rank * cp, (dp_rank + 1) * cp)`. The custom loop, the Trainer and the data loader all
place ranks through `DPCPCoordinates`, and every mesh comes from `build_dp_cp_mesh`.
"""

from __future__ import annotations

from dataclasses import dataclass


def world_size_error(world_size: int, cp_size: int, command: str | None = None) -> str | None:
    """Why `world_size` processes cannot form CP groups of `cp_size`, or None. `command`: the launch
    command to suggest when the launcher started fewer processes than one CP group needs."""
    if world_size % cp_size == 0:
        return None
    if world_size < cp_size:
        command = command or f"torchrun --standalone --nproc-per-node {cp_size} <your script>"
        return (
            f"world size {world_size} is not divisible by cp_size={cp_size}: the launcher started fewer processes "
            f"({world_size}) than the CP size. Start {cp_size} processes per CP group, e.g. `{command}`, or use "
            "cp_size=1 in a single process"
        )
    return (
        f"world size {world_size} is not divisible by cp_size={cp_size}: every CP group needs cp_size processes "
        f"(launch a multiple of {cp_size} processes or change cp_size)"
    )


def _positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


@dataclass(frozen=True)
class DPCPCoordinates:
    """Global `rank` of `world_size` processes in a grid of `world_size // cp_size` DP replicas × `cp_size`."""

    world_size: int
    rank: int
    cp_size: int

    def __post_init__(self):
        _positive_int("world_size", self.world_size)
        _positive_int("cp_size", self.cp_size)
        reason = world_size_error(self.world_size, self.cp_size)
        if reason is not None:
            raise ValueError(reason)
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={self.world_size}); got {self.rank!r}")

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_size

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp_size

    @property
    def cp_group_ranks(self) -> list[int]:
        """The global ranks of this rank's CP group, in CP-rank order."""
        return list(range(self.dp_rank * self.cp_size, (self.dp_rank + 1) * self.cp_size))

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True)
class DPCPMesh:
    """The 2-D `("dp", "cp")` DeviceMesh and the 1-D `"dp_cp"` mesh of all its ranks in the same order
    (global rank = dp_rank * cp_size + cp_rank)."""

    mesh: object  # DeviceMesh ("dp", "cp")
    dp_cp: object  # DeviceMesh ("dp_cp",): all ranks, what DDP / FSDP2 reduce over

    @property
    def cp(self):
        """The 1-D CP mesh that `make_cp_blockdiag_batch_and_ctx` takes."""
        return self.mesh["cp"]

    @property
    def dp(self):
        return self.mesh["dp"]


def build_dp_cp_mesh(coords: DPCPCoordinates, device_type: str) -> DPCPMesh:
    """`init_device_mesh(device_type, (dp, cp), mesh_dim_names=("dp", "cp"))` plus the `"dp_cp"` mesh
    of all ranks, over the default process group (accelerate flattens its mesh instead, through
    torch internals). A world of one process gets a mesh of size 1 (a CP group of one: the step
    runs unsharded), over a one-process group this call starts when none exists, so `python
    train.py` and a launcher run the same code. Raises if the mesh places this rank elsewhere than `coords`
    (every other part of the library assumes CP fastest-varying)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if coords.world_size == 1 and not dist.is_initialized():
        # No launcher: a process group of this process alone (an in-memory store, no network).
        dist.init_process_group("gloo" if device_type == "cpu" else None, store=dist.HashStore(), rank=0, world_size=1)

    mesh = init_device_mesh(device_type, (coords.dp_size, coords.cp_size), mesh_dim_names=("dp", "cp"))
    placed = (mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank())
    if placed != (coords.dp_rank, coords.cp_rank):
        raise RuntimeError(
            f"DeviceMesh placed rank {coords.rank} at (dp, cp) = {placed}; expected "
            f"{(coords.dp_rank, coords.cp_rank)} with cp fastest-varying"
        )
    return DPCPMesh(mesh, DeviceMesh.from_group(dist.group.WORLD, device_type, mesh_dim_names=("dp_cp",)))

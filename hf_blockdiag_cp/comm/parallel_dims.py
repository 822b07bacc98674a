"""`ParallelDims`: the sizes of the dp_replicate × dp_shard × cp × tp grid, where a rank sits in it,
and the named DeviceMeshes of that grid (`ParallelMesh`).

The grid is torchtitan's, tp fastest-varying:

    global rank = ((dp_replicate_rank * dp_shard + dp_shard_rank) * cp + cp_rank) * tp + tp_rank

With tp = 1 this is the library's old placement (rank = dp_rank * cp + cp_rank, CP groups of
consecutive ranks), so the data loader, the Trainer and every mesh agree on it. What each
dimension carries:

- **dp_replicate, dp_shard**: data parallelism; `dp = dp_replicate * dp_shard` replicas each
  train on their own packs. FSDP2 shards the parameters over dp_shard × cp and replicates them
  over dp_replicate (HSDP); DDP reduces over every dp × cp rank.
- **cp**: the ranks of one CP group share one pack, each holding a shard of its tokens; the
  K/V exchange runs over the cp mesh only.
- **tp**: tensor parallelism; the ranks of one TP group share the pack *and* the CP shard and
  each runs a slice of the heads and MLP channels. Block-diagonal CP needs nothing from it.

Gradients are averaged over the dp × cp ranks (the loss of each rank is scaled for that, I2),
never over tp: TP ranks compute the same tokens.
"""

from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass, field

from ..compat.torch import flatten_mesh, unflatten_mesh

DIMS = ("dp_replicate", "dp_shard", "cp", "tp")  # mesh dimension order, slowest first
# The dimensions that may be -1 ("the rest of the world"), one at a time.
_FLEXIBLE = ("dp_shard", "cp")


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


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value) -> None:
    if not _is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")


def dims_error(world_size: int, sizes: dict[str, int], command: str | None = None) -> str | None:
    """Why `world_size` processes cannot form the grid `sizes` (dimension name -> size, at most one
    of them -1: the rest of the world), or None. `command`: a launch command for `world_size` too small."""
    rest = [name for name, size in sizes.items() if size == -1]
    fixed = {name: size for name, size in sizes.items() if size != -1}
    product = math.prod(fixed.values())
    names = "*".join(name for name, size in fixed.items() if size > 1) or "*".join(fixed)
    if world_size < product:
        command = command or f"torchrun --standalone --nproc-per-node {product} <your script>"
        return (
            f"world size {world_size} is not divisible by {names}={product}: the launcher started fewer processes "
            f"({world_size}) than one grid needs. Start {product} processes (or a multiple), e.g. `{command}`, "
            "or make the dimensions smaller"
        )
    if world_size % product:
        return (
            f"world size {world_size} is not divisible by {names}={product} "
            f"(launch a multiple of {product} processes or change {names.replace('*', ', ')})"
        )
    if not rest and world_size != product:
        return (
            f"world size {world_size} is not {names}={product}: every rank needs a place in the grid; set "
            f"dp_shard=-1 (or cp=-1) to give the rest of the world to that dimension, or launch {product} processes"
        )
    return None


@dataclass(frozen=True)
class ParallelDims:
    """The sizes of the dp_replicate × dp_shard × cp × tp grid and the place of global `rank` in it.

    `dp_shard` or `cp` (one of them) may be -1: the rest of the world once the others are
    placed (default: `dp_shard=-1`, every rank not in CP or TP is a data-parallel replica).
    `world_size` and `rank` default to the default process group's (1 and 0 without one). The
    sizes are validated here: every error names the field and what was expected.

    The grid's order and its meshes (`build_mesh`) are the module docstring's: tp fastest, then
    cp, dp_shard, dp_replicate. With tp = 1 a rank's CP group is `[dp_rank * cp, (dp_rank + 1) * cp)`.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    tp: int = 1
    world_size: int | None = field(default=None, kw_only=True)
    rank: int | None = field(default=None, kw_only=True)

    def __post_init__(self):
        world_size, rank = self.world_size, self.rank
        if world_size is None or rank is None:
            default_world, default_rank = _process_group_place()
            world_size = default_world if world_size is None else world_size
            rank = default_rank if rank is None else rank
        _positive_int("world_size", world_size)
        sizes = {name: getattr(self, name) for name in DIMS}
        for name, size in sizes.items():
            if name in _FLEXIBLE and size == -1:
                continue
            if not _is_int(size) or size <= 0:
                also = " or -1 (the rest of the world)" if name in _FLEXIBLE else ""
                raise ValueError(f"{name} must be a positive integer{also}; got {size!r}")
        if sizes["dp_shard"] == -1 and sizes["cp"] == -1:
            raise ValueError("dp_shard and cp are both -1; expected at most one dimension to take the rest of the world")
        reason = dims_error(world_size, sizes)
        if reason is not None:
            raise ValueError(reason)
        if not _is_int(rank) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an integer in [0, world_size={world_size}); got {rank!r}")
        rest = world_size // math.prod(size for size in sizes.values() if size != -1)
        for name, size in sizes.items():
            object.__setattr__(self, name, rest if size == -1 else size)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "rank", rank)

    # ------------------------------------------------------------------ sizes

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(dp_replicate, dp_shard, cp, tp): the mesh's shape, in `DIMS` order."""
        return (self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @property
    def dp_size(self) -> int:
        """The number of data-parallel replicas (each its own packs): dp_replicate * dp_shard."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp_size(self) -> int:
        return self.cp

    @property
    def tp_size(self) -> int:
        return self.tp

    @property
    def fsdp_size(self) -> int:
        """The ranks FSDP2 shards each parameter over: dp_shard * cp."""
        return self.dp_shard * self.cp

    @property
    def dp_cp_size(self) -> int:
        """The ranks whose gradients are averaged: dp * cp (every rank of one TP position)."""
        return self.dp_size * self.cp

    # ------------------------------------------------------------------ this rank

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def cp_rank(self) -> int:
        return (self.rank // self.tp) % self.cp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel replica, in [0, dp_size): what the data loader reads."""
        return self.rank // (self.tp * self.cp)

    @property
    def dp_shard_rank(self) -> int:
        return self.dp_rank % self.dp_shard

    @property
    def dp_replicate_rank(self) -> int:
        return self.dp_rank // self.dp_shard

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def global_rank(self, dp_rank: int, cp_rank: int, tp_rank: int = 0) -> int:
        """The global rank at (dp_rank, cp_rank, tp_rank) of this grid."""
        return (dp_rank * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def cp_group_ranks(self) -> list[int]:
        """The global ranks of this rank's CP group, in CP-rank order."""
        return [self.global_rank(self.dp_rank, c, self.tp_rank) for c in range(self.cp)]

    @property
    def tp_group_ranks(self) -> list[int]:
        """The global ranks of this rank's TP group, in TP-rank order."""
        return [self.global_rank(self.dp_rank, self.cp_rank, t) for t in range(self.tp)]

    @property
    def dp_cp_group_ranks(self) -> list[int]:
        """The ranks this rank's gradients are averaged with (dp × cp at its TP position), in mesh order."""
        return [self.global_rank(d, c, self.tp_rank) for d in range(self.dp_size) for c in range(self.cp)]

    def for_rank(self, rank: int) -> ParallelDims:
        """The same grid, placing `rank`."""
        return ParallelDims(*self.shape, world_size=self.world_size, rank=rank)

    # ------------------------------------------------------------------ meshes

    def build_mesh(self, device_type: str) -> ParallelMesh:
        """The 4-D DeviceMesh `("dp_replicate", "dp_shard", "cp", "tp")` of this grid, with the
        flattened meshes `"dp"` (dp_replicate × dp_shard), `"dp_shard_cp"` (what FSDP2 shards over)
        and `"dp_cp"` (what DDP reduces over), over the default process group. Every rank calls it.

        A world of one process gets a mesh of size 1 (a CP group of one: the step runs unsharded),
        over a one-process group this call starts when none exists, so `python train.py` and a
        launcher run the same code. Raises if the mesh places this rank elsewhere than this object.

        One grid shape and device type get one mesh per default process group: a second call returns
        the first call's meshes and creates no process group (each gloo group holds its own threads
        and sockets). A new default process group (after `destroy_process_group`) gets new meshes.
        """
        import torch.distributed as dist

        if self.world_size == 1 and not dist.is_initialized():
            # No launcher: a process group of this process alone (an in-memory store, no network).
            dist.init_process_group("gloo" if device_type == "cpu" else None, store=dist.HashStore(), rank=0, world_size=1)
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            raise RuntimeError(
                f"ParallelDims places rank {self.rank} of world size {self.world_size}, but this process is rank "
                f"{dist.get_rank()} of {dist.get_world_size()} in the default process group"
            )
        with _MESHES.lock:
            meshes = _MESHES.of(dist.group.WORLD)
            key = (self.shape, device_type)
            if key not in meshes:
                meshes[key] = self._new_mesh(device_type)
            return meshes[key]

    def _new_mesh(self, device_type: str) -> ParallelMesh:
        """`build_mesh`'s meshes, their process groups created now."""
        from torch.distributed.device_mesh import init_device_mesh

        world = init_device_mesh(device_type, self.shape, mesh_dim_names=DIMS)
        placed = tuple(world[name].get_local_rank() for name in DIMS)
        expected = (self.dp_replicate_rank, self.dp_shard_rank, self.cp_rank, self.tp_rank)
        if placed != expected:
            raise RuntimeError(
                f"DeviceMesh placed rank {self.rank} at {dict(zip(DIMS, placed))}; expected {dict(zip(DIMS, expected))} "
                "with tp fastest-varying, then cp"
            )
        # Flattened and regrouped views, kept here (torch deprecates slicing flattened names off the root).
        dp_cp = flatten_mesh(world["dp_replicate", "dp_shard", "cp"], "dp_cp")
        dp_shard_cp = flatten_mesh(world["dp_shard", "cp"], "dp_shard_cp")
        dp = flatten_mesh(world["dp_replicate", "dp_shard"], "dp")
        dp_by_cp = unflatten_mesh(dp_cp, 0, (self.dp_size, self.cp), ("dp", "cp"))
        hsdp = None
        if self.dp_replicate > 1:
            hsdp = unflatten_mesh(dp_cp, 0, (self.dp_replicate, self.fsdp_size), ("dp_replicate", "dp_shard_cp"))
        return ParallelMesh(self, world, dp, dp_shard_cp, dp_cp, dp_by_cp, hsdp)


def check_tp_mesh(tp_mesh, cp_group) -> None:
    """Raise if `tp_mesh` is not None, a 1-D DeviceMesh or a ProcessGroup, or if its group shares a rank
    other than this process's with `cp_group` (a CP group that holds TP peers would exchange keys
    between ranks holding different heads)."""
    if tp_mesh is None:
        return
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(tp_mesh, DeviceMesh):
        if tp_mesh.ndim != 1:
            raise ValueError(
                f"tp_mesh must be a 1-D DeviceMesh (the TP dimension); got {tp_mesh.ndim} dimensions {tp_mesh.mesh_dim_names}"
            )
        group = tp_mesh.get_group()
    elif isinstance(tp_mesh, dist.ProcessGroup):
        group = tp_mesh
    else:
        raise TypeError(f"tp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None; got {type(tp_mesh).__name__}")
    if cp_group is None:
        return
    shared = sorted(set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(cp_group)))
    if len(shared) > 1:
        raise ValueError(
            f"cp_mesh and tp_mesh share ranks {shared}; expected only this rank ({dist.get_rank()}): they must be two "
            "dimensions of one grid (ParallelDims(...).build_mesh(device_type): its .cp and .tp)"
        )


class _MeshCache:
    """The meshes `build_mesh` made over one default process group, by (shape, device type); emptied
    when the default group is another object (destroyed and started again). Holds the group by a
    weak reference, so a destroyed group is not kept alive."""

    def __init__(self):
        self.lock = threading.Lock()
        self._group = None
        self._meshes: dict = {}

    def of(self, default_group) -> dict:
        if self._group is None or self._group() is not default_group:
            self._group, self._meshes = weakref.ref(default_group), {}
        return self._meshes


_MESHES = _MeshCache()


def _process_group_place() -> tuple[int, int]:
    """(world size, rank) of the default process group; (1, 0) without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass(frozen=True)
class ParallelMesh:
    """The named meshes of one `ParallelDims` grid (built by `ParallelDims.build_mesh`, on every rank).

    `world`: the 4-D mesh `("dp_replicate", "dp_shard", "cp", "tp")`; `mesh[name]` gives any
    named mesh below (or slices `world`). Pass `cp` and `tp` to
    `make_cp_blockdiag_batch_and_ctx(cp_mesh, tp_mesh, batch)`, `tp` to tensor parallelism,
    `fsdp` to FSDP2 `fully_shard` and `dp_cp` to DDP. All share `world` as their root mesh (FSDP2
    over TP's DTensors needs that).
    """

    dims: ParallelDims
    world: object  # DeviceMesh ("dp_replicate", "dp_shard", "cp", "tp")
    dp: object  # 1-D: dp_replicate × dp_shard, one rank per replica
    dp_shard_cp: object  # 1-D: what FSDP2 shards over
    dp_cp: object  # 1-D: every dp × cp rank at this TP position; what DDP reduces over
    mesh: object  # 2-D ("dp", "cp"): what `DPCPMesh.mesh` was
    hsdp: object = None  # 2-D ("dp_replicate", "dp_shard_cp") when dp_replicate > 1, else None

    def __getitem__(self, names):
        named = {"dp": self.dp, "dp_shard_cp": self.dp_shard_cp, "dp_cp": self.dp_cp}
        if isinstance(names, str) and names in named:
            return named[names]
        return self.world[names]

    @property
    def cp(self):
        """The 1-D CP mesh: the ranks that share one pack, each with its shard of the tokens."""
        return self.world["cp"]

    @property
    def tp(self):
        """The 1-D TP mesh: the ranks that share one pack and one CP shard."""
        return self.world["tp"]

    @property
    def fsdp(self):
        """The mesh for FSDP2 `fully_shard`: `dp_shard_cp`, or the 2-D `hsdp` mesh (shard within a
        replica group, replicate across) when dp_replicate > 1. Either way FSDP2 averages the
        gradients over every dp × cp rank."""
        return self.hsdp if self.hsdp is not None else self.dp_shard_cp

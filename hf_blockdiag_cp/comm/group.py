"""The CP process group: resolving what the user passes, and where its ranks sit."""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class CPGroup:
    """The CP process group (None without CP), its size and this process's rank in it."""

    group: Any
    size: int
    rank: int


def resolve_cp_group(cp_mesh) -> CPGroup:
    """Accept a 1-D DeviceMesh, a ProcessGroup, or None (no CP); a group of one rank is no CP."""
    if cp_mesh is None:
        return CPGroup(None, 1, 0)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be a 1-D DeviceMesh (the CP dimension); got {cp_mesh.ndim} dimensions {cp_mesh.mesh_dim_names}")
        group = cp_mesh.get_group()
        size = dist.get_world_size(group)
        if size != cp_mesh.size():
            raise ValueError(f"cp_mesh has {cp_mesh.size()} ranks but its process group has {size}")
    elif isinstance(cp_mesh, dist.ProcessGroup):
        group = cp_mesh
        size = dist.get_world_size(group)
    else:
        raise TypeError(f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None; got {type(cp_mesh).__name__}")
    if size == 1:
        return CPGroup(None, 1, 0)
    return CPGroup(group, size, dist.get_rank(group))


def group_spans_nodes(group) -> bool:
    """Whether the group's ranks sit on several nodes, from the launcher's LOCAL_WORLD_SIZE (torchrun,
    accelerate). Without it every rank is assumed on one node."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if group is None or not local or not local.isdigit() or int(local) < 1:
        return False
    per_node = int(local)
    return len({r // per_node for r in dist.get_process_group_ranks(group)}) > 1


def group_ref(group):
    """A weak reference to `group` for an autograd context (None: the default group).

    Autograd keeps a function's context as long as the graph, and after an error a graph can
    outlive the step in a cycle through C++ (a non-reentrant checkpoint's saved-tensor hooks):
    a strong reference would keep a destroyed gloo group's sockets open and leave the peers of a
    failed rank waiting (I5)."""
    return None if group is None else weakref.ref(group)


def resolve_group(ref):
    """The group behind `group_ref`'s reference; raise if it was released meanwhile."""
    if ref is None:
        return None
    group = ref()
    if group is None:
        raise RuntimeError("blockdiag_cp: the CP process group was released while a backward collective still needed it")
    return group

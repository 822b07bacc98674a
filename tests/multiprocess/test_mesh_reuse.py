"""`ParallelDims.build_mesh` builds one set of process groups per grid shape: building the same mesh
again (same shape, device type and default process group) returns the first mesh and creates no
process group and no thread; another shape gets its own mesh; a new default process group gets new
meshes. Without this every Trainer run of a long-lived process added a dozen gloo groups, each with
its own threads and sockets, and none was ever destroyed."""

from __future__ import annotations

import os

import torch.distributed as dist

from hf_blockdiag_cp.comm import ParallelDims


def _groups() -> int:
    """The process groups torch.distributed holds in this process (its own bookkeeping)."""
    return len(dist.distributed_c10d._world.pg_names)


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def mesh_twice_case(rank, world_size, group):
    """(groups and threads the first build added, the same for the second, the second is the first,
    the other shape's mesh is another with its own CP size, the groups that shape added)."""
    groups, threads = _groups(), _threads()
    first = ParallelDims(dp_replicate=2, cp=2).build_mesh("cpu")  # a shape this file alone builds
    made = (_groups() - groups, _threads() - threads)
    groups, threads = _groups(), _threads()
    again = ParallelDims(dp_replicate=2, cp=2).build_mesh("cpu")
    again_made = (_groups() - groups, _threads() - threads)
    groups = _groups()
    other = ParallelDims(cp=4).build_mesh("cpu")
    other_groups = _groups() - groups
    first.cp.get_group()  # the first mesh's groups still work after the other shape was built
    dist.barrier(group=first.dp_cp.get_group())
    return made, again_made, again is first, (other is not first, other.cp.size(), first.cp.size()), other_groups


def test_a_mesh_built_twice_makes_no_second_set_of_groups(gloo):
    for rank, (made, again_made, same, other, other_groups) in enumerate(gloo(4).run(mesh_twice_case)):
        assert made[0] > 0, f"rank {rank}: the first build made no process group (was the shape built before?)"
        assert again_made == (0, 0), f"rank {rank}: building the mesh again added (groups, threads) {again_made}"
        assert same, f"rank {rank}: the second build returned another mesh"
        assert other == (True, 4, 2), f"rank {rank}: the other shape's mesh (is another, its cp, the first's cp): {other}"
        assert other_groups >= 0


def test_a_new_default_group_gets_new_meshes():
    """A mesh is cached for its default process group only: after `destroy_process_group` and a new
    `init_process_group`, the same shape is built anew (its groups belong to the new default group)."""
    assert not dist.is_initialized()
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        first = ParallelDims(cp=1).build_mesh("cpu")
        assert ParallelDims(cp=1).build_mesh("cpu") is first
        dist.destroy_process_group()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        second = ParallelDims(cp=1).build_mesh("cpu")
        assert second is not first
        assert second.cp.get_group() is dist.group.WORLD  # a world of one: every dimension is the default group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()

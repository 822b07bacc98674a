"""`ParallelDims`: where each rank sits in the dp_replicate × dp_shard × cp × tp grid, checked against
the layout `init_device_mesh` gives (`torch.arange(world).reshape(shape)`, tp fastest); its sizes
validated with errors that name the field; the deprecated dp × cp names still placing ranks as
before (tp = 1); and `init_parallel` refusing a world too small for the grid before any process
group. The meshes themselves, with TP × CP × FSDP2: multiprocess/test_tp_cp_fsdp.py."""

from __future__ import annotations

import itertools

import pytest
import torch

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp import comm
from hf_blockdiag_cp.comm import DPCPCoordinates, DPCPMesh, ParallelDims, ParallelMesh, build_dp_cp_mesh
from hf_blockdiag_cp.integrations import accelerate
from hf_blockdiag_cp.integrations.accelerate import init_distributed, init_parallel

SHAPES = [s for s in itertools.product([1, 2, 3], [1, 2, 3], [1, 2, 4], [1, 2]) if 1 <= torch.Size(s).numel() <= 24]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_every_rank_sits_where_the_device_mesh_puts_it(shape):
    world = torch.Size(shape).numel()
    grid = torch.arange(world).reshape(shape)  # init_device_mesh's layout of (dp_replicate, dp_shard, cp, tp)
    for rank in range(world):
        dims = ParallelDims(*shape, world_size=world, rank=rank)
        r, s, c, t = (int(i) for i in (grid == rank).nonzero()[0])
        assert (dims.dp_replicate_rank, dims.dp_shard_rank, dims.cp_rank, dims.tp_rank) == (r, s, c, t)
        assert dims.dp_rank == r * shape[1] + s and dims.dp_size == shape[0] * shape[1]
        assert dims.cp_group_ranks == grid[r, s, :, t].tolist()
        assert dims.tp_group_ranks == grid[r, s, c, :].tolist()
        assert dims.dp_cp_group_ranks == grid[:, :, :, t].flatten().tolist()
        assert dims.global_rank(dims.dp_rank, c, t) == rank
        assert dims.for_rank(0).shape == dims.shape and dims.for_rank(0).rank == 0


@pytest.mark.parametrize("dp,cp", [(1, 1), (3, 1), (1, 4), (2, 3), (4, 2)])
def test_the_old_names_place_ranks_as_before(dp, cp):
    """DPCPCoordinates(world_size, rank, cp_size) is ParallelDims(cp=cp_size) with dp_shard = the replicas
    and tp = 1: rank = dp_rank * cp + cp_rank, CP groups of consecutive ranks."""
    world = dp * cp
    for rank in range(world):
        old = DPCPCoordinates(world, rank, cp)
        assert isinstance(old, ParallelDims)
        assert old.shape == ParallelDims(cp=cp, world_size=world, rank=rank).shape == (1, dp, cp, 1)
        assert (old.dp_rank, old.cp_rank, old.dp_size, old.cp_size) == (rank // cp, rank % cp, dp, cp)
        assert old.cp_group_ranks == list(range(rank // cp * cp, (rank // cp + 1) * cp))


def test_one_dimension_takes_the_rest_of_the_world():
    assert ParallelDims(cp=2, tp=2, world_size=16, rank=0).shape == (1, 4, 2, 2)  # dp_shard=-1 (the default)
    assert ParallelDims(dp_shard=1, cp=-1, tp=2, world_size=8, rank=0).shape == (1, 1, 4, 2)
    assert ParallelDims(dp_replicate=2, cp=2, world_size=8, rank=7).shape == (2, 2, 2, 1)
    assert ParallelDims(world_size=1, rank=0).shape == (1, 1, 1, 1)
    dims = ParallelDims(cp=1)  # no process group: a world of one
    assert (dims.world_size, dims.rank, dims.shape) == (1, 0, (1, 1, 1, 1))


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp_shard=2, cp=2, tp=2, world_size=6), r"world size 6 is not divisible by dp_shard\*cp\*tp=8"),
    (dict(cp=2, tp=2, world_size=6), r"world size 6 is not divisible by cp\*tp=4 \(launch a multiple of 4"),
    (dict(cp=4, world_size=2), r"world size 2 is not divisible by cp=4: the launcher started fewer processes \(2\)"),
    (dict(dp_shard=2, cp=2, tp=2, world_size=16), r"world size 16 is not dp_shard\*cp\*tp=8: .*dp_shard=-1"),
    (dict(dp_shard=-1, cp=-1, world_size=4), "dp_shard and cp are both -1"),
    (dict(tp=0, world_size=4), "tp must be a positive integer; got 0"),
    (dict(tp=-1, world_size=4), "tp must be a positive integer; got -1"),
    (dict(dp_replicate=True, world_size=4), "dp_replicate must be a positive integer; got True"),
    (dict(cp=0, world_size=4), r"cp must be a positive integer or -1 \(the rest of the world\); got 0"),
    (dict(dp_shard=2.0, world_size=4), "dp_shard must be a positive integer or -1"),
    (dict(world_size=0), "world_size must be a positive integer; got 0"),
    (dict(cp=2, world_size=4, rank=4), r"rank must be an integer in \[0, world_size=4\); got 4"),
])
def test_bad_sizes_raise_naming_the_field(kwargs, message):
    kwargs.setdefault("rank", 0)
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_old_names_are_aliases_of_the_new_ones():
    assert bdcp.ParallelDims is comm.ParallelDims is ParallelDims and "ParallelDims" in bdcp.__all__
    assert DPCPMesh is ParallelMesh and issubclass(DPCPCoordinates, ParallelDims)
    for old in (DPCPCoordinates, build_dp_cp_mesh, init_distributed):
        assert "Deprecated alias" in old.__doc__, old
    with pytest.raises(TypeError, match="coords must be a ParallelDims"):
        build_dp_cp_mesh((4, 0, 2), "cpu")


@pytest.fixture
def one_process(monkeypatch):
    """An environment with none of the launchers' variables (plain `python script.py`)."""
    for name in (*accelerate._WORLD_SIZE_VARS, "RANK", "LOCAL_RANK", "MASTER_ADDR", "ACCELERATE_USE_CPU"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr("sys.argv", ["train.py", "--steps", "2"])
    return monkeypatch


def test_init_parallel_refuses_a_world_too_small_for_the_grid(one_process):
    with pytest.raises(ValueError) as info:
        init_parallel(cp=2, tp=2, cpu=True)
    message = str(info.value)
    assert "world size 1 is not divisible by cp*tp=4: the launcher started fewer processes (1)" in message, message
    assert "`torchrun --standalone --nproc-per-node 4 train.py --steps 2`" in message, message
    setup = init_parallel(cpu=True)  # one process: cp takes the (one-rank) world
    assert setup.dims.shape == (1, 1, 1, 1) and setup.coords is setup.dims
    assert not torch.distributed.is_initialized()

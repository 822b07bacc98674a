"""DP×CP process layout for custom training loops started with torchrun or `accelerate launch`.

What we chose, and why:

- **Launcher.** On GPUs `accelerate launch --num_processes N` (torchrun underneath) or torchrun.
  On a CPU-only host accelerate 1.x starts several processes only through MPI
  (`--mpirun_hostfile`); without it `accelerate launch [--cpu] --num_processes N` runs the
  script once. `launch_error` recognises that case so a script can stop and name
  `torchrun --standalone --nproc-per-node N`, the CPU launcher, instead of training alone.
- **Process group: accelerate's `PartialState`.** It understands torchrun-style and MPI
  environments and sets the CUDA device per local rank. Where it leaves a multi-process run
  uninitialised (torchrun on a CPU-only host) we start the group ourselves (gloo on CPU,
  NCCL on CUDA).
- **Placement and mesh: `hf_blockdiag_cp.comm.mesh`** (`DPCPCoordinates`, `build_dp_cp_mesh`),
  CP fastest-varying: the rank order of accelerate's `ParallelismConfig(dp_shard_size=dp,
  cp_size=cp)`. We do **not** pass a `ParallelismConfig(cp_size=…)` to an `Accelerator`: its
  `prepare` attaches torch `context_parallel` hooks to the model (ring attention over one
  causal document per row), which would shard the batch a second time and let packed
  documents attend to each other.
- **Gradient reduction is the engine's job**: DDP over all dp×cp ranks, or FSDP2
  `fully_shard` over the `dp_cp` mesh of all ranks (accelerate's `dp_shard_cp`). Both average
  gradients over the dp×cp ranks; the training loop only scales each rank's loss (I2).
"""

from __future__ import annotations

import contextlib
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..comm.mesh import DPCPCoordinates, DPCPMesh, world_size_error
from ..model_patches import apply_model_patches

_TRUE = ("1", "true", "yes", "on")
# World-size variables of the launchers accelerate supports: torchrun's, then the MPI flavours'.
_WORLD_SIZE_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


# --------------------------------------------------------------------------- launching


def launched_world_size() -> int:
    """The number of processes the launcher started, read from the environment without any
    collective (torchrun's `WORLD_SIZE`, else MPI's); 1 for a plain `python` run."""
    for name in _WORLD_SIZE_VARS:
        if name in os.environ:
            return int(os.environ[name])
    return 1


def torchrun_command(processes: int | str, argv: Sequence[str]) -> str:
    """The torchrun command line that starts `processes` copies of the script `argv` (`sys.argv`) on one host."""
    return shlex.join(["torchrun", "--standalone", "--nproc-per-node", str(processes), *argv])


def launch_error(argv: Sequence[str]) -> str | None:
    """Why this process cannot be one rank of the run the user asked for, or None.

    accelerate's simple launcher (no GPU, no MPI) exports `ACCELERATE_USE_CPU` always and
    `MASTER_ADDR` only when `--num_processes` > 1, then runs the script once, without a world
    size. `argv` is the script's command line (`sys.argv`), quoted back in the torchrun
    command the message suggests.
    """
    if "ACCELERATE_USE_CPU" not in os.environ or "MASTER_ADDR" not in os.environ:
        return None
    if any(name in os.environ for name in _WORLD_SIZE_VARS):
        return None
    command = torchrun_command("N", argv)
    return (
        "accelerate launch started this script once although --num_processes > 1: without GPUs it starts "
        f"several processes only through MPI (--mpirun_hostfile). Run `{command}` instead (N: the number of processes)"
    )


# --------------------------------------------------------------------------- process group and mesh


@dataclass(frozen=True)
class DistributedSetup:
    """This process in the run: its place in the dp × cp grid, its local rank and its device."""

    coords: DPCPCoordinates
    local_rank: int
    device: torch.device


def init_distributed(cp_size: int | None = None, cpu: bool | None = None) -> DistributedSetup:
    """Start (or join) the process group and place this rank in the dp × cp grid.

    `cp_size=None` means every process is one CP rank (cp = world size, dp = 1). `cpu=None`
    follows `accelerate launch --cpu` (env `ACCELERATE_USE_CPU`) and falls back to CPU when
    CUDA is missing. A world of one process starts no process group (`build_dp_cp_mesh` starts a
    one-process group for its mesh). Raises `launch_error`'s reason when the launcher started fewer
    processes than asked for, and a ValueError with the torchrun command to use when the world
    is smaller than `cp_size` (e.g. `python train.py` with `cp_size=2`), before any process group.
    """
    from accelerate import PartialState

    reason = launch_error(sys.argv)
    if reason is not None:
        raise RuntimeError(reason)
    if cpu is None:
        cpu = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in _TRUE or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    world_size = int(os.environ.get("WORLD_SIZE", state.num_processes))
    if isinstance(cp_size, int) and not isinstance(cp_size, bool) and cp_size > 0:  # DPCPCoordinates names bad ones
        reason = world_size_error(world_size, cp_size, torchrun_command(cp_size, sys.argv))
        if reason is not None:
            raise ValueError(reason)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("gloo" if cpu else "nccl")
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    local_rank = int(os.environ.get("LOCAL_RANK", state.local_process_index))
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    coords = DPCPCoordinates(world_size, rank, world_size if cp_size is None else cp_size)
    return DistributedSetup(coords, local_rank, device)


# --------------------------------------------------------------------------- wrapping


def wrap_model(model: nn.Module, mesh: DPCPMesh | None, fsdp: bool = False) -> nn.Module:
    """DDP over all dp×cp ranks, or FSDP2 `fully_shard` (each decoder layer, then the root) over the `dp_cp` mesh.

    First the model gets the model patches it needs (`apply_model_patches`; a model type the
    library refuses raises NotImplementedError). Either way gradients are *averaged* over the
    dp×cp ranks. Build the optimizer after this call (FSDP2 replaces parameters with DTensors).
    Without a mesh, or with a mesh of one process, the model is returned as is (nothing to reduce).
    """
    if getattr(model, "config", None) is not None:
        apply_model_patches(model)
    if mesh is None or mesh.dp_cp.size() == 1:
        return model
    flat = mesh.dp_cp
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", model), "layers", None)
        if layers is None:
            raise ValueError(
                f"fsdp=True expects a causal LM with `model.layers` (the decoder blocks) to shard one by one; "
                f"{type(model).__name__} has none"
            )
        for layer in layers:
            fully_shard(layer, mesh=flat)
        fully_shard(model, mesh=flat)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # device_ids=None: DDP must not copy our inputs (the local batch carries the step's plan object).
    return DistributedDataParallel(model, process_group=flat.get_group())


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool):
    """Skip the gradient reduction on accumulation micro-steps (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`)."""
    if enabled:
        yield
        return
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    setter = getattr(model, "set_requires_gradient_sync", None)
    if setter is None:  # a plain module: nothing to reduce
        yield
        return
    setter(False)
    try:
        yield
    finally:
        setter(True)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The module inside a DDP wrapper (FSDP2 modules are their own modules)."""
    return getattr(model, "module", model) if type(model).__name__ == "DistributedDataParallel" else model

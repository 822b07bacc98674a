"""The process grid of custom training loops started with torchrun or `accelerate launch`: the
process group, tensor parallelism and the DDP / FSDP2 wrapping.

What we chose, and why:

- **Launcher.** On GPUs `accelerate launch --num_processes N` (torchrun underneath) or torchrun.
  On a CPU-only host accelerate 1.x starts several processes only through MPI
  (`--mpirun_hostfile`); without it `accelerate launch [--cpu] --num_processes N` runs the
  script once. `launch_error` recognises that case so a script can stop and name
  `torchrun --standalone --nproc-per-node N`, the CPU launcher, instead of training alone.
- **Process group: accelerate's `PartialState`** (`init_parallel`). It understands torchrun-style
  and MPI environments and sets the CUDA device per local rank. Where it leaves a multi-process
  run uninitialised (torchrun on a CPU-only host) we start the group ourselves (gloo on CPU,
  NCCL on CUDA).
- **Placement and meshes: `hf_blockdiag_cp.comm.ParallelDims`** (dp_replicate × dp_shard × cp ×
  tp, tp fastest then cp: with tp = 1 the rank order of accelerate's
  `ParallelismConfig(dp_shard_size=dp, cp_size=cp)`). We do **not** pass a
  `ParallelismConfig(cp_size=…)` to an `Accelerator`: its `prepare` attaches torch
  `context_parallel` hooks to the model (ring attention over one causal document per row), which
  would shard the batch a second time and let packed documents attend to each other.
- **Tensor parallelism: the model's own Transformers plan** (`apply_tensor_parallel`: its
  `tp_plan`, Transformers' DTensor styles) on the tp mesh. TP splits heads and MLP channels
  inside each rank's CP shard; attention sees its TP rank's heads and the K/V exchange runs over
  the cp mesh only.
- **Gradient reduction is the engine's job** (`wrap_model`): DDP over all dp×cp ranks, or FSDP2
  `fully_shard` over dp_shard × cp (HSDP across dp_replicate; accelerate's `dp_shard_cp`). Both
  average gradients over the dp×cp ranks, never over tp; the training loop only scales each
  rank's loss (I2).

`init_distributed` and `DistributedSetup.coords` are the deprecated dp × cp spellings of
`init_parallel` and `DistributedSetup.dims`, kept for one release.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..compat.transformers import expanded_tp_plan
from ..comm.parallel_dims import ParallelDims, ParallelMesh, _positive_int, dims_error, world_size_error
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
    """This process in the run: its place in the process grid (`dims`), its local rank and its device."""

    dims: ParallelDims
    local_rank: int
    device: torch.device

    @property
    def coords(self) -> ParallelDims:
        """Deprecated (one release): `dims`, under the name `init_distributed` gave it."""
        return self.dims

    def build_mesh(self) -> ParallelMesh:
        """`dims.build_mesh(device.type)`: the grid's named meshes (every rank calls it)."""
        return self.dims.build_mesh(self.device.type)


def init_parallel(dp_replicate: int = 1, dp_shard: int | None = None, cp: int | None = None, tp: int = 1,
                  cpu: bool | None = None) -> DistributedSetup:
    """Start (or join) the process group and place this rank in the dp_replicate × dp_shard × cp × tp grid.

    `cp=None` gives CP every rank the other dimensions leave (dp_shard then defaults to 1);
    `dp_shard=None` gives it to data parallelism once cp is set (`ParallelDims`' -1). `cpu=None`
    follows `accelerate launch --cpu` (env `ACCELERATE_USE_CPU`) and falls back to CPU when CUDA
    is missing. A world of one process starts no process group (`ParallelDims.build_mesh` starts
    a one-process group for its mesh). Raises `launch_error`'s reason when the launcher started
    fewer processes than asked for, and a ValueError naming the sizes and the torchrun command to
    use when the world cannot hold the grid (e.g. `python train.py` with `cp=2`), before any
    process group.
    """
    from accelerate import PartialState

    reason = launch_error(sys.argv)
    if reason is not None:
        raise RuntimeError(reason)
    if cpu is None:
        cpu = os.environ.get("ACCELERATE_USE_CPU", "").strip().lower() in _TRUE or not torch.cuda.is_available()
    if cp is None:
        sizes = dict(dp_replicate=dp_replicate, dp_shard=1 if dp_shard is None else dp_shard, cp=-1, tp=tp)
    else:
        sizes = dict(dp_replicate=dp_replicate, dp_shard=-1 if dp_shard is None else dp_shard, cp=cp, tp=tp)
    state = PartialState(cpu=cpu)
    world_size = int(os.environ.get("WORLD_SIZE", state.num_processes))
    # Sizes that are not integers: ParallelDims names them below; a world too small names the launch first.
    if all(isinstance(v, int) and not isinstance(v, bool) and (v > 0 or v == -1) for v in sizes.values()):
        needed = math.prod(v for v in sizes.values() if v != -1)
        reason = dims_error(world_size, sizes, torchrun_command(needed, sys.argv))
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
    return DistributedSetup(ParallelDims(**sizes, world_size=world_size, rank=rank), local_rank, device)


def init_distributed(cp_size: int | None = None, cpu: bool | None = None) -> DistributedSetup:
    """Deprecated alias (one release) of `init_parallel(cp=cp_size, cpu=cpu)`: dp × cp, `cp_size=None`
    meaning every process is one CP rank. Its errors keep their old wording (`cp_size`)."""
    if cp_size is not None:
        _positive_int("cp_size", cp_size)
        reason = world_size_error(launched_world_size(), cp_size, torchrun_command(cp_size, sys.argv))
        if reason is not None and launch_error(sys.argv) is None:  # a launch error: init_parallel raises it
            raise ValueError(reason)
    return init_parallel(cp=cp_size, cpu=cpu)


# --------------------------------------------------------------------------- tensor parallelism

# Transformers' styles that need its own (pp, fsdp, tp) mesh manager: they regroup the TP ranks.
_UNIT_STYLES = ("unit_colwise", "unit_rowwise")


def apply_tensor_parallel(model: nn.Module, tp_mesh, tp_plan: dict[str, str] | None = None) -> nn.Module:
    """Shard `model` over the 1-D `tp_mesh` with its Transformers TP plan (`model.tp_plan`: the config's
    `base_model_tp_plan` and the head's `_tp_plan`, or `tp_plan`) and Transformers' DTensor styles
    (`transformers.distributed.tensor_parallel`; tested with transformers 5.25).

    Sharded weights become DTensors on `tp_mesh`; each module's forward takes and returns plain
    tensors, so attention sees the local heads only (q, k, v `colwise`, o `rowwise`) and
    `blockdiag_cp` exchanges them over the cp mesh alone. What the plan leaves out stays
    replicated (Qwen3.5's gated delta-rule layers gather their projections' outputs, so they run
    all heads on every TP rank). Call it on every rank with identical weights (each keeps its
    slice), before FSDP2 (`wrap_model` does both).
    """
    try:
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    except ImportError as exc:
        import transformers

        raise ImportError(
            "tensor parallelism uses Transformers' DTensor styles (transformers.distributed.tensor_parallel, tested "
            f"with transformers 5.25); transformers {transformers.__version__} has none: {exc}"
        ) from exc
    plan = dict(getattr(model, "tp_plan", None) or {}) if tp_plan is None else dict(tp_plan)
    if not plan:
        raise ValueError(
            f"{type(model).__name__} has no tensor-parallel plan (config.base_model_tp_plan); pass tp_plan= or use tp=1"
        )
    unit = sorted({style for style in plan.values() if style in _UNIT_STYLES})
    if unit:
        raise NotImplementedError(
            f"the tp_plan of {type(model).__name__} uses {unit}, which regroup the TP ranks on Transformers' own mesh; "
            "expected plain styles (colwise, rowwise, ...): pass tp_plan= without them"
        )
    return apply_tensor_parallelism(model, tp_mesh, expanded_tp_plan(model, plan))


# --------------------------------------------------------------------------- wrapping


def wrap_model(model: nn.Module, mesh: ParallelMesh | None, fsdp: bool = False,
               tp_plan: dict[str, str] | None = None) -> nn.Module:
    """Tensor parallelism when the grid has tp > 1, then DDP over all dp×cp ranks, or FSDP2 `fully_shard`
    (each decoder layer, then the root) over `mesh.fsdp` (dp_shard × cp; HSDP across dp_replicate).

    First the model gets the model patches it needs (`apply_model_patches`; a model type the
    library refuses raises NotImplementedError). With tp > 1, `apply_tensor_parallel(model,
    mesh.tp, tp_plan)`, which needs `fsdp=True` when dp × cp > 1 (DDP does not reduce DTensors).
    Either way gradients are *averaged* over the dp×cp ranks. Build the optimizer after this call
    (TP and FSDP2 replace parameters with DTensors). Without a mesh, or with nothing to reduce, the
    model is returned as is.
    """
    if getattr(model, "config", None) is not None:
        apply_model_patches(model)
    if mesh is None:
        return model
    if mesh.dims.tp > 1:
        if not fsdp and mesh.dp_cp.size() > 1:
            raise ValueError(
                f"tp={mesh.dims.tp} with dp×cp={mesh.dp_cp.size()} ranks needs fsdp=True: FSDP2 reduces the TP "
                "DTensors' gradients over dp_shard × cp, DDP does not"
            )
        apply_tensor_parallel(model, mesh.tp, tp_plan)
    if mesh.dp_cp.size() == 1:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        layers = getattr(getattr(model, "model", model), "layers", None)
        if layers is None:
            raise ValueError(
                f"fsdp=True expects a causal LM with `model.layers` (the decoder blocks) to shard one by one; "
                f"{type(model).__name__} has none"
            )
        for layer in layers:
            fully_shard(layer, mesh=mesh.fsdp)
        fully_shard(model, mesh=mesh.fsdp)
        return model
    from torch.nn.parallel import DistributedDataParallel

    # device_ids=None: DDP must not copy our inputs (the local batch carries the step's plan object).
    return DistributedDataParallel(model, process_group=mesh.dp_cp.get_group())


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

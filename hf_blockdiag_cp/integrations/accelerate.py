"""DP×CP process layout for custom training loops started with `accelerate launch` (or torchrun).

What we chose, and why:

- **Process group: accelerate's `PartialState`.** It understands every launcher accelerate
  has (torchrun-style env, MPI env, `--cpu`) and sets the CUDA device per local rank. Where it
  leaves a multi-process run uninitialised (`accelerate launch --multi_gpu` or torchrun on a
  CPU-only host) we start the group ourselves (gloo on CPU, NCCL on CUDA).
- **Mesh: our own `init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))`**, CP
  fastest-varying: the rank order of accelerate's `ParallelismConfig(dp_shard_size=dp,
  cp_size=cp)` and of `hf_blockdiag_cp.data.dp_cp_coordinates`. We do **not** pass a
  `ParallelismConfig(cp_size=…)` to an `Accelerator`: its `prepare` attaches torch
  `context_parallel` hooks to the model (ring attention over one causal document per row),
  which would shard the batch a second time and let packed documents attend to each other.
  Not enabling it keeps those hooks off our model with no patching.
- **Gradient reduction is the engine's job**: DDP over all dp×cp ranks, or FSDP2
  `fully_shard` over the flattened `dp_cp` mesh (accelerate's `dp_shard_cp`). Both average
  gradients over the dp×cp ranks; the training loop only scales each rank's loss (I2).
- **`accelerate launch --cpu --num_processes N`** (accelerate 1.x, no `--mpirun_hostfile`)
  starts ONE process: accelerate's CPU launcher expects MPI to fan out. `cpu_workers_to_start`
  detects that situation and reads N from the launcher's command line; `relaunch_cpu_workers`
  then replaces the process with `torch.distributed.run --standalone` running N local gloo
  workers, so the one-line command works on a fresh machine without an accelerate config
  file or MPI.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import NoReturn, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..data.loader import dp_cp_coordinates

_TRUE = ("1", "true", "yes", "on")
_MPI_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_WORKER_FLAG = "HF_BLOCKDIAG_CP_RELAUNCHED"


# --------------------------------------------------------------------------- launching


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def requested_cpu_processes(launcher_argv: Sequence[str]) -> int | None:
    """`N` from an `accelerate launch ... --num_processes N` command line (either spelling), else None."""
    argv = list(launcher_argv)
    for i, token in enumerate(argv):
        for flag in ("--num_processes", "--num-processes"):
            if token == flag and i + 1 < len(argv):
                value = argv[i + 1]
            elif token.startswith(flag + "="):
                value = token.split("=", 1)[1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"accelerate launch {flag} must be an integer; got {value!r}") from None
    return None


def _launcher_argv() -> list[str]:
    import psutil  # an accelerate dependency

    try:
        return psutil.Process(os.getppid()).cmdline()
    except (psutil.Error, OSError):
        return []


def cpu_workers_to_start() -> int:
    """How many local workers `accelerate launch --cpu` asked for but did not start (0: nothing to do).

    accelerate's simple CPU launcher exports `ACCELERATE_USE_CPU` and, only for N > 1,
    `MASTER_ADDR`/`MASTER_PORT`, then runs the script once; MPI would set `PMI_SIZE` and co.,
    torchrun `WORLD_SIZE`. So: CPU flag + master address + no world size = a run that should
    have N processes and has one.
    """
    if os.environ.get(_WORKER_FLAG) or not _env_flag("ACCELERATE_USE_CPU") or "MASTER_ADDR" not in os.environ:
        return 0
    if "WORLD_SIZE" in os.environ or any(v in os.environ for v in _MPI_SIZE_VARS):
        return 0
    launcher = _launcher_argv()
    n = requested_cpu_processes(launcher)
    if n is None:
        raise RuntimeError(
            "accelerate launch --cpu started one process for a multi-process run (accelerate's CPU launcher needs "
            "MPI for that), and the number of processes could not be read from the launcher's command line "
            f"{launcher!r}. Run `torchrun --standalone --nproc-per-node N <script> ...` instead"
        )
    return n if n > 1 else 0


def relaunch_cpu_workers(num_processes: int, argv: Sequence[str] | None = None) -> NoReturn:
    """Replace this process by `torch.distributed.run --standalone` running this script as `num_processes` workers.

    `exec` rather than a child process: the launcher's signals (Ctrl-C, termination) then reach
    torchrun, which forwards them to the workers, and its exit code is the run's exit code.
    """
    argv = list(sys.argv if argv is None else argv)
    env = dict(os.environ, **{_WORKER_FLAG: "1", "ACCELERATE_USE_CPU": "True"})
    for key in ("MASTER_ADDR", "MASTER_PORT"):  # the standalone rendezvous picks a free port itself
        env.pop(key, None)
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={num_processes}", *argv]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)


def exit_before_launch(reason: str, workers_to_start: int) -> NoReturn:
    """End a run whose arguments cannot work, before any worker starts: `error: <reason>` on
    stderr as the last line of output, exit status 2.

    `workers_to_start > 0` means this process is the one child of `accelerate launch --cpu`
    (`cpu_workers_to_start`). That launcher prints a `CalledProcessError` traceback after any
    non-zero exit of its child, which would bury the reason; so a forked helper process waits
    until the launcher has exited and then repeats the line, which makes it the last output.
    """
    line = f"error: {reason}\n".encode()
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(2, line)
    if workers_to_start > 0:
        launcher = os.getppid()
        if os.fork() == 0:  # the helper: outlives this process and the launcher, then repeats the reason
            import psutil  # an accelerate dependency

            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # exited, or a zombie its own parent has yet to reap
                try:
                    if psutil.Process(launcher).status() == psutil.STATUS_ZOMBIE:
                        break
                except psutil.Error:
                    break
                time.sleep(0.02)
            os.write(2, line)
            os._exit(0)
    sys.exit(2)


# --------------------------------------------------------------------------- process group and mesh


@dataclass(frozen=True)
class ParallelLayout:
    """Where this process sits: world = dp × cp, CP fastest-varying (ranks of one CP group are consecutive)."""

    world_size: int
    rank: int
    local_rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cp_size: int | None = None, cpu: bool | None = None) -> ParallelLayout:
    """Start (or join) the process group and place this rank in the dp × cp layout.

    `cp_size=None` means every process is one CP rank (cp = world size, dp = 1). `cpu=None`
    follows `accelerate launch --cpu` (env `ACCELERATE_USE_CPU`) and falls back to CPU when
    CUDA is missing. A world of one process starts no process group.
    """
    from accelerate import PartialState

    if cpu is None:
        cpu = _env_flag("ACCELERATE_USE_CPU") or not torch.cuda.is_available()
    state = PartialState(cpu=cpu)
    world_size = int(os.environ.get("WORLD_SIZE", state.num_processes))
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
    cp_size = world_size if cp_size is None else cp_size
    dp_size, dp_rank, cp_rank = dp_cp_coordinates(world_size, rank, cp_size)
    return ParallelLayout(world_size, rank, local_rank, dp_size, dp_rank, cp_size, cp_rank, device)


@dataclass(frozen=True)
class DPCPMesh:
    """The 2-D `("dp", "cp")` mesh and its flattened 1-D `"dp_cp"` mesh (kept here: slicing a flattened
    dimension back out of the root mesh is deprecated in torch)."""

    mesh: object  # DeviceMesh ("dp", "cp")
    dp_cp: object  # DeviceMesh ("dp_cp",): all ranks, what DDP / FSDP2 reduce over

    @property
    def cp(self):
        return self.mesh["cp"]

    @property
    def dp(self):
        return self.mesh["dp"]


def build_dp_cp_mesh(layout: ParallelLayout) -> DPCPMesh | None:
    """`init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))` plus its flattened `"dp_cp"`; None for one process."""
    if layout.world_size == 1:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(layout.device.type, (layout.dp_size, layout.cp_size), mesh_dim_names=("dp", "cp"))
    placed = (mesh["dp"].get_local_rank(), mesh["cp"].get_local_rank())
    if placed != (layout.dp_rank, layout.cp_rank):
        raise RuntimeError(
            f"DeviceMesh placed rank {layout.rank} at (dp, cp) = {placed}; expected "
            f"{(layout.dp_rank, layout.cp_rank)} with cp fastest-varying"
        )
    return DPCPMesh(mesh, mesh["dp", "cp"]._flatten("dp_cp"))  # as accelerate does for dp_shard_cp


def cp_submesh(mesh: DPCPMesh | None):
    """The 1-D CP mesh that `make_cp_blockdiag_batch_and_ctx` takes (None without a mesh)."""
    return None if mesh is None else mesh.cp


# --------------------------------------------------------------------------- wrapping


def wrap_model(model: nn.Module, mesh: DPCPMesh | None, fsdp: bool = False) -> nn.Module:
    """DDP over all dp×cp ranks, or FSDP2 `fully_shard` (each decoder layer, then the root) over the flattened mesh.

    Either way gradients are *averaged* over the dp×cp ranks. Build the optimizer after this
    call (FSDP2 replaces parameters with DTensors). Without a mesh the model is returned as is.
    """
    if mesh is None:
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

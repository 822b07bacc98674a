"""torch internals that have no public equivalent (checked with torch 2.11 and 2.13,
`tests/unit/test_compat.py`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

TESTED = "torch 2.11 to 2.13"


def forbid_in_graph(fn: Callable) -> Callable:
    """`fn` that dynamo refuses to trace (an error, not a graph break): `torch._dynamo.forbid_in_graph`."""
    return torch._dynamo.forbid_in_graph(fn)


_WRAPPED = "_checkpoint_wrapped_module"  # checkpoint_wrapper's attribute, so also a part of module names


def checkpoint_wrapped_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a `checkpoint_wrapper` (torch.distributed.algorithms) wraps, or None for any other module."""
    return getattr(module, _WRAPPED, None)


def unwrapped_name(name: str) -> str:
    """A `named_modules()` name without the checkpoint wrappers' parts (`layers.0.self_attn`)."""
    return name.replace(f".{_WRAPPED}", "").replace(_WRAPPED, "").strip(".")


def compiled_module(module: torch.nn.Module) -> torch.nn.Module | None:
    """The module a `torch.compile` wrapper (`OptimizedModule`) runs, or None for any other module."""
    return getattr(module, "_orig_mod", None)


def compile_counters() -> dict[str, int]:
    """Dynamo's running totals (frames compiled, graphs compiled), `torch._dynamo.utils.counters`: the
    difference over a call says how much compiling that call did (`TORCH_LOGS=recompiles` says why)."""
    from torch._dynamo.utils import counters

    return {"frames_compiled": int(counters["frames"]["ok"]), "graphs_compiled": int(counters["stats"]["unique_graphs"])}


def tensor_version(tensor: torch.Tensor) -> int:
    """`tensor._version`: autograd's counter of in-place writes to the tensor's data (a changed value
    says the tensor was written since it was read)."""
    return int(tensor._version)


def cuda_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about `cycles` GPU clock cycles: `torch.cuda._sleep`."""
    torch.cuda._sleep(cycles)


def flatten_mesh(mesh, name: str):
    """`mesh`'s dimensions as one dimension `name` of the same root mesh: `DeviceMesh._flatten` (slicing a
    flattened name off the root instead is deprecated)."""
    return mesh._flatten(name)


def unflatten_mesh(mesh, dim: int, sizes: tuple[int, ...], names: tuple[str, ...]):
    """Dimension `dim` of `mesh` split into `sizes` named `names`, on the same root: `DeviceMesh._unflatten`."""
    return mesh._unflatten(dim, sizes, names)


def compile_available(device: torch.device) -> bool:
    """Whether torch.compile's default backend can build kernels for `device`: dynamo supported here
    (`torch._dynamo.is_dynamo_supported`) and, on CUDA, Triton importable (`torch.utils._triton.has_triton`)."""
    if not torch._dynamo.is_dynamo_supported():
        return False
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        return has_triton()
    return True

"""flash-linear-attention (fla) for the mixer kernels: whether it can run on a device, and the check
every fla record makes (the call's compute capability, dtype, head dims and states in the set it was
verified on, tests/gpu/test_mixer_kernels_gpu.py; docs/models.md, "Kernels")."""

from __future__ import annotations

import functools
import importlib.util

import torch

from .registry import MixerDims


@functools.cache
def fla_backend_reason(device_index: int) -> str | None:
    """Why fla's gated delta rule cannot run forward and backward on this CUDA device, or None: fla
    installed, and on Hopper its TileLang backend usable (its Triton backward refuses itself with the
    Triton releases torch 2.11 pins; docs/gpu.md)."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla) is not installed (pip install 'hf_blockdiag_cp[fla]')"
    major = torch.cuda.get_device_capability(device_index)[0]
    if major == 9:
        from fla.backends import TileLangBackend
        from fla.utils import TRITON_ABOVE_3_7_1

        if not TRITON_ABOVE_3_7_1 and not TileLangBackend.can_use():
            return ("fla's gated backward on Hopper needs Triton >= 3.7.1 or its TileLang backend (pip install tilelang, "
                    "and nvcc found through CUDA_HOME or PATH); docs/gpu.md")
    return None


def fla_device(device: torch.device) -> tuple[str | None, int]:
    """(Why fla's kernels cannot run on `device`, or None; its compute capability major, 0 off CUDA)."""
    if device.type != "cuda":
        return f"flash-linear-attention needs a CUDA device; got {device.type}", 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return fla_backend_reason(index), torch.cuda.get_device_capability(index)[0]


def fla_unverified_reason(what: str, verified: frozenset, device: torch.device, dtype: torch.dtype, dims: MixerDims,
                          head_dims: bool = True, states: bool = True) -> str | None:
    """Every fla record's check: why `what` cannot run the call (fla unusable on `device`, or the call's
    (compute capability major, dtype[, (Dk, Dv)][, with states]) not in `verified`), or None."""
    reason, major = fla_device(device)
    if reason is not None:
        return reason
    key = (major, dtype) + (((dims.key_dim, dims.value_dim),) if head_dims else ()) + ((dims.states,) if states else ())
    if key in verified:
        return None
    listed = ", ".join(sorted(_describe(k) for k in verified)) or "nowhere yet"
    return f"{what} was not verified for {_describe(key)} (verified: {listed})"


def _describe(key: tuple) -> str:
    major, dtype, *rest = key
    text = f"compute capability {major}.x, {str(dtype).removeprefix('torch.')}"
    if rest and isinstance(rest[0], tuple):
        text += f", head dims {rest[0][0]}x{rest[0][1]}"
        rest = rest[1:]
    return text + (" with initial and final states" if rest and rest[0] else "")



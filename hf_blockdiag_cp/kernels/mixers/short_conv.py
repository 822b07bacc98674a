"""Kernels of the short depthwise causal convolution over the runs of a `RunTable` (`registry`):
out[t] = act(bias + sum_j weight[:, W-1-j] · x[t-j]) over the j <= t's offset in its run, as
Transformers' `causal_conv1d_fn` computes it on each document alone.

- `torch`: W shifted, masked products over the whole table at once, accumulated in fp32 (or wider)
  whatever the input dtype, so bf16 rounds once, at the end, like the stock convolution.
- `fla`: flash-linear-attention's Triton `causal_conv1d` with `cu_seqlens`, where verified
  (`FLA_CONV_VERIFIED`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .fla import fla_unverified_reason
from .registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere

# Where fla's convolution was checked forward and backward against a float64 reference
# (tests/gpu/test_mixer_kernels_gpu.py): (compute capability major, dtype).
FLA_CONV_VERIFIED: frozenset[tuple[int, torch.dtype]] = frozenset({(9, torch.bfloat16)})


def run_offsets(table: RunTable) -> torch.Tensor:
    """`[T]` each row's position inside its run, on the table's device (cached per table)."""
    def build():
        runs = table.runs
        offsets = torch.arange(runs.num_rows) - torch.repeat_interleave(runs.boundaries[:-1], runs.lengths)
        return offsets.to(table.cu_seqlens.device)

    return table.cached("run_offsets", build)


def torch_short_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, table: RunTable) -> torch.Tensor:
    """`x [T, C]` convolved with `weight [C, W]` per run of `table`."""
    length, kernel, offsets = x.shape[0], weight.shape[-1], run_offsets(table)
    compute = torch.promote_types(weight.dtype, torch.float32)
    xs, weight = F.pad(x.to(compute), (0, 0, kernel - 1, 0)), weight.to(compute)
    out = xs.new_zeros(length, xs.shape[1]) if bias is None else bias.to(compute).expand(length, -1).clone()
    for j in range(kernel):
        shifted = xs[kernel - 1 - j : kernel - 1 - j + length]
        keep = (offsets >= j).to(compute)[:, None]
        out = out + shifted * keep * weight[:, kernel - 1 - j]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "short_conv", torch_short_conv, runs_anywhere, auto_priority=10))


def fla_conv_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return fla_unverified_reason("the fla convolution", FLA_CONV_VERIFIED, device, dtype, dims, head_dims=False, states=False)


def fla_short_conv(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, table: RunTable) -> torch.Tensor:
    """fla's varlen causal convolution of `x [T, C]` over the runs of `table`."""
    from fla.modules.causal_conv1d import causal_conv1d

    out, _ = causal_conv1d(x[None], weight=weight, bias=bias, activation=activation, cu_seqlens=table.cu_seqlens,
                           cu_seqlens_cpu=table.runs.boundaries)
    return out[0]


FLA = register_mixer_kernel(MixerKernelRecord("fla", "short_conv", fla_short_conv, fla_conv_check, auto_priority=0))

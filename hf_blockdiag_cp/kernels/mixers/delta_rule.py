"""Kernels of the chunked gated delta rule over the runs of a `RunTable` (`registry`).

- `torch`: Transformers' own `torch_chunk_gated_delta_rule` of the model's family (passed in as
  `torch_rule`, so the stock model and ours compute alike), exact in fp32 and the reference, its
  runs batched by length (`buckets.run_in_buckets`).
- `fla`: flash-linear-attention's varlen `chunk_gated_delta_rule` (`cu_seqlens`, one state per run),
  where verified (`FLA_VERIFIED`).
"""

from __future__ import annotations

import torch

from .buckets import run_in_buckets
from .fla import fla_unverified_reason
from .registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere

# Where the fla delta rule was checked forward and backward against an fp32 reference
# (tests/gpu/test_mixer_kernels_gpu.py): (compute capability major, dtype, (Dk, Dv), with states).
# One H200, fla 0.6.0 with TileLang 0.1.15; results in docs/models.md ("Kernels").
FLA_VERIFIED: frozenset[tuple[int, torch.dtype, tuple[int, int], bool]] = frozenset({
    (9, torch.bfloat16, (128, 128), False),
    (9, torch.bfloat16, (128, 128), True),
})


# --------------------------------------------------------------------------- torch


def torch_delta_rule(q, k, v, g, beta, table: RunTable, initial_state=None, output_final_state=False, torch_rule=None):
    """Transformers' torch rule over every document run of `table`, batched by `run_in_buckets`."""
    if torch_rule is None:
        raise ValueError("the torch gated delta rule needs the model family's torch_chunk_gated_delta_rule (torch_rule=)")
    ratio = v.shape[1] // q.shape[1]
    if ratio > 1:  # each key head serves `ratio` consecutive value heads; older Transformers' rule expects them repeated
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)

    def run(batch, state):
        qb, kb, vb, gb, betab = batch
        return torch_rule(qb, kb, vb, g=gb, beta=betab, initial_state=state, output_final_state=output_final_state,
                          use_qk_l2norm_in_kernel=True)

    return run_in_buckets(table, (q, k, v, g, beta), run, v, v.dtype, (v.shape[1], q.shape[2], v.shape[2]),
                          initial_state, output_final_state)


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "gated_delta_rule", torch_delta_rule, runs_anywhere, auto_priority=10))


# --------------------------------------------------------------------------- flash-linear-attention


def fla_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return fla_unverified_reason("the fla delta rule", FLA_VERIFIED, device, dtype, dims)


def fla_delta_rule(q, k, v, g, beta, table: RunTable, initial_state=None, output_final_state=False, torch_rule=None):
    """fla's varlen chunked gated delta rule over every run of `table` (one state per run)."""
    del torch_rule
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, final = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, cu_seqlens=table.cu_seqlens,
        cu_seqlens_cpu=table.runs.boundaries,
    )
    return table.only_documents(out[0], final)


FLA = register_mixer_kernel(MixerKernelRecord("fla", "gated_delta_rule", fla_delta_rule, fla_check, auto_priority=0))

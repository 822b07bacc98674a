"""Kernels of KDA, Kimi Delta Attention (Kimi Linear, Bailing-Hybrid), over the runs of a `RunTable`
(`mixer_registry`, op `kda`): the gated delta rule with a log-decay per key channel, g `[T, H, Dk]`.
A kernel has the signature of a `gated_delta_rule` kernel; its state is `[H, Dk, Dv]` and the decay
acts on the key axis, so state passing's transition pass (`mixers.state_passing`) serves it as is.

- `torch`: the torch delta-rule kernel of `delta_rule` (buckets of similar runs, one gather in and
  one out: cost linear in the number of runs) running the family's own
  `chunk_kimi_delta_attention` (Transformers' torch fallback of fla's `chunk_kda`, passed in as
  `torch_rule`), restarted at every run; exact in fp32 and the reference.
- `fla`: flash-linear-attention's varlen `chunk_kda` (`cu_seqlens`, one state per run), refused
  wherever it was not verified on a GPU (`FLA_KDA_VERIFIED`).
"""

from __future__ import annotations

import torch

from .delta_rule import torch_delta_rule
from .fla import fla_unverified_reason
from .registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere

# Where fla's chunk_kda was checked forward and backward against the torch rule in fp32
# (tests/gpu/test_mixer_kernels_gpu.py): (compute capability major, dtype, (Dk, Dv), with states),
# as `delta_rule.FLA_VERIFIED`. One H200, fla 0.6.0 with TileLang 0.1.15; docs/models.md (KDA).
FLA_KDA_VERIFIED: frozenset[tuple[int, torch.dtype, tuple[int, int], bool]] = frozenset({
    (9, torch.bfloat16, (128, 128), False),
    (9, torch.bfloat16, (128, 128), True),
})

TORCH = register_mixer_kernel(MixerKernelRecord("torch", "kda", torch_delta_rule, runs_anywhere, auto_priority=10))


def fla_kda_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return fla_unverified_reason("fla's chunk_kda", FLA_KDA_VERIFIED, device, dtype, dims)


def fla_kda(q, k, v, g, beta, table: RunTable, initial_state=None, output_final_state=False, torch_rule=None):
    """fla's varlen chunk_kda over every run of `table` (one state per run); padding runs' outputs zero."""
    del torch_rule
    from fla.ops.kda import chunk_kda

    out, final = chunk_kda(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=True, cu_seqlens=table.cu_seqlens,
    )
    return table.only_documents(out[0], final)


FLA = register_mixer_kernel(MixerKernelRecord("fla", "kda", fla_kda, fla_kda_check, auto_priority=0))

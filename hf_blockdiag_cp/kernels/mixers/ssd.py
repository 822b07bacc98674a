"""Kernels of Mamba2's chunked SSD scan over the runs of a `RunTable` (`registry`).

Per head h: S_t = exp(dt_t·A_h)·S_{t-1} + dt_t·x_t ⊗ B_t and y_t = S_t·C_t + D_h·x_t, the state
zero at every run's first row. Every kernel takes `dt` already through the layer's bias,
softplus and clamp, so that a zero row (dt = 0, x = 0) leaves the state unchanged.

- `torch`: Transformers' own `mamba2_chunk_scan` of the model's family (passed in as
  `torch_scan`, so the stock model and ours compute alike), batched as the torch delta rule
  batches its runs (`buckets.run_in_buckets`: one gather in, one gather out, runs of similar
  length in one call, zero rows at each run's end), so the cost grows linearly with the runs.
- `fla`: the same scan as flash-linear-attention's varlen `chunk_gla`, its log-decay per key channel
  set to SSD's one per head and row, taken where it was verified on a GPU (`FLA_SSD_VERIFIED`).
  `chunk_simple_gla` takes a scalar decay as is, but on Hopper fla 0.6.0 raises in its backward with
  a per-row decay under Triton 3.4 to 3.7.0, and its TileLang path refuses the fp32 states it keeps;
  GLA's backward has its own kernels (docs/models.md, "Kernels").
"""

from __future__ import annotations

import torch

from .buckets import run_in_buckets
from .fla import fla_unverified_reason
from .registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere


def torch_ssd_scan(x, dt, A, B, C, D, table: RunTable, initial_state=None, output_final_state=False,
                   torch_scan=None, chunk_size: int = 256):
    """`x [T, H, P]`, `dt [T, H]` (after bias, softplus, clamp), `A [H]`, `B`, `C [T, G, N]`, `D [H]`
    -> (`y [T, H, P]` fp32 as the torch scan returns it, final states `[n, H, P, N]` fp32 or None): the
    family's torch scan per run."""
    if torch_scan is None:
        raise ValueError("the torch SSD scan needs the model family's mamba2_chunk_scan (torch_scan=)")

    def run(batch, state):
        xb, dtb, Bb, Cb = batch
        result = torch_scan(xb, dtb, A, Bb, Cb, chunk_size=chunk_size, D=D, initial_states=state,
                            return_final_states=output_final_state)
        return result if output_final_state else (result, None)

    return run_in_buckets(table, (x, dt, B, C), run, x, torch.float32, (x.shape[1], x.shape[2], B.shape[2]),
                          initial_state, output_final_state, touch=(A, D))


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "ssd_scan", torch_ssd_scan, runs_anywhere, auto_priority=10))


# --------------------------------------------------------------------------- flash-linear-attention

# Where fla's chunk_gla, fed as `fla_ssd_scan` feeds it, was checked forward and backward (final
# states included) against the torch scan in fp32 (tests/gpu/test_mixer_kernels_gpu.py): (compute
# capability major, dtype, (state N, head dim P)); docs/models.md, "Kernels".
FLA_SSD_VERIFIED: frozenset[tuple[int, torch.dtype, tuple[int, int]]] = frozenset({(9, torch.bfloat16, (128, 64))})


def fla_ssd_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return fla_unverified_reason("fla's chunk_gla as the SSD scan", FLA_SSD_VERIFIED, device, dtype, dims,
                                 states=False)


def fla_ssd_scan(x, dt, A, B, C, D, table: RunTable, initial_state=None, output_final_state=False,
                 torch_scan=None, chunk_size: int = 256):
    """The SSD scan over every run of `table` as fla's varlen GLA: q = C and k = B (a group's shared by
    its heads, as Transformers repeats them), v = dt·x, log-decay dt·A on every key channel, scale 1,
    state [P, N] per head (`state_v_first`, the torch scan's layout); y = o + D·x in fp32 as the torch
    scan returns it."""
    del torch_scan, chunk_size
    from fla.ops.gla import chunk_gla

    if initial_state is not None:
        raise ValueError("fla_ssd_scan: initial states per run are not supported; state passing adds them")
    per_group = x.shape[1] // B.shape[1]
    q, k = (t.repeat_interleave(per_group, dim=1) for t in (C, B))
    v = (x.float() * dt[..., None]).to(x.dtype)
    log_decay = (dt * A).float()[..., None].expand(-1, -1, q.shape[-1])
    out, final = chunk_gla(q[None], k[None], v[None], g=log_decay[None], scale=1.0,
                           output_final_state=output_final_state, state_v_first=True, cu_seqlens=table.cu_seqlens)
    y = out[0].float() + D.float()[:, None] * x.float()
    return table.only_documents(y, final.float() if final is not None else None)


FLA = register_mixer_kernel(MixerKernelRecord("fla", "ssd_scan", fla_ssd_scan, fla_ssd_check, auto_priority=5))

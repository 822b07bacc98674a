"""Kernels of Mamba1's selective scan over the runs of a `RunTable` (`registry`, op
`selective_scan`).

Per channel d and state entry n: S_t[d, n] = exp(dt_t[d]·A[d, n])·S_{t-1}[d, n] + dt_t[d]·x_t[d]·B_t[n]
and y_t[d] = Σ_n S_t[d, n]·C_t[n] + D[d]·x_t[d], the state zero at every run's first row; the
output gate (SiLU of z) is the caller's. Every kernel takes `dt` already through the layer's bias
and softplus, so that a zero row (dt = 0, x = 0) leaves the state unchanged.

- `torch`: Transformers' own `mamba_selective_scan` of the model's family (passed in as
  `torch_scan`: the stock model and ours compute alike), batched as the torch delta rule batches
  its runs (`buckets.run_in_buckets`), so the cost grows linearly with the runs. mamba-ssm's
  `selective_scan_fn` takes no document boundaries, so there is no fast record.
"""

from __future__ import annotations

import torch

from .buckets import run_in_buckets
from .registry import MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere


def torch_selective_scan(x, dt, A, B, C, D, table: RunTable, initial_state=None, output_final_state=False, torch_scan=None):
    """`x [T, Dc]`, `dt [T, Dc]` (after bias and softplus), `A [Dc, N]`, `B`, `C [T, N]`, `D [Dc]` -> (`y [T, Dc]`
    fp32, final states `[n, Dc, N]` fp32 or None): the family's torch scan per run, from zero states."""
    if torch_scan is None:
        raise ValueError("the torch selective scan needs the model family's mamba_selective_scan (torch_scan=)")
    if initial_state is not None:
        raise ValueError("the torch selective scan starts every run from a zero state; state passing adds the rest")

    def run(batch, state):
        xb, dtb, Bb, Cb = (t.transpose(1, 2) for t in batch)  # the scan takes channels first: [count, C, width]
        out, final = torch_scan(xb, dtb, A, Bb, Cb, D=D, return_last_state=True)
        return out.transpose(1, 2), final

    return run_in_buckets(table, (x, dt, B, C), run, x, torch.float32, tuple(A.shape), None, output_final_state,
                          touch=(A, D))


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "selective_scan", torch_selective_scan, runs_anywhere, auto_priority=10))

"""Kernels of MiniMax's lightning attention over the runs of a `RunTable` (`mixer_registry`, op
`lightning_attention`).

Per head h, with a constant decay λ_h = exp(-slope_h): S_t = λ_h·S_{t-1} + k_tᵀ v_t and
o_t = q_t·S_t (no normalisation), the state zero at every run's first row unless a start state is
given. The transition of a run of n rows is λ_h^n·I, which is what state passing composes.

- `torch`: a block-wise computation (the layer's `block_size` rows at a time, as Transformers'
  forward computes it): within a block (q kᵀ ⊙ decay) v, across blocks q·S carried from the blocks
  before. It carries the state's decay as a log-decay per row, -slope on the run's rows and 0 on the
  zero rows that pad each run to its bucket, so padding leaves the final state unchanged; runs are
  batched as the torch delta rule batches them (`buckets.run_in_buckets`), so the cost grows
  linearly with the runs. fp32 inside; outputs in the values' dtype.

- `fla`: flash-linear-attention's varlen `chunk_simple_gla` with a constant log-decay per head
  (`g_gamma` = -slope, which is what fla's own lightning attention passes it), scale 1, refused
  until verified on a GPU (`FLA_LIGHTNING_VERIFIED`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .buckets import run_in_buckets
from .fla import fla_unverified_reason
from .registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel, runs_anywhere


def _blocks(t: torch.Tensor, block: int) -> torch.Tensor:
    """`[N, W, H, ...]` zero-padded to whole blocks -> `[N, H, blocks, block, ...]` fp32."""
    n, width = t.shape[:2]
    pad = -width % block
    if pad:
        t = F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad))
    t = t.float().reshape((n, (width + pad) // block, block) + tuple(t.shape[2:]))
    return t.movedim(3, 1)


def block_lightning(q, k, v, slope, log_decay, state, block_size: int):
    """Lightning attention over a batch of runs, each from its start state: q, k `[N, W, H, Dk]`,
    v `[N, W, H, Dv]`, `slope [H]`, `log_decay [N, W, H]` (-slope on a run's rows, 0 on the zero rows
    after its end, which leave the state as it is), `state [N, H, Dk, Dv]` or None (zero) -> (out
    `[N, W, H, Dv]` fp32, final `[N, H, Dk, Dv]` fp32). Within a block the decay between two rows of a
    run is λ^(i-j), one `[H, b, b]` matrix for the whole batch (a zero row's q, k, v are zero)."""
    n, width, heads = q.shape[:3]
    block = min(block_size, width)
    qb, kb, vb = (_blocks(t, block) for t in (q, k, v))  # [N, H, B, b, D]
    cum = _blocks(log_decay, block).cumsum(-1)  # [N, H, B, b]: log-decay from the block's start, inclusive
    steps = torch.arange(block, device=q.device)
    gaps = (steps[:, None] - steps[None, :]).float()
    decay = torch.where(gaps >= 0, -slope.float()[:, None, None] * gaps, float("-inf")).exp()  # [H, b, b]
    out = ((qb @ kb.transpose(-1, -2)) * decay[:, None]) @ vb
    last = cum[..., -1:]
    added = (kb * (last - cum).exp()[..., None]).transpose(-1, -2) @ vb  # [N, H, B, Dk, Dv]: each block's own keys
    carry = last[..., 0].exp()  # [N, H, B]: λ^rows over each block's rows
    s = q.new_zeros((n, heads, q.shape[-1], v.shape[-1]), dtype=torch.float32) if state is None else state.float()
    starts = []
    for b in range(added.shape[2]):
        starts.append(s)
        s = carry[:, :, b, None, None] * s + added[:, :, b]
    out = out + (qb * cum.exp()[..., None]) @ torch.stack(starts, dim=2)
    out = out.movedim(1, 3).reshape(n, -1, heads, v.shape[-1])[:, :width]
    return out, s


def torch_lightning_attention(q, k, v, slope, table: RunTable, initial_state=None, output_final_state=False,
                              block_size: int = 256):
    """`q`, `k [T, H, Dk]`, `v [T, H, Dv]`, `slope [H]` (λ = exp(-slope)) -> (out `[T, H, Dv]` in v's dtype,
    zero on padding runs; final states `[n, H, Dk, Dv]` fp32, zero for padding runs, or None): every
    document run of `table` from its `initial_state [n, H, Dk, Dv]` (None: zero)."""
    slope = slope.detach()
    log_decay = (-slope.float()).expand(q.shape[0], -1)

    def run(batch, state):
        qb, kb, vb, gb = batch
        return block_lightning(qb, kb, vb, slope, gb, state, block_size)

    return run_in_buckets(table, (q, k, v, log_decay), run, v, v.dtype, (q.shape[1], q.shape[2], v.shape[2]),
                          initial_state, output_final_state)


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "lightning_attention", torch_lightning_attention, runs_anywhere,
                                                auto_priority=10))


# --------------------------------------------------------------------------- flash-linear-attention

# Where fla's chunk_simple_gla, fed as `fla_lightning_attention` feeds it, was checked forward and backward
# against the torch kernel in fp32 (tests/gpu/test_mixer_kernels_gpu.py): (compute capability major,
# dtype, (Dk, Dv), with states), as `delta_rule.FLA_VERIFIED`. One H200, fla 0.6.0, without and with
# states (docs/models.md, "Kernels").
FLA_LIGHTNING_VERIFIED: frozenset[tuple[int, torch.dtype, tuple[int, int], bool]] = frozenset({
    (9, torch.bfloat16, (128, 128), False),
    (9, torch.bfloat16, (128, 128), True),
})


def fla_lightning_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return fla_unverified_reason("fla's chunk_simple_gla as lightning attention", FLA_LIGHTNING_VERIFIED, device, dtype,
                                 dims)


def fla_lightning_attention(q, k, v, slope, table: RunTable, initial_state=None, output_final_state=False,
                            block_size: int = 256):
    """fla's varlen simple GLA over every run of `table`: g_gamma = -slope per head, scale 1, one state per
    run; padding runs' outputs and states zero."""
    del block_size
    from fla.ops.simple_gla import chunk_simple_gla

    out, final = chunk_simple_gla(q[None], k[None], v[None], g_gamma=-slope.detach().float(), scale=1.0,
                                  initial_state=initial_state, output_final_state=output_final_state,
                                  cu_seqlens=table.cu_seqlens)
    return table.only_documents(out[0], final.float() if final is not None else None)


FLA = register_mixer_kernel(MixerKernelRecord("fla", "lightning_attention", fla_lightning_attention, fla_lightning_check,
                                              auto_priority=0))

"""Kernels of the chunked gated delta rule over the runs of a `RunTable` (`mixer_registry`).

- `torch`: Transformers' own `torch_chunk_gated_delta_rule` of the model's family (passed in as
  `torch_rule`, so the stock model and ours compute alike), exact in fp32 and the reference. Runs
  of similar length go as one batch: each run lands in a bucket whose width is a power-of-two
  multiple of the rule's 64-token chunk (at most twice its length), zero-padded at its end (zero
  keys, values, rates and log-decays leave outputs and the final state unchanged). One gather builds
  every bucket and one gather puts the outputs back, so forward and backward cost grows linearly
  with the number of runs (no per-run slices, whose backward fills a pack-sized zero gradient each).
- `fla`: flash-linear-attention's varlen `chunk_gated_delta_rule` (`cu_seqlens`, one state per run),
  where verified (`FLA_VERIFIED`).
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch

from .mixer_registry import MixerDims, MixerKernelRecord, RunTable, register_mixer_kernel

CHUNK = 64  # the chunk of Transformers' torch rule and of fla's kernel

# Where the fla delta rule was checked forward and backward against an fp32 reference
# (tests/gpu/test_mixer_kernels_gpu.py): (compute capability major, dtype, (Dk, Dv), with states).
# One H200, fla 0.6.0 with TileLang 0.1.15; results in docs/models.md ("Mixer kernels").
FLA_VERIFIED: frozenset[tuple[int, torch.dtype, tuple[int, int], bool]] = frozenset({
    (9, torch.bfloat16, (128, 128), False),
    (9, torch.bfloat16, (128, 128), True),
})


# --------------------------------------------------------------------------- torch


@dataclass(frozen=True)
class BucketPlan:
    """How the torch kernel batches the document runs of a table: bucket b holds `counts[b]` runs
    padded to `widths[b]` rows; `gather [P]` takes the padded rows from [x; one zero row], `scatter [T]`
    puts every row's output back from [bucket outputs; one zero row] (padding runs read the zero row),
    `run_ids` are each bucket's runs (for their initial and final states)."""

    widths: tuple[int, ...]
    counts: tuple[int, ...]
    run_ids: tuple[torch.Tensor, ...]
    gather: torch.Tensor
    scatter: torch.Tensor


def bucket_width(length: int) -> int:
    """The padded width of a run of `length` rows: CHUNK · 2^ceil(log2(chunks))."""
    chunks = -(-length // CHUNK)
    return CHUNK * (1 << max(chunks - 1, 0).bit_length())


def plan_buckets(table: RunTable) -> BucketPlan:
    """The `BucketPlan` of `table` (host arithmetic once per table, then moved to its device)."""
    runs = table.runs
    lengths, starts = runs.lengths.tolist(), runs.boundaries[:-1].tolist()
    rows = runs.num_rows
    by_width: dict[int, list[int]] = {}
    for i, (length, is_doc) in enumerate(zip(lengths, runs.is_document.tolist())):
        if is_doc:
            by_width.setdefault(bucket_width(length), []).append(i)
    widths = tuple(sorted(by_width, reverse=True))
    gather, scatter, offset = [], torch.full((rows,), -1, dtype=torch.long), 0
    for width in widths:
        for i in by_width[width]:
            index = torch.full((width,), rows, dtype=torch.long)  # the zero row after x
            index[: lengths[i]] = torch.arange(starts[i], starts[i] + lengths[i])
            scatter[starts[i] : starts[i] + lengths[i]] = torch.arange(offset, offset + lengths[i])
            gather.append(index)
            offset += width
    scatter[scatter < 0] = offset  # padding runs: the zero row after the outputs
    device = table.cu_seqlens.device
    return BucketPlan(
        widths, tuple(len(by_width[w]) for w in widths),
        tuple(torch.tensor(by_width[w], dtype=torch.long, device=device) for w in widths),
        (torch.cat(gather) if gather else torch.zeros(0, dtype=torch.long)).to(device), scatter.to(device),
    )


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((1,) + tuple(x.shape[1:]))])


def run_in_buckets(table: RunTable, inputs, run, out_like: torch.Tensor, out_dtype: torch.dtype, state_shape: tuple,
                   initial_state=None, output_final_state: bool = False, touch=()):
    """The torch kernels' batching (`plan_buckets`): `run(batch, state) -> (out [count, width, ...], final
    [count, ...] | None)` on each bucket of `inputs` (each `[T, ...]`), the start states of its runs
    taken from `initial_state [n, ...]`. -> (outputs back in row order, `[T, *out_like.shape[1:]]` of
    `out_dtype`, zero on padding runs; final states `[n, *state_shape]` fp32, or None when not asked).
    A table of padding only gives zero outputs that still depend on every input and on `touch`, so each
    parameter gets a (zero) gradient on this rank too, as DDP and FSDP expect of every rank."""
    plan = table.cached("torch_buckets", lambda: plan_buckets(table))
    sizes = [w * n for w, n in zip(plan.widths, plan.counts)]
    parts = [_with_zero_row(t).index_select(0, plan.gather).split(sizes) for t in inputs]
    outs, finals = [], []
    for b, (width, count) in enumerate(zip(plan.widths, plan.counts)):
        batch = [p[b].reshape((count, width) + tuple(p[b].shape[1:])) for p in parts]
        out, final = run(batch, None if initial_state is None else initial_state.index_select(0, plan.run_ids[b]))
        outs.append(out.reshape((count * width,) + tuple(out.shape[2:])))
        finals.append(final)
    if outs:
        flat = torch.cat(outs).to(out_dtype)
    else:
        zero = sum(t.float().sum() for t in (*inputs, *touch) if t is not None) * 0
        flat = out_like.new_zeros((0,) + tuple(out_like.shape[1:]), dtype=out_dtype) + zero.to(out_dtype)
    out = _with_zero_row(flat).index_select(0, plan.scatter)
    if not output_final_state:
        return out, None
    final = out_like.new_zeros((table.runs.lengths.numel(),) + tuple(state_shape), dtype=torch.float32)
    if finals:
        final = final.index_put((torch.cat(plan.run_ids),), torch.cat(finals).float())
    return out, final


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


def torch_check(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    return None


TORCH = register_mixer_kernel(MixerKernelRecord("torch", "gated_delta_rule", torch_delta_rule, torch_check, auto_priority=10))


# --------------------------------------------------------------------------- flash-linear-attention


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

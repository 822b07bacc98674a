"""The torch mixer kernels' batching: runs of similar length go as one batch.

Each run lands in a bucket whose width is a power-of-two multiple of a 64-token chunk (at most
twice its length), zero-padded at its end (zero inputs leave a recurrence's outputs and final state
unchanged). One gather builds every bucket and one gather puts the outputs back, so forward and
backward cost grows linearly with the number of runs (no per-run slices, whose backward fills a
pack-sized zero gradient each). Used by the torch delta rule, KDA, SSD, selective-scan and lightning
kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .registry import RunTable

CHUNK = 64  # the chunk of Transformers' torch rules and of fla's kernels


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


def with_zero_row(x: torch.Tensor) -> torch.Tensor:
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
    parts = [with_zero_row(t).index_select(0, plan.gather).split(sizes) for t in inputs]
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
    out = with_zero_row(flat).index_select(0, plan.scatter)
    if not output_final_state:
        return out, None
    final = out_like.new_zeros((table.runs.lengths.numel(),) + tuple(state_shape), dtype=torch.float32)
    if finals:
        final = final.index_put((torch.cat(plan.run_ids),), torch.cat(finals).float())
    return out, final



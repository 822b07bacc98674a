"""One record per kernel of a recurrent token-mixer operation, and the choice among them.

The operations (`MIXER_OPS`) are what hybrid models' linear-attention layers run per document:
`gated_delta_rule` (the chunked gated delta rule of Qwen3.5 / Qwen3-Next), `kda` (Kimi Linear's
delta rule with a decay per key channel, same signature), `short_conv` (their depthwise causal
convolution), `ssd_scan` (Mamba2's chunked SSD scan), `selective_scan` (Mamba1's) and
`lightning_attention` (MiniMax's linear attention with a constant decay per head). Every kernel
of an operation runs over a `RunTable`: the runs it restarts at (documents, padding, or pieces of
documents under state passing) on the device. A kernel module builds its `MixerKernelRecord` and
registers it in its operation's `Registry`; `auto` takes, by `auto_priority`, the first whose `check` passes for the call: a fast
kernel only where it was verified on a GPU (docs/models.md, "Kernels"), the torch kernel everywhere
else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ...planning.mixer_plan import MixerRuns
from ...registry import Registry, spelling_key

MIXER_OPS = ("gated_delta_rule", "short_conv", "ssd_scan", "selective_scan", "kda", "lightning_attention")


@dataclass(frozen=True)
class MixerDims:
    """What a mixer kernel's check reads of a call: key and value head dims (0 for a convolution),
    and whether the call takes initial states and returns final states (state passing), which a
    kernel may be verified without."""

    key_dim: int = 0
    value_dim: int = 0
    states: bool = False


@dataclass(eq=False)
class RunTable:
    """`MixerRuns` on the compute device, built once per step per set of runs: `cu_seqlens [n + 1]`
    (int64), `row_is_document [rows]` and `run_is_document [n]` (bool), and a per-kernel cache of what a kernel derives from the
    runs (the torch delta rule's gather plan), so recompute and every layer reuse it."""

    runs: MixerRuns
    cu_seqlens: torch.Tensor
    row_is_document: torch.Tensor
    run_is_document: torch.Tensor
    cache: dict = field(default_factory=dict, repr=False)

    @staticmethod
    def build(runs: MixerRuns, device) -> "RunTable":
        return RunTable(runs, runs.boundaries.to(device, non_blocking=True),
                        runs.row_is_document.to(device, non_blocking=True),
                        runs.is_document.to(device, non_blocking=True))

    def only_documents(self, out: torch.Tensor, final: torch.Tensor | None):
        """A fast kernel's `(out [rows, ...], final [n, ...] | None)` with padding runs' rows and states
        zeroed, as the contract asks: a varlen kernel runs padding runs like documents."""
        out = out * self.row_is_document.view(-1, *[1] * (out.ndim - 1)).to(out.dtype)
        if final is not None:
            final = final * self.run_is_document.view(-1, *[1] * (final.ndim - 1)).to(final.dtype)
        return out, final

    @property
    def num_rows(self) -> int:
        return self.runs.num_rows

    def cached(self, key, build):
        value = self.cache.get(key)
        if value is None:
            value = self.cache[key] = build()
        return value


@dataclass(frozen=True)
class MixerKernelRecord:
    """A kernel of mixer operation `op`.

    `fn`: for `gated_delta_rule`, `fn(q [T, Hk, Dk], k, v [T, Hv, Dv], g [T, Hv], beta [T, Hv], table,
    initial_state [n, Hv, Dk, Dv] | None, output_final_state, torch_rule) -> (out [T, Hv, Dv], final
    [n, Hv, Dk, Dv] | None)`, one state per run of `table`, outputs of padding runs zero; for
    `short_conv`, `fn(x [T, C], weight [C, W], bias, activation, table) -> [T, C]`, the window
    restarted at every run; for `ssd_scan`, `fn(x [T, H, P], dt [T, H], A [H], B, C [T, G, N], D,
    table, initial_state, output_final_state, torch_scan, chunk_size) -> (y, final [n, H, P, N] | None)`;
    for `selective_scan`, the same without `chunk_size` over x, dt `[T, Dc]`, A `[Dc, N]`, B, C `[T, N]`;
    for `lightning_attention`, `fn(q [T, H, Dk], k, v [T, H, Dv], slope [H], table, initial_state
    [n, H, Dk, Dv] | None, output_final_state, block_size) -> (out [T, H, Dv], final | None)`.
    `check(device, dtype, dims)` says why it cannot run a call (None: it can): a fast kernel
    refuses wherever it was not verified. `auto_priority`: lower first; None: only when named.
    """

    name: str
    op: str
    fn: Callable
    check: Callable[[torch.device, torch.dtype, MixerDims], str | None]
    auto_priority: int | None = None


def runs_anywhere(device: torch.device, dtype: torch.dtype, dims: MixerDims) -> str | None:
    """The torch kernels' check: they run every call."""
    return None


# One registry per operation: a kernel name (torch, fla) may serve several.
_KERNELS: dict[str, Registry[MixerKernelRecord]] = {
    op: Registry("mixer_backend", f"a {op} kernel", missing="{option}={name!r} has no {kind}; available: {available}")
    for op in MIXER_OPS
}


def register_mixer_kernel(record: MixerKernelRecord) -> MixerKernelRecord:
    if record.op not in MIXER_OPS:
        raise ValueError(f"mixer kernel {record.name!r}: unknown op {record.op!r}; known: {', '.join(MIXER_OPS)}")
    return _KERNELS[record.op].register(record)


def mixer_kernel_names() -> tuple[str, ...]:
    """Every registered mixer kernel name (a name may serve several ops)."""
    return tuple(dict.fromkeys(name for kernels in _KERNELS.values() for name in kernels.names()))


def canonical_mixer_backend(spelling: str) -> str:
    """`auto` or a registered mixer kernel name (case and '-'/'_' insensitive): `CPConfig.mixer_backend`."""
    if not isinstance(spelling, str):
        raise TypeError(f"mixer_backend must be a string; got {type(spelling).__name__}")
    key = spelling_key(spelling)
    names = ("auto", *mixer_kernel_names())
    if key not in names:
        raise ValueError(f"mixer_backend={spelling!r} is not supported; accepted values: {', '.join(names)}")
    return key


def choose_mixer_kernel(op: str, requested: str, device: torch.device, dtype: torch.dtype, dims: MixerDims) -> MixerKernelRecord:
    """The kernel of `op` for one call: `requested` if it can run it, or for `auto` the first record by
    `auto_priority` that can; `UnavailableError` saying why otherwise."""
    return _KERNELS[op].choose(requested, lambda r: r.check(device, dtype, dims), what=op, where=f"on {device}")


def mixer_refusals(op: str, device: torch.device, dtype: torch.dtype, dims: MixerDims) -> dict[str, str | None]:
    """Every kernel of `op` and why it cannot run such a call (None: it can); for logs and docs."""
    return _KERNELS[op].refusals(lambda r: r.check(device, dtype, dims))

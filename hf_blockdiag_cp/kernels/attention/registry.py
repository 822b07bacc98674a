"""One record per local attention kernel, and the choice among them.

Every kernel takes this rank's queries `q [L, H, Dk]` and the keys/values it needs
`k [K, Hkv, Dk]`, `v [K, Hkv, Dv]` (in the step plan's key order; every row the exchange
returns for kernels with `takes_all_rows`) plus the step object (its `plan` on the device and
its per-step `cached` slot), and returns `[L, H, Dv]`. A kernel module builds its
`KernelRecord` and registers it; nothing else names the kernel. `auto` is the records'
preference order (`auto_priority`, lowest first) among those that can run a layer.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ...planning.kernel_cost import KernelCost
from ...registry import Registry, UnavailableError

# Attention features beyond block-causal softmax that a layer may ask for (see attention.entry).
FEATURES = ("softcap", "sinks")
HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KernelRecord:
    """A local attention kernel and what it can run.

    `check(device, dtype, head_dim_k, head_dim_v)` returns why the kernel cannot run such a
    layer (None if it can); `features` are the extras it implements; `prepare(step)`, if
    any, runs once per step on the host after the step is built (e.g. the flex block mask),
    so no attention layer builds per-step state. `auto_priority` orders `auto` (lower first;
    None: never chosen by `auto`), on the device types in `auto_devices` (None: any).
    `cost` is the kernel's calibrated cost model for balanced layouts (`calibrated_cost`; None:
    the planning default). `lse_check`, if any, says like `check` where `fn(..., return_lse=True)`
    returns `(out, lse)` with gradients through both and runs plans that are not causal
    (`RankPlan.causal`), as the split by keys needs (`kernels.attention.lse`): only where verified against
    a reference (None: nowhere).
    """

    name: str
    fn: Callable[..., torch.Tensor]
    check: Callable[[torch.device, torch.dtype, int, int], str | None]
    aliases: tuple[str, ...] = ()
    features: frozenset[str] = frozenset()
    takes_all_rows: bool = False
    prepare: Callable[[object], None] | None = field(default=None, compare=False)
    auto_priority: int | None = None
    auto_devices: frozenset[str] | None = frozenset({"cuda"})  # None: any device
    cost: KernelCost | None = None
    lse_check: Callable[[torch.device, torch.dtype, int, int], str | None] | None = None

    @property
    def returns_lse(self) -> bool:
        """Whether the kernel returns its log-sum-exp for some layers (`lse_check`)."""
        return self.lse_check is not None

    def unsupported_reason(
        self, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int, features=frozenset(),
        needs_lse: bool = False,
    ) -> str | None:
        """Why this kernel cannot run a layer with these shapes and `features` (and, with `needs_lse`,
        return its log-sum-exp), or None if it can."""
        unknown = sorted(set(features) - set(FEATURES))
        if unknown:
            raise ValueError(f"unknown attention features {unknown}; known: {', '.join(FEATURES)}")
        missing = sorted(set(features) - self.features)
        if missing:
            return f"the {self.name} kernel does not implement {' and '.join(missing)}, which this attention layer uses"
        if needs_lse and not self.returns_lse:
            return (f"the {self.name} kernel has no verified log-sum-exp output, which the split by keys "
                    "(CPConfig(overlap='keys')) merges by")
        reason = self.check(device, dtype, head_dim_k, head_dim_v)
        if reason is None and needs_lse:
            reason = self.lse_check(device, dtype, head_dim_k, head_dim_v)
        return reason


def half_precision_cuda_reason(
    what: str, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int
) -> str | None:
    """The common refusal of FlashAttention-family kernels: CUDA, fp16/bf16, equal key and value head dims."""
    if device.type != "cuda":
        return f"{what} needs a CUDA device"
    if dtype not in HALF:
        return f"{what} needs float16 or bfloat16, got {dtype}"
    if head_dim_k != head_dim_v:
        return f"{what} needs equal key and value head dims, got {head_dim_k} and {head_dim_v}"
    return None


CALIBRATION_PATH = Path(__file__).parents[1] / "calibration.json"


@functools.cache
def _calibration() -> dict:
    with open(CALIBRATION_PATH) as f:
        return json.load(f)["kernels"]


def calibrated_cost(name: str) -> KernelCost | None:
    """The committed cost constants of kernel `name` (`kernels/calibration.json`, written from
    `bench ranks --calibrate`; docs/layouts.md, "Calibration"), or None if it has none."""
    values = _calibration().get(name)
    if values is None:
        return None
    try:
        return KernelCost.from_dict(values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{CALIBRATION_PATH}: kernel {name!r}: {exc}") from None


# The one error type of every registry (`hf_blockdiag_cp.registry`), under the name scripts catch.
KernelUnavailableError = UnavailableError

KERNELS: Registry[KernelRecord] = Registry(
    "attn_backend", "an attention kernel", missing="{option}={name!r} is not available in this installation (available: {available})")


def register_kernel(record: KernelRecord) -> KernelRecord:
    """Add (or replace) a kernel record; its name and aliases become accepted `attn_backend` spellings."""
    return KERNELS.register(record)


def kernel_names() -> tuple[str, ...]:
    return KERNELS.names()


def get_kernel(name: str) -> KernelRecord:
    return KERNELS.get(name)


def canonical_kernel_name(spelling: str) -> str:
    """The canonical name (or "auto") for any accepted spelling of `attn_backend` (case and '-'/'_' insensitive)."""
    return KERNELS.canonical(spelling)


def unsupported_reason(
    name: str, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int, features=frozenset(),
    needs_lse: bool = False,
) -> str | None:
    """Why kernel `name` cannot run this attention call (with these `features`), or None if it can."""
    if name not in KERNELS:
        return f"attn_backend={name!r} is not available in this installation (available: {', '.join(KERNELS.names())})"
    return KERNELS.refusal(KERNELS.get(name), lambda r: r.unsupported_reason(device, dtype, head_dim_k, head_dim_v, features, needs_lse))


def auto_order(device: torch.device) -> list[KernelRecord]:
    """The records `auto` tries on `device`, most preferred first."""
    return KERNELS.auto_order(lambda r: r.auto_devices is None or device.type in r.auto_devices)


def choose_kernel(
    requested: str, device: torch.device, dtype: torch.dtype, head_dim_k: int, head_dim_v: int, features=frozenset(),
    needs_lse: bool = False,
) -> KernelRecord:
    """Resolve `auto` to a kernel for one layer's call (with `needs_lse`, one that `returns_lse`), or
    check an explicit choice; raise `KernelUnavailableError` saying why if it cannot run."""
    return KERNELS.choose(
        requested, lambda r: r.unsupported_reason(device, dtype, head_dim_k, head_dim_v, features, needs_lse),
        where=f"for this layer on {device}",
        keep=lambda r: r.auto_devices is None or device.type in r.auto_devices,
    )

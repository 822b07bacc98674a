"""Where a recurrent token mixer runs: `MixerContext`, from a CP step or from one packed row.

A mixer layer (a model patch's forward) asks its context for the runs it restarts at, on the device,
and for the kernel and transport the step chose. Everything a context derives is built at the first
layer that needs it and reused by every later layer and by activation-checkpoint recompute (I4, I6):
the context of a step lives in the step's cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..comm.notice import warn_once
from ..kernels.mixers.registry import MixerDims, MixerKernelRecord, RunTable, choose_mixer_kernel, mixer_refusals
from ..planning import Layout
from ..planning.mixer_plan import MixerRuns, MixerShape, choose_mixer_transport, mixer_cost_for, pack_runs
from ..step.state import MIXER_CONTEXT_KEY

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class MixerContext:
    """A mixer's group and rows: `layout` is the step's (None outside a step: one rank, rows in pack
    order, `runs` given); `backend` and `transport` as configured (`CPConfig.mixer_backend`,
    `CPConfig.mixer_transport`). `choices` records what ran, per operation, for the step's log
    (`StepChoices.mixers`)."""

    group: Any
    world_size: int
    rank: int
    layout: Layout | None
    runs: MixerRuns
    backend: str = "auto"
    transport: str = "auto"
    cache: dict = field(default_factory=dict, repr=False)
    choices: dict = field(default_factory=dict)

    @staticmethod
    def from_step(step) -> "MixerContext":
        """The context of CP step `step` (one per step, kept in its cache)."""
        def build():
            runs = pack_runs(step.layout)
            return MixerContext(step.group, step.world_size, step.rank, step.layout, runs,
                                getattr(step, "mixer_backend", "auto"), getattr(step, "mixer_transport", "auto"))

        return step.cached(MIXER_CONTEXT_KEY, build)

    @staticmethod
    def from_runs(runs: MixerRuns, backend: str = "auto") -> "MixerContext":
        """One packed row outside a CP step, its documents given (e.g. by `cu_seq_lens_q`)."""
        return MixerContext(None, 1, 0, None, runs, backend, "local")

    def cached(self, key, build):
        value = self.cache.get(key)
        if value is None:
            value = self.cache[key] = build()
        return value

    def table(self, key, runs_fn, device) -> RunTable:
        """The `RunTable` named `key` on `device`, built from `runs_fn()` once."""
        return self.cached(("table", key, str(device)), lambda: RunTable.build(runs_fn(), device))

    def kernel(self, op: str, x: torch.Tensor, dims: MixerDims) -> MixerKernelRecord:
        """The kernel of `op` for tensors like `x` (cached per op, dtype and dims)."""
        def choose():
            record = choose_mixer_kernel(op, self.backend, x.device, x.dtype, dims)
            if record.name == "torch" and self.backend == "auto" and x.device.type == "cuda":
                _warn_torch_on_gpu(op, x, dims)
            if record.name == "fla":
                warn_once(logger, ("fla autotune",), (
                    "blockdiag_cp: the first fla kernel calls autotune (Triton / TileLang) for each new shape, which "
                    "can take minutes on a fresh machine with nothing printed; later steps reuse the tuned "
                    "configurations"), level=logging.INFO)
            return record

        record = self.cached(("kernel", op, x.device.type, x.dtype, dims), choose)
        self.choices[op] = record.name
        return record

    def transport_for(self, shape: MixerShape) -> str:
        """The transport of a layer of `shape`: "local" (one rank), "heads" or "states" (`auto`: the
        cheaper at the byte rate of the group's backend, `planning.mixer_plan.mixer_cost_for`)."""
        if self.world_size == 1:
            name = "local"
        else:
            name = self.cached(("transport", shape), lambda: choose_mixer_transport(
                self.transport, self.layout, shape, mixer_cost_for(dist.get_backend(self.group))))
        self.choices["transport"] = name
        return name

    def describe(self) -> str:
        """What ran, e.g. `gated_delta_rule=fla short_conv=fla transport=states`."""
        return " ".join(f"{k}={v}" for k, v in sorted(self.choices.items()))


def _warn_torch_on_gpu(op: str, x: torch.Tensor, dims: MixerDims) -> None:
    """On a GPU `auto` fell back to the torch kernel of `op`, many times slower than a fast one: a
    WARNING names why each fast kernel was refused (once per run, rank 0; docs/gpu.md)."""
    refused = {name: reason for name, reason in mixer_refusals(op, x.device, x.dtype, dims).items()
               if name != "torch" and reason is not None}
    if refused:
        why = "; ".join(f"{name}: {reason}" for name, reason in sorted(refused.items()))
        advice = "docs/gpu.md says what to install"
    else:  # e.g. Mamba1's selective scan: no library takes document boundaries for it
        why, advice = f"no fast {op} kernel exists for packed documents", "installing a package does not change this"
    warn_once(logger, ("mixer torch on gpu", op, x.dtype, dims), (
        f"blockdiag_cp: the token mixers run the torch {op} kernel on {x.device.type} in {x.dtype} ({why}); "
        f"{advice} (warned once)"))

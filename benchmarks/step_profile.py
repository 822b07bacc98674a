"""One optimizer step under `torch.profiler`, summarised as text: where the GPU's time goes (operators by
self device time, kernels' total) and the step's host-device synchronisations (the blocking CUDA calls,
device-to-host copies, `aten::item` / `aten::_local_scalar_dense`), each blocking call traced to the
innermost Python frame outside torch that made it. Used by `stock_speed.py --profile`.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch
from torch.autograd import DeviceType
from transformers import TrainerCallback

BLOCKING = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SCALARS = ("aten::item", "aten::_local_scalar_dense")


class ProfileStep(TrainerCallback):
    """Profile optimizer step `step` (from 1) and write its summary to `path`; `summary` keeps the counts.
    Add it after the step timer: the timer's closing `torch.cuda.synchronize` falls inside (one
    cudaDeviceSynchronize of the counts), its opening one outside."""

    def __init__(self, step: int, path: str, label: str):
        self.step, self.path, self.label = step, path, label
        self.summary: dict = {}
        self._prof, self._t0 = None, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            from torch.profiler import ProfilerActivity, profile

            cuda = torch.cuda.is_available()
            self._prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                                 with_stack=True)
            self._prof.__enter__()
            self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._prof is None:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - self._t0
        self._prof.__exit__(None, None, None)
        self.summary, text = summarise(self._prof, self.label, wall)
        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        Path(self.path).write_text(text)
        self._prof = None


def outside_torch(frame: str) -> bool:
    return ".py(" in frame and not frame.startswith(("torch/", "<built-in")) and "/torch/" not in frame


def call_site(event) -> str:
    """The innermost Python frame outside torch above a profiler event: an enclosing Python-function event
    (`with_stack`) or a frame of an enclosing op's recorded stack."""
    while event is not None:
        if outside_torch(event.name):
            return event.name
        frame = next((f for f in event.stack or () if outside_torch(f)), None)
        if frame:
            return frame
        event = event.cpu_parent
    return "(no Python frame)"


def summarise(prof, label: str, wall_s: float) -> tuple[dict, str]:
    """({gpu_ms, wall_s, counts, sites}, the text): device time of every kernel, copy and set, the counts of
    BLOCKING calls, device-to-host copies and SCALARS, and the call sites of the blocking calls (of the
    scalar reads on a CPU run, which has no CUDA calls)."""
    events = prof.events()
    device = [e for e in events if e.device_type == DeviceType.CUDA]
    gpu_ms = sum(e.time_range.elapsed_us() for e in device) / 1e3
    counts = Counter(e.name for e in events if e.name in BLOCKING + SCALARS + ("cudaMemcpyAsync",))
    counts["device-to-host copies"] = sum(1 for e in device if "DtoH" in e.name or "Device -> Pageable" in e.name)
    blocking = [e for e in events if e.name in BLOCKING] or [e for e in events if e.name == "aten::_local_scalar_dense"]
    sites = Counter(call_site(e) for e in blocking)
    summary = {"gpu_ms": gpu_ms, "wall_s": wall_s, "counts": dict(counts), "sites": dict(sites.most_common(30)),
               "syncs": f"{sum(counts[n] for n in BLOCKING)} blocking, {counts['device-to-host copies']} DtoH, "
                        f"{counts['aten::item']} item"}
    sort = "self_device_time_total" if device else "self_cpu_time_total"
    table = prof.key_averages()
    lines = [f"profile of one optimizer step: {label}", f"wall {wall_s:.3f} s (profiler on), GPU time of kernels, "
             f"copies and sets {gpu_ms:.1f} ms", "",
             "host-device synchronisations in the step (the step timer's closing synchronize included):",
             *(f"  {counts.get(name, 0):6d}  {name}" for name in (*BLOCKING, "cudaMemcpyAsync", "device-to-host copies",
                                                              *SCALARS)),
             "", f"where the {'blocking calls' if device else 'scalar reads'} come from (innermost frame outside "
             "torch):",
             *(f"  {n:6d}  {site}" for site, n in sites.most_common(30)), "",
             f"operators by {sort}:", table.table(sort_by=sort, row_limit=40), "",
             "operators by self_cpu_time_total (host overhead):",
             table.table(sort_by="self_cpu_time_total", row_limit=25)]
    return summary, "\n".join(lines) + "\n"

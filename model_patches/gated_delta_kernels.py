"""Per-document kernels of the gated delta-rule layers, and the documents they run over.

Two token mixers in each layer must restart at every document of a pack: the short causal
depthwise convolution (no tokens of the previous document in its window) and the chunked
gated delta rule (zero recurrent state at every document start).

- torch (CPU and reference, exact in fp32): the convolution as K shifted, masked products
  (vectorised over the pack); the delta rule as Transformers' own
  `torch_chunk_gated_delta_rule` (the un-wrapped torch function of the model's modeling
  module) run on each document.
- flash-linear-attention (`fla`): `chunk_gated_delta_rule` and `causal_conv1d` with
  `cu_seqlens`. Refused until verified on a GPU (`FLA_VERIFIED` is empty): `fla_refusal`
  always names the reason, and the torch path runs. docs/models.md says what is pending.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

# (device type, compute capability major) pairs where the fla path was checked fwd+bwd against
# the torch path. Empty: not verified anywhere yet.
FLA_VERIFIED: frozenset[tuple[str, int]] = frozenset()


@dataclass(frozen=True)
class PackDocs:
    """The segments of a pack as the per-document kernels see them, and how rows map to it.

    `segments` are (start, stop, is_document) in pack order; padding runs are segments whose
    output is zero. `offsets[t]` is row t's position inside its segment (the convolution's
    mask); `cu_seqlens` the segment offsets for varlen kernels. Under CP, `to_pack` turns the
    head-parallel rows (slot order) into pack order and `to_slots` back (None: identity).
    """

    length: int
    segments: tuple[tuple[int, int, bool], ...]
    offsets: torch.Tensor  # [S] int64, on the compute device
    cu_seqlens: torch.Tensor  # [n + 1] int64, on the compute device
    to_pack: torch.Tensor | None = None
    to_slots: torch.Tensor | None = None


def pack_docs(boundaries: torch.Tensor, is_document: list[bool], device, to_pack=None, to_slots=None) -> PackDocs:
    """`PackDocs` from segment offsets `[n + 1]` (host) and whether each segment is a document."""
    bounds = [int(b) for b in boundaries.tolist()]
    if len(is_document) != len(bounds) - 1:
        raise ValueError(f"pack_docs: {len(bounds) - 1} segments but {len(is_document)} document flags")
    length = bounds[-1]
    starts = torch.as_tensor(bounds[:-1], dtype=torch.int64)
    sizes = torch.as_tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int64)
    offsets = torch.arange(length, dtype=torch.int64) - torch.repeat_interleave(starts, sizes)
    segments = tuple((a, b, bool(d)) for a, b, d in zip(bounds[:-1], bounds[1:], is_document))
    cu = torch.as_tensor(bounds, dtype=torch.int64)
    return PackDocs(length, segments, offsets.to(device), cu.to(device), to_pack, to_slots)


def docs_from_layout(layout, device) -> PackDocs:
    """The padded pack of a CP step's layout: documents and padding runs, and the slot <-> pack maps."""
    bounds = layout.segments.boundaries
    is_document = (layout.document_ids[bounds[:-1]] > 0).tolist()
    slots = layout.slot_positions.reshape(-1)
    if torch.equal(slots, torch.arange(slots.numel())):
        return pack_docs(bounds, is_document, device)
    return pack_docs(bounds, is_document, device, layout.slot_of_position.to(device), slots.to(device))


def docs_from_cu_seqlens(cu_seqlens: torch.Tensor, length: int, device) -> PackDocs:
    """Documents given by Transformers' `cu_seq_lens_q` of a packed row of `length` tokens (no CP step)."""
    bounds = cu_seqlens.detach().reshape(-1).to("cpu", torch.int64)
    if bounds.numel() < 2 or int(bounds[0]) != 0 or int(bounds[-1]) != length or bool((bounds.diff() <= 0).any()):
        raise ValueError(
            f"cu_seq_lens_q must be increasing offsets from 0 to the row length {length}; got {bounds.tolist()[:8]}"
        )
    return pack_docs(bounds, [True] * (bounds.numel() - 1), device)


# --------------------------------------------------------------------------- torch kernels


def causal_conv_per_doc(x: torch.Tensor, weight: torch.Tensor, bias, activation: str | None, docs: PackDocs) -> torch.Tensor:
    """Depthwise causal convolution of `x [S, C]` with `weight [C, K]`, restarted at every segment:
    out[t] = act(bias + sum_j weight[:, K-1-j] * x[t-j] for j <= offset of t in its segment), as
    Transformers' `causal_conv1d_fn` computes it on each document alone. Accumulates in fp32 (or
    wider) whatever the input dtype, so bf16 rounds once, at the end."""
    length, kernel, offsets = x.shape[0], weight.shape[-1], docs.offsets
    compute = torch.promote_types(weight.dtype, torch.float32)
    xs, weight = F.pad(x.to(compute), (0, 0, kernel - 1, 0)), weight.to(compute)
    out = xs.new_zeros(length, xs.shape[1]) if bias is None else bias.to(compute).expand(length, -1).clone()
    for j in range(kernel):
        shifted = xs[kernel - 1 - j : kernel - 1 - j + length]
        keep = (offsets >= j).to(compute)[:, None]
        out = out + shifted * keep * weight[:, kernel - 1 - j]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


def length_groups(spans: list[tuple[int, int]], budget: int) -> list[list[tuple[int, int]]]:
    """Documents `(start, stop)`, longest first, in groups that hold at most `budget` rows once
    padded to their longest document (a document longer than `budget` forms a group alone)."""
    groups: list[list[tuple[int, int]]] = []
    for span in sorted(spans, key=lambda s: s[0] - s[1]):  # longest first; stable among equals
        group = groups[-1] if groups else None
        if group is None or (len(group) + 1) * (group[0][1] - group[0][0]) > budget:
            groups.append([span])
        else:
            group.append(span)
    return groups


def _padded_batch(x: torch.Tensor, group: list[tuple[int, int]]) -> torch.Tensor:
    """Rows `[start, stop)` of `x [S, ...]` per document, zero-padded at the end to the group's longest."""
    width = group[0][1] - group[0][0]
    return torch.stack([F.pad(x[a:b], (0, 0) * (x.dim() - 1) + (0, width - (b - a))) for a, b in group])


def delta_rule_per_doc(rule: Callable, q, k, v, g, beta, docs: PackDocs) -> torch.Tensor:
    """`rule` (Transformers' torch chunked gated delta rule) on each document of the pack from a
    zero state; q, k `[S, Hk, Dk]`, v `[S, Hv, Dv]`, g, beta `[S, Hv]`. Padding rows get zeros.

    Documents of similar length run as one batch, each row zero-padded at its end (zero keys,
    values, gates and decay leave a row's state and earlier outputs unchanged), so the rule's
    Python loop over 64-token chunks runs once per group instead of once per document."""
    ratio = v.shape[1] // q.shape[1]
    if ratio > 1:  # each key head serves `ratio` consecutive value heads; older Transformers' rule expects them repeated
        q, k = q.repeat_interleave(ratio, dim=1), k.repeat_interleave(ratio, dim=1)
    spans = [(a, b) for a, b, is_document in docs.segments if is_document]
    rows, outs = [], []
    for group in length_groups(spans, budget=q.shape[0]):
        out, _ = rule(
            _padded_batch(q, group), _padded_batch(k, group), _padded_batch(v, group), g=_padded_batch(g, group),
            beta=_padded_batch(beta, group), initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
        )
        outs += [out[i, : b - a] for i, (a, b) in enumerate(group)]
        rows += [range(a, b) for a, b in group]
    for a, b, is_document in docs.segments:
        if not is_document:
            outs.append(v.new_zeros((b - a,) + tuple(v.shape[1:])))
            rows.append(range(a, b))
    order = torch.tensor([r for span in rows for r in span], dtype=torch.int64)
    to_pack = torch.empty_like(order)
    to_pack[order] = torch.arange(order.numel())
    return torch.cat(outs).index_select(0, to_pack.to(v.device))


@contextlib.contextmanager
def stock_torch_kernels(model: torch.nn.Module):
    """Run the stock (unpatched) model's gated delta-rule layers on Transformers' own torch
    convolution and chunked delta rule even where flash-linear-attention or causal-conv1d is
    installed (Transformers swaps those in at import): a stock baseline or reference then uses
    the same kernels as the patch's torch path, and fla's backward (which refuses itself on some
    GPU images, docs/models.md) is never called. No-op for a model without such layers."""
    modules = {sys.modules[type(m).__module__] for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")}
    names = ("torch_chunk_gated_delta_rule", "causal_conv1d_fn")
    saved = [(mod, name, getattr(mod, name)) for mod in modules for name in names if hasattr(mod, name)]
    for mod, name, fn in saved:
        setattr(mod, name, inspect.unwrap(fn))
    try:
        yield
    finally:
        for mod, name, fn in saved:
            setattr(mod, name, fn)


# --------------------------------------------------------------------------- flash-linear-attention


def fla_refusal(x: torch.Tensor) -> str | None:
    """Why the fla kernels are not used for tensors like `x`; None if they are."""
    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (fla) is not installed"
    if x.device.type != "cuda":
        return f"flash-linear-attention needs CUDA tensors; got {x.device.type}"
    major = torch.cuda.get_device_capability(x.device)[0]
    if ("cuda", major) not in FLA_VERIFIED:
        return f"flash-linear-attention was not verified on this GPU (compute capability {major}.x) yet"
    return None


def fla_conv(x, weight, bias, activation, docs: PackDocs) -> torch.Tensor:
    from fla.modules.convolution import causal_conv1d

    out, _ = causal_conv1d(x[None], weight=weight, bias=bias, activation=activation, cu_seqlens=docs.cu_seqlens)
    return out[0]


def fla_delta_rule(q, k, v, g, beta, docs: PackDocs) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    out, _ = chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], use_qk_l2norm_in_kernel=True, cu_seqlens=docs.cu_seqlens,
    )
    return out[0]

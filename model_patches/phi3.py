"""Phi-3 LongRoPE (and any dynamic RoPE): choose the RoPE frequencies from the global pack.

Why: Transformers' `dynamic_rope_update` picks the rotary frequencies at every forward from
`max(position_ids)`: LongRoPE switches from the short to the long factors once
`max(position_ids) + 1` exceeds `original_max_position_embeddings`, dynamic NTK rescales
with it. Under CP each rank sees only its shard's position ids, so ranks would disagree, and
a rank holding only the start of a long document would rotate it with the short factors
while its other half uses the long ones. The patch makes every rank use the maximum over the
whole pack (one MAX all-reduce per step, cached), i.e. exactly what a non-CP run of the
same packed batch computes; outside a CP step the rotary embedding is untouched.

Note the stock semantics this reproduces: in a packed batch the choice is made once for the
pack (the longest document decides), not per document.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from hf_blockdiag_cp.comm.consensus import collective_device
from hf_blockdiag_cp.step.state import CPStep, active_step

from .registry import ModelPatch, bind_forward, register_patch


def _rope_types(config) -> list[str]:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_type" in params:
        return [params["rope_type"]]
    return [p.get("rope_type", "default") for p in params.values() if isinstance(p, dict)]  # per layer type


def needs_global_rope(config) -> bool:
    return any(t == "longrope" or "dynamic" in t for t in _rope_types(config))


def global_max_position(step: CPStep, position_ids: torch.Tensor) -> int:
    """max(position_ids) over the whole pack: this shard's maximum, all-reduced once per step."""

    def build() -> int:
        local = position_ids.detach().max().reshape(1).to(torch.int64)
        if step.group is None:
            return int(local)
        local = local.to(collective_device(step.group))
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=step.group)
        return int(local)

    return step.cached(("global_max_position",), build)


@torch.compiler.disable  # eager under torch.compile: the pack's maximum position is a per-step number
def _global_rope_forward(self, x, position_ids, *args, **kwargs):
    decorated = type(self).forward  # wrapped by dynamic_rope_update: updates inv_freq from max(position_ids)
    step = active_step()
    if step is None:
        return decorated(self, x, position_ids, *args, **kwargs)
    top = global_max_position(step, position_ids)
    probe = torch.full((1, 1), top, dtype=position_ids.dtype, device=position_ids.device)
    decorated(self, x, probe, *args, **kwargs)  # only for its frequency update, from the global maximum
    # The body alone: every wrapper off, since transformers < 5.18 puts torch.no_grad() around
    # dynamic_rope_update, whose update must not run again on this shard's positions.
    with torch.no_grad():
        return inspect.unwrap(decorated)(self, x, position_ids, *args, **kwargs)


def apply(model: torch.nn.Module) -> None:
    patched = 0
    for module in model.modules():
        rope_type = getattr(module, "rope_type", None)
        forward = getattr(type(module), "forward", None)
        if rope_type is None or not hasattr(forward, "__wrapped__"):
            continue
        kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
        if any(k == "longrope" or "dynamic" in k for k in kinds):
            bind_forward(module, _global_rope_forward)
            patched += 1
    if patched == 0:
        raise RuntimeError(
            f"model_patches.phi3: {type(model).__name__} has a dynamic RoPE in its config but no rotary embedding "
            "module decorated with transformers' dynamic_rope_update was found to patch"
        )


PATCH = register_patch(
    ModelPatch(
        name="global_rope",
        model_types=("phi3", "phimoe"),
        needed=needs_global_rope,
        apply=apply,
        why="dynamic / LongRoPE frequencies depend on max(position_ids), which must be the global pack's",
        any_model_type=True,
    )
)

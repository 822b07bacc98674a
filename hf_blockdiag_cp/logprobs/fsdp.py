"""Losses built on tensors computed inside a model's forward, under FSDP2.

FSDP2 drives a unit's parameters through the hooks of its forward and through hooks on the tensors
that forward returns: it all-gathers the parameters before the forward (and may free them after
it), all-gathers them again when the gradient reaches a returned tensor (its pre-backward), and
queues there the callback that reduce-scatters the gradients at the end of the backward. The
log-prob head's outputs, and a reward model's per-token scores, are taken inside the forward and
reach no tensor the model returns: the head's backward would read a weight freed after the forward,
and where no unit's output lies on the loss's path (the whole model one unit) the gradients would
stay unreduced on each rank.

So a loss's tensor runs as a forward of the unit that holds the parameters
(`register_fsdp_forward_method`, FSDP2's public API for forwards other than `forward`): `as_unit_output`
computes it between the unit's pre- and post-forward (the parameters gathered, then freed or kept
by the unit's own `reshard_after_forward`) and returns it joined to an empty anchor that FSDP2 hooks,
so the unit's pre-backward runs before the tensor's own backward: the weight is gathered for it,
and the end-of-backward reduction is queued. The computation's values never pass through FSDP2
(no output cast).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_METHOD = "_blockdiag_cp_unit_forward"


def fsdp_unit(model: torch.nn.Module, module: torch.nn.Module) -> torch.nn.Module | None:
    """The FSDP2 unit (`fully_shard`) whose parameters include `module`'s: `module` itself when it was
    sharded (alone or in a group), else its innermost sharded ancestor in `model`; None without FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return module
    path = next((name for name, m in model.named_modules() if m is module), None)
    if path is None:
        return None
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        ancestor = model.get_submodule(".".join(parts[:depth]))
        if isinstance(ancestor, FSDPModule):
            return ancestor
    return None


def _call(compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    return compute()


def unit_forward(unit: torch.nn.Module, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()` run as a forward of the FSDP2 `unit` (its pre-forward, then its post-forward on the
    returned tensor). `compute` reaches FSDP2 as a closure: no tensor of it is an input of the unit."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    if _METHOD not in vars(unit):
        object.__setattr__(unit, _METHOD, _call)
        register_fsdp_forward_method(unit, _METHOD)
    return getattr(unit, _METHOD)(compute)


def as_unit_output(unit: torch.nn.Module | None, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
    """`compute()` as an output of `unit`'s forward (module docstring), or simply `compute()` without a
    unit or without gradients (nothing to hook; the caller then computes inside the model's forward)."""
    if unit is None or not torch.is_grad_enabled():
        return compute()
    box: list[torch.Tensor] = []

    def hooked() -> torch.Tensor:
        box.append(compute())
        return box[0].reshape(-1)[:0].sum()  # exactly 0, on the values' path: FSDP2 hooks this anchor

    anchor = unit_forward(unit, hooked)
    values = box[0]
    return values + anchor.to(values.dtype) if values.requires_grad else values


def unsharded_class(module: torch.nn.Module) -> type:
    """`module`'s own class: FSDP2 swaps a sharded module's class for a subclass named `FSDP<class>`."""
    from torch.distributed.fsdp import FSDPModule

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))

"""FSDP2 in the tests: the unit layouts a user shards a causal LM into, every gradient gathered from
its shards, and accelerate's FSDP2 path kept on CPU processes.

Layouts (`shard`), each `fully_shard` over the given mesh, then the root:
- "head": each decoder layer, the output head (`lm_head`, or a sequence classifier's `score`), then
  the root (torchtitan's layout): the head's weight is freed after its forward;
- "layers": each decoder layer, then the root (`integrations.accelerate.wrap_model`);
- "root": the whole model as one unit.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import TrainerCallback

LAYOUTS = ("head", "layers", "root")


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder blocks of a Transformers causal LM or sequence classifier (`base_model.layers`)."""
    return list(model.base_model.layers)


def output_head(model) -> torch.nn.Module:
    """The module that maps the last hidden states out: the output embedding, or a classifier's `score`."""
    head = model.get_output_embeddings()
    return head if head is not None else model.score


def shard(model, layout: str, mesh, **kwargs):
    """`model` sharded with FSDP2 over `mesh` in `layout` (module docstring); `kwargs` go to every `fully_shard`."""
    from torch.distributed.fsdp import fully_shard

    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}; expected one of {LAYOUTS}")
    if layout in ("head", "layers"):
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, **kwargs)
    if layout == "head":
        fully_shard(output_head(model), mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient (zeros where none arrived), gathered from FSDP2's shards: a
    collective per sharded parameter, in parameter order (every rank calls it)."""
    out = {}
    for name, p in model.named_parameters():
        grad = p.grad
        if grad is None:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[name] = torch.zeros_like(full)
            continue
        out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


class FullGradsBeforeStep(TrainerCallback):
    """`full_grads` of the trainer's model when the optimizer is about to take its first step."""

    def __init__(self):
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if not self.grads:
            self.grads = full_grads(getattr(model, "module", model))


@contextlib.contextmanager
def fsdp_on_cpu():
    """accelerate keeps a given FSDP plugin (distributed type FSDP) for CPU processes, as it does for
    accelerator devices (on the CPU it otherwise drops the plugin and trains with DDP), so that the
    Trainer takes its FSDP2 path on gloo."""
    from unittest import mock

    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def init_keeping_fsdp(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # as accelerate records it on accelerator devices: a later AcceleratorState() reads it from there
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    with mock.patch.object(AcceleratorState, "__init__", init_keeping_fsdp):
        yield

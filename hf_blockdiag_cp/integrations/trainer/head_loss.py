"""A CP step's token cross-entropy through the chunked log-prob head: no `[tokens, vocab]` logits.

Under CP the trainers' loss is the model's own: its cross-entropy summed over the shard's targets,
over `num_items_in_batch` (invariant I2). For a causal LM that projects its logits, transforms them
as `logprobs.LogitTransform` knows, and takes Transformers' stock `ForCausalLMLoss` of them, that is
`-sum(log p(target)) / num_items_in_batch`: `head_token_loss` computes it from the chunked head
(`logprobs.shard_log_probs`, inside the model's own forward), which holds one tile of logits at a
time where the model's loss holds the shard's logits, an fp32 copy and their gradient. TRL 1.16's
`SFTTrainer` skips the logits in the same way (its fused LM head). The head can also return
per-token statistics (`logprobs.STATS`) for metrics, e.g. SFT's entropy and token accuracy.

`head_loss_refusal` says why a step must keep the model's own loss: a model whose loss, forward or
LM head differs from the stock ones (a custom `loss_function`, Liger's fused cross-entropy, a class
forward from outside Transformers, a PEFT adapter on the LM head or prompt learning), or an MoE
router auxiliary loss that the model's own loss would add. A model whose logits turn out, on the
head's first probe, to be transformed in a way the head does not know, or whose forward does not call
its output embedding, keeps the model's loss too; so does an output embedding sharded by tensor
parallelism.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from ...compat.transformers import causal_lm_loss
from ...logprobs import shard_log_probs
from ...logprobs.capture import OutputEmbeddingNotCalled, UnknownLogitTransform, output_embedding
from ...logprobs.fsdp import fsdp_unit
from ...model_patches.router_aux_loss import needs_router_aux
from ...step.model_support import configured_model

logger = logging.getLogger(__name__)

_REFUSED: "weakref.WeakKeyDictionary[torch.nn.Module, str]" = weakref.WeakKeyDictionary()
_FOREIGN_LOSS_MODULES = ("liger_kernel",)  # forwards whose loss is not the stock cross-entropy of the logits


@dataclass
class HeadLossOutput(ModelOutput):
    """What a CP step's forward returns on the head path: the loss, and the requested per-token
    statistics of the shard ([1, L], no gradient, 0 where no target; `is_top1` as 0 / 1). No logits."""

    loss: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None


def _is_dtensor(tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def _loss_model(model):
    """The module whose forward computes the loss: inside DDP / compile wrappers, and a PEFT model's base."""
    inner = configured_model(model)
    get_base = getattr(inner, "get_base_model", None)
    return get_base() if callable(get_base) else inner


def _functions(forward, depth: int = 6) -> list:
    """The functions an instance forward runs through its wrappers (bound methods, `__wrapped__`,
    accelerate's `model_forward`, closures): where a replaced forward comes from."""
    found, todo, seen = [], [(forward, 0)], set()
    while todo:
        item, level = todo.pop()
        if item is None or id(item) in seen or level > depth:
            continue
        seen.add(id(item))
        found.append(item)
        nexts = [getattr(item, name, None) for name in ("__func__", "__wrapped__", "model_forward", "func")]
        nexts += [cell.cell_contents for cell in (getattr(item, "__closure__", None) or ())
                  if callable(getattr(cell, "cell_contents", None))]
        todo.extend((n, level + 1) for n in nexts if callable(n))
    return found


def head_loss_refusal(model, inputs: dict, keeps_router_aux: bool) -> str | None:
    """Why this CP step's loss must be the model's own rather than the head's (None: the head's is the
    same loss). `keeps_router_aux`: the model's own loss would add an MoE router auxiliary term."""
    if not isinstance(inputs.get("shift_labels"), torch.Tensor):
        return "the step has no labels"
    base = _loss_model(model)
    if base is None:
        return "the model has no config (not a Transformers model)"
    refused = _REFUSED.get(base)
    if refused is not None:
        return refused
    try:
        head = output_embedding(model)
    except ValueError as error:
        return str(error)
    if _is_dtensor(head.weight) and (fsdp_unit(model, head) is None or head.weight.device_mesh.ndim > 1):
        return "the output embedding's weight is sharded other than by FSDP2 alone (tensor parallelism)"
    peft_config = getattr(base, "active_peft_config", None) or getattr(model, "active_peft_config", None)
    if getattr(peft_config, "is_prompt_learning", False):
        return "a PEFT prompt-learning adapter changes the model's inputs and labels"
    forward = type(base).forward
    if not getattr(forward, "__module__", "").startswith("transformers."):
        return f"{type(base).__name__}.forward comes from {forward.__module__}, not from Transformers"
    if getattr(base, "loss_function", None) is not causal_lm_loss():
        return f"{type(base).__name__}'s loss_function is not Transformers' ForCausalLMLoss"
    instance = base.__dict__.get("forward")
    foreign = [f for f in _functions(instance) if getattr(f, "__module__", None)
               and f.__module__.startswith(_FOREIGN_LOSS_MODULES)] if instance is not None else []
    if foreign:
        return f"the model's forward is replaced by {foreign[0].__module__} (Liger's fused cross-entropy)"
    text = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    if keeps_router_aux and needs_router_aux(base.config) and (inputs.get("output_router_logits")
                                                                or getattr(text, "output_router_logits", False)):
        return "the model's own loss adds the MoE router auxiliary loss"
    return None


def head_token_loss(model, inputs: dict, stats: tuple[str, ...] = ()) -> HeadLossOutput | None:
    """`model`'s token cross-entropy on this CP step's `inputs` (the shard step's local batch with its
    `num_items_in_batch`) from the chunked head, and the requested per-token `stats`; None where the
    model's logits are transformed in a way the head does not know, or its forward never called its
    output embedding (then refused for the model)."""
    try:
        log_probs, values, _ = shard_log_probs(model, inputs, stats=stats)
    except (UnknownLogitTransform, OutputEmbeddingNotCalled) as error:
        _REFUSED[_loss_model(model)] = str(error)
        return None
    loss = -log_probs.sum() / inputs["num_items_in_batch"]
    return HeadLossOutput(loss=loss, **{name: value.unsqueeze(0) for name, value in values.items()})


class PathNote:
    """One INFO line per trainer for each loss path its CP steps take (and why the model's own, where so)."""

    def __init__(self):
        self.said: set[str | None] = set()

    def __call__(self, refusal: str | None) -> None:
        if refusal in self.said:
            return
        self.said.add(refusal)
        if refusal is None:
            logger.info("blockdiag_cp: the training loss runs through the chunked log-prob head (no [tokens, vocab] "
                        "logits)")
        else:
            logger.info("blockdiag_cp: the training loss is the model's own (with [tokens, vocab] logits): %s", refusal)

"""The model's own forward, with the output embedding replaced by the chunked log-prob head.

A forward pre-hook on the output embedding (`get_output_embeddings()`, installed once per model)
takes the final hidden states while a `HeadRequest` is active and runs `head.token_log_probs` on them
inside the model's forward: wrappers that act around the forward (DDP, PEFT, `torch.compile`) see the
head's parameters used as in a plain forward. Under FSDP2, with gradients, the head runs right after
the forward instead, as a forward of the FSDP2 unit that holds the output embedding's weight
(`fsdp.as_unit_output`): FSDP2 gathers that weight for the head's backward and reduces its gradient,
whatever units the model was sharded into. The output embedding itself runs on `probe` rows only
(none after the first call), so the model builds no `[tokens, vocab]` logits. On the first call per
model and dtype it runs on two rows, and the logits the model returns for them (after its own
scaling and soft-capping) must equal the `LogitTransform` of the head: a model that transforms its
logits in a way the head does not know is refused instead of trained on wrong log-probs.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..step.model_support import configured_model
from .fsdp import as_unit_output, fsdp_unit
from .head import LogitTransform, token_log_probs

PROBE_ROWS = 2
_VERIFIED: "weakref.WeakKeyDictionary[torch.nn.Module, set]" = weakref.WeakKeyDictionary()
_ACTIVE: "HeadRequest | None" = None
_HOOK_ATTR = "_blockdiag_cp_log_prob_hook"


class UnknownLogitTransform(NotImplementedError):
    """The model's logits for the probe rows are not the head's `LogitTransform` of them (module docstring)."""


class OutputEmbeddingNotCalled(RuntimeError):
    """The model's forward never called its output embedding, so the head could not run."""


@dataclass(eq=False)
class HeadRequest:
    """One call's targets and options; filled by the hook with the per-token results."""

    rows: torch.Tensor  # positions of the local shard whose target is scored, [N] (long)
    targets: torch.Tensor  # their target tokens, [N]
    transform: LogitTransform
    chunk_size: int | None
    stats: tuple[str, ...]
    tiles: str = "eager"  # how the head runs its tiles (`head.token_log_probs`)
    probe: int = 0  # rows the output embedding still runs on, to check the transform
    log_probs: torch.Tensor | None = None
    values: dict = field(default_factory=dict)
    probe_logits: torch.Tensor | None = None  # the transform of the probe rows, computed by the head
    seen: bool = False
    deferred: bool = False  # score after the forward, as a forward of the FSDP2 unit of the weight (`fsdp`)
    hidden: torch.Tensor | None = None  # the scored rows' hidden states, [N, H], until scored
    probe_hidden: torch.Tensor | None = None


@torch.compiler.disable
def _pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict):
    request = _ACTIVE
    if request is None or request.seen or not args:
        return None
    request.seen = True
    hidden = args[0]
    if hidden.ndim != 3 or hidden.shape[0] != 1:
        raise ValueError(
            f"blockdiag_cp log-probs: the output embedding received hidden states of shape {tuple(hidden.shape)}; "
            "expected [1, L, H] (one packed row)"
        )
    probe = hidden[:, : request.probe]
    request.hidden, request.probe_hidden = hidden[0].index_select(0, request.rows), probe[0].detach()
    if not request.deferred:
        _score(request, module)
    return (probe,) + tuple(args[1:]), kwargs


def _score(request: HeadRequest, module: torch.nn.Module) -> torch.Tensor:
    """The head on the captured rows, and the transform of the probe rows, with `module`'s weight as it
    is at the call (gathered, under FSDP2); the request then holds the results, not the hidden rows."""
    bias = getattr(module, "bias", None)
    request.log_probs, request.values = token_log_probs(
        request.hidden, module.weight, bias, request.targets, request.transform, request.chunk_size, request.stats,
        request.tiles,
    )
    if request.probe:
        with torch.no_grad():
            raw = request.probe_hidden.float() @ module.weight.float().t()
            untempered = replace(request.transform, temperature=1.0)  # the model knows no sampling temperature
            request.probe_logits = untempered.apply(raw if bias is None else raw + bias.float())
    request.hidden = request.probe_hidden = None
    return request.log_probs


def output_embedding(model) -> torch.nn.Module:
    """The module that projects `model`'s hidden states to the vocabulary (inside DDP / compile / PEFT)."""
    inner = configured_model(model)
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or getattr(head, "weight", None) is None or head.weight.ndim != 2:
        raise ValueError(
            f"blockdiag_cp log-probs: {type(inner if inner is not None else model).__name__} has no output embedding "
            "with a [vocab, hidden] weight (get_output_embeddings()); expected a causal language model"
        )
    if hasattr(head, "base_layer"):  # a PEFT adapter on the LM head would be bypassed: refuse it
        raise ValueError(
            "blockdiag_cp log-probs: the output embedding carries a PEFT adapter, which the log-prob head would not "
            "apply; remove 'lm_head' from the adapter's target_modules"
        )
    return head


def install_hook(head: torch.nn.Module) -> None:
    """The pre-hook on `head`, once (it does nothing while no request is active)."""
    if getattr(head, _HOOK_ATTR, None) is None:
        setattr(head, _HOOK_ATTR, head.register_forward_pre_hook(_pre_hook, with_kwargs=True))


def run_with_head(model, inputs: dict[str, Any], request: HeadRequest):
    """`model(**inputs)` with `request` active: the request holds the log-probs afterwards. The first
    call per output embedding and dtype also checks the model's logit transform (module docstring).
    With gradients under FSDP2 the head runs right after the forward, as a forward of the unit that
    holds the output embedding's weight (`fsdp.as_unit_output`)."""
    global _ACTIVE
    head = output_embedding(model)
    install_hook(head)
    verified = _VERIFIED.setdefault(head, set())
    key = (torch.get_autocast_dtype(head.weight.device.type) if torch.is_autocast_enabled(head.weight.device.type)
           else head.weight.dtype, request.transform.scale, request.transform.softcap)
    request.probe = 0 if key in verified else PROBE_ROWS
    unit = fsdp_unit(model, head) if torch.is_grad_enabled() else None
    request.deferred = unit is not None
    previous, _ACTIVE = _ACTIVE, request
    try:
        outputs = model(**inputs)
    finally:
        _ACTIVE = previous
    if not request.seen:
        raise OutputEmbeddingNotCalled(
            f"blockdiag_cp log-probs: {type(configured_model(model)).__name__}'s forward did not call its output "
            "embedding (get_output_embeddings()); the log-prob head cannot run for this model"
        )
    if request.deferred:
        request.log_probs = as_unit_output(unit, lambda: _score(request, head))
    if request.probe:
        _check_transform(outputs, request, key[0])
        verified.add(key)
    return outputs


def _check_transform(outputs, request: HeadRequest, dtype: torch.dtype) -> None:
    """Refuse a model whose returned logits for the probe rows differ from the head's transform of them."""
    logits = outputs.get("logits") if isinstance(outputs, dict) else getattr(outputs, "logits", None)
    want = request.probe_logits
    if logits is None or want is None or logits.shape[-2:] != want.shape:
        raise RuntimeError(
            "blockdiag_cp log-probs: the model's forward did not return logits for the probe rows of its output "
            "embedding; its LM head cannot be checked"
        )
    got = logits[0].detach().float()
    tolerance = (1e-4 if dtype == torch.float32 else 3e-2) * (1.0 + want.abs().max().item())
    error = (got - want).abs().max().item()
    if error > tolerance:
        raise UnknownLogitTransform(
            f"blockdiag_cp log-probs: the model transforms its logits in a way the log-prob head does not know (the head "
            f"applies {request.transform}; the model's logits differ by {error:.3g} on probe rows). Supported: a scale "
            "(logit_scale, logits_scaling, lm_head_multiplier) and final_logit_softcapping"
        )

"""Mixture-of-experts models: the router auxiliary (load-balancing) loss over the whole pack under CP.

Why: Transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next, OLMoE,
GPT-OSS, Jamba, GraniteMoE, MiniMax, Phi-MoE, ...) add `router_aux_loss_coef * load_balancing_loss_func(
router_logits, E, k, attention_mask)` to their loss when `output_router_logits` is on: the Switch
Transformers loss `E * sum_e f_e * P_e`, with f_e the share of the top-k assignments that went to expert
e and P_e the mean routing probability of e, both over every real token of every MoE layer. It is not
linear in those statistics, so each CP rank's loss over its own shard is not the pack's, and on a
packed row (no attention mask) the stock function also counts the pack's padding.

The patch replaces the modeling module's `load_balancing_loss_func`, which those forwards look up when
they call it. Outside a CP step it is the stock function. Inside one it sums this rank's statistics
over the real tokens of its shard (`router_sums`; pack padding never counts), adds them over the CP
group with a differentiable SUM all-reduce (`comm.reduce.all_reduce_sum`) and returns the loss of the
totals (`balancing_loss`): on every rank the stock model's value on the pack's documents padded with an
attention mask, and, since every rank adds that same loss, the mean gradient over the group is the
stock gradient (invariant I2). A module whose function is not that loss (checked on a probe) raises
inside a step instead.

`router_aux_scope` is how trainers take the loss: it asks the model for its router logits (`request`),
scales what the forward adds to the model's own loss (`scale`; 0 leaves it out), keeps the unscaled loss
(`scope.loss`), and can split the pack's documents into groups with one loss each (`groups`, `own`):
GRPO / RLOO, where TRL computes the loss per rank over that rank's own rows.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import sys
from dataclasses import dataclass, field

import torch

from hf_blockdiag_cp.comm.reduce import all_reduce_sum
from hf_blockdiag_cp.step.state import CPStep, active_step

from .registry import ModelPatch, register_patch

FUNCTION = "load_balancing_loss_func"  # the modeling modules' name for the loss
_ORIGINAL_ATTR = "_blockdiag_cp_original"


# --------------------------------------------------------------------------- the arithmetic


def router_sums(gate_logits, num_experts: int, top_k: int, groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """[num_groups, 2E + 1]: per group of tokens, summed over the MoE layers, the top-k assignments to each
    expert, the routing probability of each expert, and the token count. `gate_logits`: one [T, E] tensor
    per MoE layer; `groups` [T]: each token's group, -1 for a token that does not count. As Transformers
    computes them: softmax and top-k in the logits' dtype, sums in float32."""
    device = gate_logits[0].device
    groups = groups.to(device)
    counted = (groups >= 0).to(torch.float32)
    group = groups.clamp(min=0)
    counts = torch.zeros(num_groups * num_experts, dtype=torch.float32, device=device)
    probs = torch.zeros(num_groups, num_experts, dtype=torch.float32, device=device)
    tokens = torch.zeros(num_groups, dtype=torch.float32, device=device)
    for layer_gate in gate_logits:
        weights = torch.nn.functional.softmax(layer_gate.to(device), dim=-1)
        _, selected = torch.topk(weights, top_k, dim=-1)
        slots = (group[:, None] * num_experts + selected).reshape(-1)
        counts = counts.scatter_add(0, slots, counted.repeat_interleave(top_k))
        probs = probs.index_add(0, group, weights.float() * counted[:, None])
        tokens = tokens.index_add(0, group, counted)
    return torch.cat([counts.view(num_groups, num_experts), probs, tokens[:, None]], dim=1)


def balancing_loss(sums: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[groups] the load-balancing loss of each group's `router_sums`: E * sum_e f_e * P_e (0 for an
    empty group)."""
    counts, probs, tokens = sums[:, :num_experts], sums[:, num_experts:-1], sums[:, -1:].clamp(min=1)
    return (counts / tokens * (probs / tokens)).sum(dim=1) * num_experts


# --------------------------------------------------------------------------- the trainers' scope


@dataclass(eq=False)
class RouterAuxScope:
    """What `router_aux_scope` set up for the forwards inside it, and what they computed."""

    scale: float = 1.0
    groups: torch.Tensor | None = None  # [documents of the pack] -> group (default: one group)
    own: int = 0  # the group whose loss this rank takes
    num_groups: int = 1
    losses: list[torch.Tensor] = field(default_factory=list)  # one per forward that computed the loss

    @property
    def loss(self) -> torch.Tensor | None:
        """The (unscaled) loss of the last forward inside the scope; None if none computed one."""
        return self.losses[-1] if self.losses else None


_SCOPES: list[RouterAuxScope] = []  # process-wide, innermost last (the forward may run in any thread)


@contextlib.contextmanager
def router_aux_scope(model=None, *, request: bool = False, scale: float = 1.0, groups: torch.Tensor | None = None,
                     own: int = 0):
    """Inside: the router auxiliary loss of every CP-step forward is kept in the yielded scope (`.loss`),
    and the model's own loss gets `scale` times it (0: none of it; the caller adds its own term).
    `request=True` passes `output_router_logits=True` to `model`'s MoE forward (else the model's config
    decides). `groups` ([D] long, one entry per document of the pack: its group in [0, K)) and `own`
    split the statistics: each group gets its own loss, and this rank the `own` group's."""
    count = 1
    if groups is not None:
        groups = torch.as_tensor(groups, dtype=torch.long).cpu()
        if groups.ndim != 1 or not groups.numel() or int(groups.min()) < 0 or own < 0:
            raise ValueError(f"router_aux_scope: groups must be [documents] of group indices >= 0, and own >= 0; got "
                             f"{groups.tolist()} and own={own}")
        count = max(int(groups.max()), own) + 1  # own may be a group without documents: its loss is 0
    scope = RouterAuxScope(scale, groups, own, num_groups=count)
    handle = _request_router_logits(model) if request else None
    _SCOPES.append(scope)
    try:
        yield scope
    finally:
        _SCOPES.remove(scope)
        if handle is not None:
            handle.remove()


def scope_loss(scope: RouterAuxScope, setting: str) -> torch.Tensor:
    """The loss the scope's forward computed; a RuntimeError naming `setting` (the trainer's switch) when the
    forward computed none although the trainer asked for it."""
    if scope.loss is None:
        raise RuntimeError(
            f"the MoE router auxiliary loss is on ({setting}), but the model's forward computed none in its CP step: "
            f"its {FUNCTION} was not called, or not through hf_blockdiag_cp.apply_model_patches(model)"
        )
    return scope.loss


@functools.cache
def _takes_router_flag(cls: type) -> bool:
    try:
        return "output_router_logits" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


def _request_router_logits(model):
    """A forward pre-hook on the outermost module of `model` whose forward takes `output_router_logits`."""
    module = next((m for m in model.modules() if _takes_router_flag(type(m))), None) if model is not None else None
    if module is None:
        raise ValueError(
            f"the MoE router auxiliary loss is on, but {type(model).__name__}'s forward takes no output_router_logits: "
            "expected a mixture-of-experts model that returns its router logits"
        )
    return module.register_forward_pre_hook(
        lambda _module, args, kwargs: (args, {**kwargs, "output_router_logits": True}), with_kwargs=True)


# --------------------------------------------------------------------------- the patched function


def _local_groups(step: CPStep, scope: RouterAuxScope | None) -> tuple[torch.Tensor, int]:
    """([L] the group of each row of this rank's shard, -1 for padding; the number of groups)."""
    layout = step.layout
    documents = layout.document_ids[layout.slot_positions[step.rank]]
    if scope is None or scope.groups is None:
        return step.cached(("router_aux_groups",), lambda: torch.where(documents > 0, 0, -1)), 1
    count = int(layout.document_ids.max())
    if scope.groups.numel() != count:
        raise ValueError(f"router_aux_scope: groups holds {scope.groups.numel()} entries; expected one per document "
                         f"of the pack ({count})")
    return torch.where(documents > 0, scope.groups[(documents - 1).clamp(min=0)], -1), scope.num_groups


def pack_loss(step: CPStep, gate_logits, num_experts: int, top_k: int, attention_mask=None,
              scope: RouterAuxScope | None = None) -> torch.Tensor:
    """The load-balancing loss of the whole pack (or of the scope's `own` group of documents) from this
    rank's router logits: local sums over real tokens, one differentiable all-reduce over the CP group."""
    groups, count = _local_groups(step, scope)
    rows = {int(g.shape[0]) for g in gate_logits}
    if rows != {groups.numel()}:
        raise ValueError(f"blockdiag_cp: the router logits hold {sorted(rows)} rows per layer in a CP step whose "
                         f"shards hold {groups.numel()} tokens; expected one packed row per rank")
    if attention_mask is not None:
        if attention_mask.ndim != 2 or attention_mask.numel() != groups.numel():
            raise ValueError(f"blockdiag_cp: attention_mask of shape {tuple(attention_mask.shape)} in a CP step with "
                             f"MoE router logits; expected none or [1, {groups.numel()}]")
        groups = torch.where(attention_mask.reshape(-1).bool().to(groups.device), groups, -1)
    sums = all_reduce_sum(router_sums(gate_logits, num_experts, top_k, groups, count), step.group)
    return balancing_loss(sums, num_experts)[0 if scope is None else scope.own]


@functools.cache
def _reproduces(original) -> bool:
    """Whether `original` is the loss `router_sums` + `balancing_loss` compute (a probe: two layers, with and
    without an attention mask)."""
    g = torch.Generator().manual_seed(0)
    gates = tuple(torch.randn(6, 5, generator=g) for _ in range(2))
    mask = torch.tensor([[1, 1, 0, 1, 0, 1]])
    try:
        for m in (None, mask):
            want = original(gates, 5, 2, m)
            groups = torch.zeros(6, dtype=torch.long) if m is None else torch.where(m[0].bool(), 0, -1)
            got = balancing_loss(router_sums(gates, 5, 2, groups, 1), 5)[0]
            if not torch.is_tensor(want) or not torch.allclose(got, want.float(), rtol=1e-5, atol=1e-6):
                return False
    except Exception:  # another signature or formula
        return False
    return True


@torch.compiler.disable  # eager under torch.compile: an all-reduce and the step's process-wide state
def _in_step(step: CPStep, original, module_name: str, gate_logits, num_experts, top_k, attention_mask):
    if not _reproduces(original):
        raise NotImplementedError(
            f"blockdiag_cp: {module_name}.{FUNCTION} is not the Switch Transformers load-balancing loss that the CP "
            "reduction reproduces, so its router auxiliary loss cannot be computed over the pack. Turn it off "
            "(output_router_logits=False, or router_aux_loss_coef=0.0 in TRL's configs)"
        )
    scope = _SCOPES[-1] if _SCOPES else None
    loss = pack_loss(step, gate_logits, num_experts, top_k, attention_mask, scope)
    if scope is None:
        return loss
    scope.losses.append(loss)
    return loss if scope.scale == 1 else loss * scope.scale


def _patched(original, module_name: str):
    @functools.wraps(original)
    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        step = active_step()
        if step is None or gate_logits is None or not isinstance(gate_logits, tuple):
            return original(gate_logits, num_experts, top_k, attention_mask)
        return _in_step(step, original, module_name, gate_logits, num_experts, top_k, attention_mask)

    setattr(load_balancing_loss_func, _ORIGINAL_ATTR, original)
    return load_balancing_loss_func


def _modeling_module(config_type: type):
    """The modeling module next to a config class's module (`configuration_x` -> `modeling_x`), or None."""
    name = config_type.__module__
    if ".configuration_" not in name:
        return None
    try:
        return importlib.import_module(name.replace(".configuration_", ".modeling_", 1))
    except Exception:  # no such module, or one that does not import here
        return None


@functools.cache
def _family_has_loss(config_type: type) -> bool:
    return hasattr(_modeling_module(config_type), FUNCTION)


def needs_router_aux(config) -> bool:
    """An MoE config whose modeling module computes the load-balancing loss (when `output_router_logits`)."""
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return hasattr(text, "output_router_logits") and (_family_has_loss(type(config)) or _family_has_loss(type(text)))


def apply(model: torch.nn.Module) -> None:
    """Replace `load_balancing_loss_func` in the modeling modules of `model`'s classes (once per module)."""
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        original = getattr(module, FUNCTION, None)
        if callable(original) and not hasattr(original, _ORIGINAL_ATTR):
            setattr(module, FUNCTION, _patched(original, name))


PATCH = register_patch(
    ModelPatch(
        name="router_aux_loss",
        model_types=(),
        needed=needs_router_aux,
        apply=apply,
        why="the MoE load-balancing loss is not linear in the router statistics: they must be the whole pack's",
        any_model_type=True,
    )
)


"""Building the step: one function from planning's outputs to the step object, and the shard
step that every CP rank calls (`make_cp_blockdiag_batch_and_ctx`).

    full pack --shard_batch--> local batch + layout + fingerprint      (pure, step.shard)
      --choose the exchange (its record)--> build_step: rank plan, routes, device plan --> CPStep
      --agree (one all-reduce: errors, fingerprint, exchange)--> kernel.prepare(step)
      --> (step.activate, local batch, layout)
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from ..comm import agree, check_group_usable, group_spans_nodes, resolve_cp_group
from ..comm.notice import warn_once
from ..comm.parallel_dims import check_tp_mesh
from ..config import CPConfig, default_config
from ..kernels import get_kernel
from ..planning import (
    ExchangePlan,
    Layout,
    choose_exchange,
    get_exchange,
    plan_exchange,
    plan_key_overlap,
    plan_overlap,
    validate_rank_plan,
)
from .model_support import input_embedding_rows, prepare_model
from .shard import SHARD_KEY, PackFingerprint, check_token_ids, shard_batch
from .state import STEP_KWARG, BlockdiagCpModelState, CPStep, DevicePlan, StepOverlap
from .targets import StepTargets, check_pack_targets

logger = logging.getLogger(__name__)


def build_step(
    layout: Layout,
    rank: int,
    group,
    device: torch.device,
    attn_backend: str,
    kv_exchange: str,
    exchange_plan: ExchangePlan | None = None,
    overlap: bool | str = False,
) -> CPStep:
    """The step object of rank `rank` for `layout`: its attention plan over the rows the exchange
    returns (validated on the host, then moved to `device` once) and the exchange's routes. For a
    head-parallel exchange the plan is the whole pack's, as one rank (every rank's kernel sees it).

    `attn_backend` is a canonical kernel name or "auto"; `kv_exchange` the registered exchange
    this step runs (as agreed by the group); `exchange_plan` is planned here if the exchange
    needs one and none is given. With `overlap` ("queries" or True, "keys": `CPConfig.overlap`), when
    the exchange can overlap (`begin`) and the group has two or more ranks, the attention is split
    for it (`planning.plan_overlap`, `planning.plan_key_overlap`). Pure but for the device copies.
    """
    record = get_exchange(kv_exchange)
    if record.needs_plan and exchange_plan is None:
        exchange_plan = plan_exchange(layout)
    mine = record.plan(layout, exchange_plan, rank)
    rank_plan, rows = mine.rank_plan, mine.row_positions
    # Host check of the varlen metadata before anything reaches a kernel (a bad offset there is an illegal access).
    validate_rank_plan(rank_plan, record.plan_queries(layout), rank_plan.num_keys, num_rows=rows.numel())
    split = None
    if overlap and record.begin is not None and layout.cp_size > 1:
        split = (plan_key_overlap if overlap == "keys" else plan_overlap)(layout, rank, rank_plan, rows)
        for part in (split.local, split.remote):
            if part is not None:
                validate_rank_plan(part.plan, part.num_queries, part.plan.num_keys, num_rows=part.row_positions.numel())
    boundaries = layout.segments.boundaries
    return CPStep(
        group=group,
        rank=rank,
        world_size=layout.cp_size,
        layout=layout,
        rank_plan=rank_plan,
        plan=DevicePlan.from_rank_plan(
            rank_plan, device, rows, layout.segments.segment_ids[rows], layout.segments.segment_starts[rank_plan.q_positions]
        ),
        attn_backend=attn_backend,
        kv_exchange=kv_exchange,
        model_state=BlockdiagCpModelState(group, boundaries.to(device), boundaries, rank, layout),
        exchange_plan=exchange_plan,
        kv_routes=None if mine.routes is None else mine.routes.to(device),
        overlap=None if split is None else StepOverlap.from_plan(split, layout, device),
    )


def exchange_id(name: str) -> int:
    """A number for an exchange name that every process computes alike (unlike `hash`), for the consensus."""
    return zlib.crc32(name.encode())


@dataclass(frozen=True)
class StepAgreement:
    """What the ranks of one CP group compare before the first collective of a step (I5)."""

    pack: PackFingerprint
    kv_exchange: int  # exchange_id of the exchange this rank would run

    def values(self) -> dict[str, int]:
        fields = {f"pack {name.replace('_', ' ')}": value for name, value in vars(self.pack).items()}
        return {**fields, "kv exchange": self.kv_exchange}


def step_exchange(config: CPConfig, layout: Layout, group) -> tuple[str, ExchangePlan | None]:
    """The exchange this rank would run for `layout` (the consensus checks that every rank
    agrees) and the exchange plan, if one was needed to choose or to run it."""
    requested = config.kv_exchange
    if requested != "auto" and not get_exchange(requested).needs_plan:
        return requested, None
    plan = plan_exchange(layout)
    cross_node_ok = requested != "auto" or config.allow_cross_node_a2a or not group_spans_nodes(group)
    return choose_exchange(requested, plan, cross_node_ok), plan


def warn_exchange_fallback(requested: str, ran: str, plan: ExchangePlan | None) -> None:
    """A WARNING (once per run, rank 0) when a named exchange could not serve a pack and its fallback ran."""
    if requested in ("auto", ran):
        return
    warn_once(logger, ("kv_exchange fallback", requested, ran), (
        f"blockdiag_cp: kv_exchange={requested!r} cannot serve some packs of this run "
        f"({get_exchange(requested).reason(plan)}); those steps run {ran!r} instead, which moves the same keys "
        "(warned once; what each step ran is logged at INFO)"
    ))


def _local_batch(batch: dict, cp, config: CPConfig, loss_mask, padding_token_id, shard_primary) -> dict:
    """This rank's local batch: the pure shard step, or a batch a collator already sharded for this
    rank (which keeps the layout it was sharded with)."""
    if SHARD_KEY not in batch:
        return shard_batch(batch, cp.size, cp.rank, loss_mask, padding_token_id, shard_primary, config=config)
    info = batch[SHARD_KEY]
    if (info.cp_rank, info.cp_size) != (cp.rank, cp.size):
        raise ValueError(
            f"batch was sharded for CP rank {info.cp_rank} of {info.cp_size}, but this process is rank "
            f"{cp.rank} of {cp.size} in cp_mesh"
        )
    return dict(batch)


def _raise_unless_agreed(agreement, error: BaseException | None) -> None:
    """After the step's consensus: this rank's own error, else a peer's failure or a disagreement
    between the ranks, raised on every rank alike (I5)."""
    if error is not None:
        raise error
    if agreement.any_failed:
        raise RuntimeError("blockdiag_cp: another rank of the CP group rejected its batch (see that rank's error)")
    differing = agreement.disagreeing()
    if differing == ["kv exchange"]:
        raise RuntimeError(
            "blockdiag_cp: the ranks of one CP group chose different kv_exchange for the same pack; "
            "pass the same CPConfig on every rank (and the same LOCAL_WORLD_SIZE)"
        )
    if differing:
        raise RuntimeError(
            "blockdiag_cp: the ranks of one CP group received different packs (they differ in "
            f"{', '.join(differing)}); every CP rank must get the same full batch. Use a sampler or "
            "dataloader that gives CP peers identical batches (see hf_blockdiag_cp collator docs)"
        )


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh,
    tp_mesh,
    batch: dict,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    *,
    config: CPConfig | None = None,
    model=None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, Layout]:
    """Shard one packed batch for this CP rank and build the step's attention state.

    Every rank of the CP group calls this with the same full pack (or with the output of
    `shard_batch` for its own rank). Returns `(train_ctx, local_batch, layout)`: run
    `model(**local_batch)` and its backward inside `with train_ctx():` (`train_ctx` is the
    step object's `activate`). `config` (default: the process default, `configure_cp`) picks
    kernel, exchange and layout; a pre-sharded batch keeps the layout it was sharded with.
    `tp_mesh` (None, a 1-D DeviceMesh or a ProcessGroup: `ParallelDims.build_mesh(...).tp`) is the
    model's tensor-parallel group: TP splits heads and MLP channels, so each attention call sees its
    TP rank's heads (shapes are read from the tensors) and the exchange moves those over `cp_mesh`
    only; the step needs nothing else from TP. It is checked to share no rank but this one with
    `cp_mesh` (two dimensions of one grid). `model` (optional, the model the
    step runs, wrapped or not) gets the model patches it needs (`apply_model_patches`, once), lets
    errors name its attention implementation, and has the pack's input_ids checked against its input
    embeddings (a ValueError naming the id, not the embedding's IndexError); a model type the library
    refuses raises its NotImplementedError here, on every rank.

    Errors on any rank (bad input, different packs on the ranks of one group, different
    exchange choices) make every rank raise after one consensus all-reduce, never a hang. A pack
    with labels but no target token is warned about or refused (`CPConfig.no_target_packs`,
    `step.targets`).
    """
    config = default_config() if config is None else config
    if not isinstance(config, CPConfig):
        raise TypeError(f"config must be a CPConfig or None; got {type(config).__name__}")
    cp = resolve_cp_group(cp_mesh)
    check_group_usable(cp.group)
    error: BaseException | None = None
    local = step = None
    agreement_values: dict[str, int] = {}
    try:
        prepare_model(model)  # patches the model needs; a refused model type raises here, on every rank
        check_tp_mesh(tp_mesh, cp.group)
        local = _local_batch(batch, cp, config, loss_mask, padding_token_id, shard_primary)
        info = local[SHARD_KEY]
        check_token_ids(info.token_ids, input_embedding_rows(model))  # ids past the embeddings: named here, not an IndexError
        exchange, exchange_plan = step_exchange(config, info.layout, cp.group)
        # The exchange is agreed too: ranks that would run different collectives raise (I5).
        agreement_values = StepAgreement(info.fingerprint, exchange_id(exchange)).values()
        # Built (and its plan validated) before the consensus: a bad plan on one rank makes every
        # rank raise below instead of leaving peers in the first exchange (I5).
        step = build_step(
            info.layout, cp.rank, cp.group, local["position_ids"].device, config.attn_backend, exchange, exchange_plan,
            overlap=config.overlap,
        )
    except Exception as exc:  # any rank's failure reaches its peers through the consensus below (I5)
        error = exc
    if not agreement_values:  # this rank failed before it had a fingerprint: zeros, flagged as failed
        agreement_values = StepAgreement(PackFingerprint(0, 0, 0, 0, 0, 0), 0).values()
    _raise_unless_agreed(agree(cp.group, error is not None, agreement_values), error)
    info = local.pop(SHARD_KEY)
    check_pack_targets(config.no_target_packs, info.fingerprint.label_count, "labels" in local, cp.rank)
    warn_exchange_fallback(config.kv_exchange, exchange, exchange_plan)
    layout = info.layout
    if step.attn_backend != "auto":
        prepare = get_kernel(step.attn_backend).prepare
        if prepare is not None:
            for target in step.kernel_targets:
                prepare(target)  # per-step kernel state (e.g. the flex block mask) before the first layer (I4)
    step.requested_kv_exchange, step.model = config.kv_exchange, model
    step.mixer_backend, step.mixer_transport = config.mixer_backend, config.mixer_transport
    step.head_tiles = config.head_tiles
    step.targets = StepTargets.build(info.targets, local.get("shift_labels"), local["position_ids"].device)
    local[STEP_KWARG] = step
    return step.activate, local, layout

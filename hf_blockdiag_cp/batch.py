"""The shard step: one packed batch in, this rank's local batch and the step context out.

Every CP rank calls `make_cp_blockdiag_batch_and_ctx` with the same full pack. It derives
document boundaries, pads to a multiple of 2·G, pre-shifts labels on the *global* pack (so
no target crosses a document boundary or a shard boundary), plans the layout, slices every
sequence-aligned tensor to this rank's rows, and builds the per-step attention state once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .config import current_config
from .consensus import agree, checksum
from .layout import (
    Layout,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
    plan_layout,
    validate_document_ids,
)
from .exchange import check_group_usable, group_spans_nodes
from .exchange_plan import EXCHANGE_KINDS, choose_exchange, plan_exchange
from .state import STEP_KWARG, CPStep, activate

IGNORE_INDEX = -100

# Keys that only describe the full pack's attention; they must not reach the model on a shard.
_DROPPED_KEYS = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Per-token side streams [1, S]: padded like the primary stream (with 0, "text") and sharded with it.
_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")


@dataclass(frozen=True)
class CPGroup:
    group: Any  # ProcessGroup or None
    size: int
    rank: int


def resolve_cp_group(cp_mesh) -> CPGroup:
    """Accept a 1-D DeviceMesh, a ProcessGroup, or None (no CP)."""
    if cp_mesh is None:
        return CPGroup(None, 1, 0)
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(cp_mesh, DeviceMesh):
        if cp_mesh.ndim != 1:
            raise ValueError(f"cp_mesh must be a 1-D DeviceMesh (the CP dimension); got {cp_mesh.ndim} dimensions {cp_mesh.mesh_dim_names}")
        group = cp_mesh.get_group()
        size = dist.get_world_size(group)
        if size != cp_mesh.size():
            raise ValueError(f"cp_mesh has {cp_mesh.size()} ranks but its process group has {size}")
    elif isinstance(cp_mesh, dist.ProcessGroup):
        group = cp_mesh
        size = dist.get_world_size(group)
    else:
        raise TypeError(f"cp_mesh must be a 1-D DeviceMesh, a ProcessGroup or None; got {type(cp_mesh).__name__}")
    if size == 1:
        return CPGroup(None, 1, 0)
    return CPGroup(group, size, dist.get_rank(group))


# --------------------------------------------------------------------------- input checks


def _row(batch: dict, key: str, seq_len: int | None, ndim_ok=(2,)) -> torch.Tensor | None:
    t = batch.get(key)
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"batch[{key!r}] must be a tensor; got {type(t).__name__}")
    if t.ndim not in ndim_ok:
        raise ValueError(f"batch[{key!r}] must have {' or '.join(map(str, ndim_ok))} dims; got shape {tuple(t.shape)}")
    seq_dim = t.ndim - 1 if key == "position_ids" else 1
    if seq_len is not None and t.shape[seq_dim] != seq_len:
        raise ValueError(f"batch[{key!r}] has sequence length {t.shape[seq_dim]}, expected {seq_len} (the primary stream's)")
    if t.shape[seq_dim - 1] != 1:
        raise ValueError(f"batch[{key!r}] has batch size {t.shape[seq_dim - 1]}; a CP step takes one packed row")
    return t


def _primary(batch: dict) -> tuple[str, torch.Tensor]:
    has_ids, has_embeds = batch.get("input_ids") is not None, batch.get("inputs_embeds") is not None
    if has_ids == has_embeds:
        raise ValueError("batch must hold exactly one primary stream: input_ids [1,S] or inputs_embeds [1,S,H]; "
                         f"got {'both' if has_ids else 'neither'}")
    key = "input_ids" if has_ids else "inputs_embeds"
    t = batch[key]
    want = 2 if has_ids else 3
    if not isinstance(t, torch.Tensor) or t.ndim != want:
        raise ValueError(f"batch[{key!r}] must be a tensor with {want} dims; got {getattr(t, 'shape', type(t))}")
    if t.shape[0] != 1:
        raise ValueError(
            f"batch[{key!r}] has batch size {t.shape[0]}; a CP step takes one packed row (batch size 1). "
            "Pack with transformers.DataCollatorWithFlattening or hf_blockdiag_cp's collator"
        )
    if t.shape[1] == 0:
        raise ValueError(f"batch[{key!r}] is empty")
    return key, t


def document_ids_of(batch: dict, seq_len: int) -> torch.Tensor:
    """Document ids [S] (1-based, 0 = padding) from document_ids, else position_ids restarts, else cu_seq_lens_q."""
    doc = _row(batch, "document_ids", seq_len)
    pos = _row(batch, "position_ids", seq_len, ndim_ok=(2, 3))
    if doc is not None:
        ids = doc.reshape(-1).long().cpu()
        validate_document_ids(ids, "document_ids")
    elif pos is not None and pos.ndim == 2:
        ids = document_ids_from_position_ids(pos.reshape(-1).cpu())
    elif batch.get("cu_seq_lens_q") is not None:
        ids = document_ids_from_cu_seqlens(batch["cu_seq_lens_q"], seq_len)
    elif pos is not None:
        raise ValueError("3-D position_ids (mRoPE) do not mark document boundaries; also pass document_ids [1,S] or cu_seq_lens_q")
    else:
        ids = torch.ones(seq_len, dtype=torch.long)  # one document
    mask = _row(batch, "attention_mask", seq_len)
    if mask is not None:
        ids = torch.where(mask.reshape(-1).cpu().bool(), ids, torch.zeros_like(ids))
    return ids


def positions_from_document_ids(ids: torch.Tensor) -> torch.Tensor:
    """Position of every token inside its document (0 for padding)."""
    n = ids.numel()
    change = torch.ones(n, dtype=torch.bool)
    change[1:] = ids[1:] != ids[:-1]
    idx = torch.arange(n)
    start = torch.cummax(torch.where(change, idx, torch.zeros_like(idx)), 0).values
    return torch.where(ids > 0, idx - start, torch.zeros_like(idx))


def shifted_labels(labels: torch.Tensor, padded_ids: torch.Tensor) -> torch.Tensor:
    """Global pre-shift: position p predicts labels[p+1] only inside one real document."""
    s = padded_ids.numel()
    out = torch.full((s,), IGNORE_INDEX, dtype=torch.long)
    same_doc = (padded_ids[1:] == padded_ids[:-1]) & (padded_ids[1:] > 0)
    nxt = labels[1:]
    out[:-1] = torch.where(same_doc, nxt, torch.full_like(nxt, IGNORE_INDEX))
    return out


def _pad_seq(t: torch.Tensor, s_pad: int, value, dim: int) -> torch.Tensor:
    extra = s_pad - t.shape[dim]
    if extra == 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t, t.new_full(shape, value)], dim=dim)


# --------------------------------------------------------------------------- the shard step


SHARD_KEY = "blockdiag_cp_shard"
_FINGERPRINT = ("padded length", "sequence length", "document ids", "input ids", "label count", "layout", "kv exchange")


@dataclass(frozen=True)
class ShardInfo:
    """What a pre-sharded local batch (e.g. from a DataLoader worker) carries about its full pack."""

    layout: Layout
    fingerprint: tuple[int, ...]  # same on every rank of the group for the same pack
    cp_rank: int
    cp_size: int


def shard_batch(
    batch: dict,
    cp_size: int,
    cp_rank: int,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    strategy: str = "contiguous",
) -> dict:
    """Pure shard step (no process group): the local batch of rank `cp_rank` of `cp_size`.

    The result carries a `ShardInfo` under `SHARD_KEY`, so `make_cp_blockdiag_batch_and_ctx`
    accepts it as is; this is what lets a collator shard inside DataLoader worker processes.
    """
    if not isinstance(batch, dict) and not hasattr(batch, "keys"):
        raise TypeError(f"batch must be a dict of tensors; got {type(batch).__name__}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}); got {cp_rank}")
    primary_key, primary = _primary(batch)
    seq_len = primary.shape[1]
    device = primary.device
    ids = document_ids_of(batch, seq_len)
    labels = _row(batch, "labels", seq_len)
    if loss_mask is None:
        loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        loss_mask = _row({"loss_mask": loss_mask}, "loss_mask", seq_len)
        if labels is None:
            raise ValueError("loss_mask was given without labels")
    layout = plan_layout(ids, cp_size, strategy)
    s_pad = layout.padded_seq_len
    padded_ids = layout.document_ids
    slots = layout.slot_positions[cp_rank]
    rows = slots.to(device)

    def take(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.index_select(dim, rows)

    local: dict[str, Any] = {}
    for key, value in batch.items():
        if key in _DROPPED_KEYS or key in ("labels", "loss_mask", "document_ids", "position_ids", primary_key):
            continue
        if key in _TOKEN_KEYS and value is not None:
            padded = _pad_seq(_row(batch, key, seq_len), s_pad, 0, dim=1)
            local[key] = take(padded, 1) if shard_primary else padded
            continue
        local[key] = value  # not sequence-aligned (e.g. pixel_values): passed through unchanged

    pad_value = 0.0 if primary_key == "inputs_embeds" else padding_token_id
    padded_primary = _pad_seq(primary, s_pad, pad_value, dim=1)
    local[primary_key] = take(padded_primary, 1) if shard_primary else padded_primary

    pos = _row(batch, "position_ids", seq_len, ndim_ok=(2, 3))
    if pos is None:
        pos = positions_from_document_ids(ids).to(device).unsqueeze(0)
    padded_pos = _pad_seq(pos, s_pad, 0, dim=pos.ndim - 1)
    local["position_ids"] = take(padded_pos, padded_pos.ndim - 1) if shard_primary else padded_pos
    local["document_ids"] = padded_ids[slots].unsqueeze(0).to(device)

    global_targets = 0
    if labels is not None:
        lab = labels.reshape(-1).long().cpu()
        if loss_mask is not None:
            lab = torch.where(loss_mask.reshape(-1).cpu().bool(), lab, torch.full_like(lab, IGNORE_INDEX))
        shifted = shifted_labels(_pad_seq(lab, s_pad, IGNORE_INDEX, dim=0), padded_ids)
        global_targets = int((shifted != IGNORE_INDEX).sum())
        local_shifted = shifted[slots].unsqueeze(0).to(device)
        local["labels"] = local_shifted
        local["shift_labels"] = local_shifted
        local["loss_mask"] = local_shifted != IGNORE_INDEX
        # I2: each rank's loss is (sum of its token losses) * G / N, so the mean over CP ranks is the non-CP loss.
        local["num_items_in_batch"] = max(global_targets, 1) / cp_size
    local["use_cache"] = False
    primary_sum = checksum(primary) if primary_key == "input_ids" else primary.shape[-1]
    fingerprint = (s_pad, seq_len, checksum(padded_ids), primary_sum, global_targets, checksum(layout.slot_positions))
    local[SHARD_KEY] = ShardInfo(layout, fingerprint, cp_rank, cp_size)
    return local


def make_cp_blockdiag_batch_and_ctx(
    cp_mesh,
    tp_mesh,
    batch: dict,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    strategy: str | None = None,
) -> tuple[Callable[[], contextlib.AbstractContextManager], dict, Layout]:
    """Shard one packed batch for this CP rank and build the step's attention state.

    Every rank of the CP group calls this with the same full pack (or with the output of
    `shard_batch` for its own rank). Returns `(train_ctx, local_batch, layout)`: run
    `model(**local_batch)` and its backward inside `with train_ctx():`. `strategy` picks the
    layout ("contiguous" when None); a pre-sharded batch keeps its own layout, and an explicit
    `strategy` that differs from it raises. `tp_mesh` is accepted for API symmetry; tensor
    parallelism splits heads, which block-diagonal CP leaves alone.
    """
    del tp_mesh
    cp = resolve_cp_group(cp_mesh)
    check_group_usable(cp.group)
    config = current_config()
    exchange, exchange_plan = "allgather", None
    error: BaseException | None = None
    local = step = None
    fingerprint: tuple[int, ...] = (0,) * len(_FINGERPRINT)
    try:
        if SHARD_KEY in batch:
            local = dict(batch)
            info = local[SHARD_KEY]
            if (info.cp_rank, info.cp_size) != (cp.rank, cp.size):
                raise ValueError(
                    f"batch was sharded for CP rank {info.cp_rank} of {info.cp_size}, but this process is rank "
                    f"{cp.rank} of {cp.size} in cp_mesh"
                )
            if strategy is not None and info.layout.strategy != strategy:
                raise ValueError(
                    f"strategy={strategy!r}, but the batch was already sharded with strategy={info.layout.strategy!r}; "
                    "pass the strategy to the collator / shard_batch instead"
                )
        else:
            local = shard_batch(
                batch, cp.size, cp.rank, loss_mask, padding_token_id, shard_primary, strategy or "contiguous"
            )
        if config.kv_exchange != "allgather":
            exchange_plan = plan_exchange(local[SHARD_KEY].layout)
            needed_only_ok = config.allow_cross_node_a2a or not group_spans_nodes(cp.group)
            exchange = choose_exchange(config.kv_exchange, exchange_plan, needed_only_ok)
        # The exchange is part of the fingerprint: ranks that would run different collectives raise (I5).
        fingerprint = local[SHARD_KEY].fingerprint + (EXCHANGE_KINDS.index(exchange),)
        # This rank's plan, validated on the host (validate_rank_plan), before the consensus: a bad plan
        # on one rank makes every rank raise below instead of leaving peers in the first exchange (I5).
        step = CPStep.for_rank(
            local[SHARD_KEY].layout, cp.rank, cp.group, local["position_ids"].device, config.attn_backend, exchange,
            exchange_plan,
        )
    except (ValueError, TypeError, AssertionError) as exc:
        error = exc
    agreement = agree(cp.group, error is not None, list(fingerprint))
    if error is not None:
        raise error
    if agreement.any_failed:
        raise RuntimeError("blockdiag_cp: another rank of the CP group rejected its batch (see that rank's error)")
    differing = agreement.disagreeing(list(_FINGERPRINT))
    if differing == ["kv exchange"]:
        raise RuntimeError(
            "blockdiag_cp: the ranks of one CP group chose different kv_exchange paths for the same pack; call "
            "configure_cp_varlen(...) with the same arguments on every rank (and the same LOCAL_WORLD_SIZE)"
        )
    if differing:
        raise RuntimeError(
            "blockdiag_cp: the ranks of one CP group received different packs (they differ in "
            f"{', '.join(differing)}); every CP rank must get the same full batch. Use a sampler or "
            "dataloader that gives CP peers identical batches (see hf_blockdiag_cp collator docs)"
        )
    layout = local.pop(SHARD_KEY).layout
    device = local["position_ids"].device
    if step.attn_backend == "flex" and device.type == "cuda":
        # Build the step's block mask here rather than in the first attention layer (I4).
        from .kernels.flex import block_mask

        block_mask(step, None)
    local[STEP_KWARG] = step

    @contextlib.contextmanager
    def train_ctx():
        with activate(step):
            yield step
        if step.attention_calls == 0:
            raise RuntimeError(
                "blockdiag_cp: no attention call went through 'blockdiag_cp' during this CP step, so every layer "
                "attended only inside its local shard. Load the model with attn_implementation='blockdiag_cp' "
                "(import hf_blockdiag_cp first) and run its forward inside train_ctx()"
            )

    return train_ctx, local, layout

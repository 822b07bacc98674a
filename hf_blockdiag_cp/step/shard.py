"""The pure shard step: one packed batch in, one rank's local batch out (no process group).

It derives document boundaries, pads to a multiple of 2·G, pre-shifts labels on the *global*
pack (so no target crosses a document boundary or a shard boundary), plans the layout and
slices every sequence-aligned tensor to the rank's rows. The result carries a `ShardInfo`
(the layout and a `PackFingerprint`), so it can run in DataLoader workers and be handed to
`make_cp_blockdiag_batch_and_ctx` as is.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.consensus import checksum
from ..comm.notice import warn_once
from ..config import CPConfig, default_config
from ..kernels import get_kernel
from ..planning import (
    DEFAULT_KERNEL_COST,
    KernelCost,
    Layout,
    document_ids_from_cu_seqlens,
    document_ids_from_position_ids,
    plan_layout,
    positions_from_document_ids,
    validate_document_ids,
)
from ..planning.segments import padding_before_a_token, validate_padding_at_end
from .targets import HostTargets

IGNORE_INDEX = -100
logger = logging.getLogger(__name__)

# Keys that only describe the full pack's attention; they must not reach the model on a shard.
_DROPPED_KEYS = ("attention_mask", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
# Per-token side streams [1, S]: padded like the primary stream (with 0, "text") and sharded with it.
_TOKEN_KEYS = ("token_type_ids", "mm_token_type_ids")


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
    if has_ids:
        _check_integer(key, t)
    return key, t


def _check_integer(key: str, t: torch.Tensor) -> None:
    """Raise unless `t` (ids, labels, positions) holds integers: a float or bool row would be cast
    silently here, and fail later where no message names it (the embedding's `indices` check)."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(
            f"batch[{key!r}] must hold integer ids; got dtype {t.dtype}. Build it with dtype=torch.long "
            f"(e.g. torch.tensor(ids, dtype=torch.long), or .long())"
        )


def token_id_range(input_ids: torch.Tensor) -> tuple[int, int]:
    """(smallest, largest) token id of a pack's `input_ids` (one min/max); raise if one is negative."""
    low, high = (int(v) for v in torch.aminmax(input_ids.reshape(-1)))
    if low < 0:
        raise ValueError(
            f"batch['input_ids'] holds a negative token id ({low}); token ids index the model's input embeddings "
            "(0 .. vocabulary size - 1). Labels take -100, input_ids never: pad input_ids with the pad token id"
        )
    return low, high


def check_token_ids(token_ids: tuple[int, int] | None, num_embeddings: int | None) -> None:
    """Raise ValueError if the pack's largest token id (`ShardInfo.token_ids`) has no row in the
    model's input embeddings (`num_embeddings` rows; None: not known, nothing to check)."""
    if token_ids is None or num_embeddings is None or token_ids[1] < num_embeddings:
        return
    raise ValueError(
        f"batch['input_ids'] holds token id {token_ids[1]}, but the model's input embeddings have {num_embeddings} "
        f"rows (ids 0..{num_embeddings - 1}): tokenize with the model's own tokenizer (and pad with an id below "
        f"{num_embeddings}), or resize the embeddings (model.resize_token_embeddings(len(tokenizer)))"
    )


ONE_DOCUMENT_NOTICE = "one document"  # the `warn_once` key of a row without boundaries


def _say_single_document_once() -> None:
    warn_once(logger, ONE_DOCUMENT_NOTICE, (
        "blockdiag_cp: a row without document_ids, position_ids or cu_seq_lens_q is treated as ONE document; "
        "a packed row that lost its boundaries looks the same (its documents attend to each other), so pass "
        "position_ids or document_ids for packs (warned once)"
    ))


def document_ids_of(batch: dict, seq_len: int) -> torch.Tensor:
    """Document ids [S] (1-based, 0 = padding) from document_ids, else position_ids restarts, else cu_seq_lens_q.
    document_ids and 2-D position_ids given together must mark the same documents (else ValueError)."""
    doc = _row(batch, "document_ids", seq_len)
    pos = _row(batch, "position_ids", seq_len, ndim_ok=(2, 3))
    for key, row in (("document_ids", doc), ("position_ids", pos)):
        if row is not None:
            _check_integer(key, row)
    positions = None  # position_ids on the host, when they are to be checked against document_ids
    if doc is not None and pos is not None and pos.ndim == 2:
        # Both rows in one copy to the host (the copy document_ids alone took before): no further sync.
        both = torch.stack([doc.reshape(-1).long(), pos.reshape(-1).long()]).cpu()
        ids, positions, source = both[0], both[1], "document_ids"
    elif doc is not None:
        ids, source = doc.reshape(-1).long().cpu(), "document_ids"
    elif pos is not None and pos.ndim == 2:
        ids, source = document_ids_from_position_ids(pos.reshape(-1).cpu()), "position_ids"
    elif batch.get("cu_seq_lens_q") is not None:
        ids, source = document_ids_from_cu_seqlens(batch["cu_seq_lens_q"], seq_len), "cu_seq_lens_q"
    elif pos is not None:
        raise ValueError("3-D position_ids (mRoPE) do not mark document boundaries; also pass document_ids [1,S] or cu_seq_lens_q")
    else:
        _say_single_document_once()
        ids, source = torch.ones(seq_len, dtype=torch.long), "input_ids"  # one document
    mask = _row(batch, "attention_mask", seq_len)
    if mask is not None:
        ids = torch.where(_right_padding(mask), ids, torch.zeros_like(ids))
    validate_padding_at_end(ids, source)  # first: a hole of padding also splits a document in two
    validate_document_ids(ids, source)
    if positions is not None:
        _check_positions_agree(ids, document_ids_from_position_ids(positions))
    return ids


def _check_positions_agree(ids: torch.Tensor, from_positions: torch.Tensor) -> None:
    """Raise if `position_ids` mark other document boundaries than `document_ids` (`ids`) among the
    pack's real tokens: document_ids would pick the documents and the model would still read the
    position_ids as given (its rotary positions), so one of the two is wrong."""
    real = (ids[1:] > 0) & (ids[:-1] > 0)
    by_ids = (ids[1:] != ids[:-1]) & real
    by_positions = (from_positions[1:] != from_positions[:-1]) & real
    differ = torch.nonzero(by_ids != by_positions)
    if differ.numel() == 0:
        return
    at = int(differ[0, 0]) + 1
    ids_say, positions_say = (("a new document starts", "continue by +1 (one document)") if bool(by_ids[at - 1])
                              else ("the same document goes on", "do not continue by +1 (a new document)"))
    raise ValueError(
        f"batch['document_ids'] and batch['position_ids'] disagree at position {at}: by document_ids {ids_say}, "
        f"but position_ids {positions_say} (the first of {differ.numel()} such positions). When both are given "
        "they must mark the same documents: position_ids restart at 0 at every document_ids boundary, and only there "
        "(or pass only one of them)"
    )


def _right_padding(mask: torch.Tensor) -> torch.Tensor:
    """`attention_mask` [1, S] as a bool row [S]; raise unless it is 1s then 0s (padding only at the end)."""
    flat = mask.reshape(-1).cpu()
    if not bool(((flat == 0) | (flat == 1)).all()):
        raise ValueError(
            "batch['attention_mask'] must hold only 1 (token) and 0 (padding); got values "
            f"{flat.unique()[:6].tolist()}"
        )
    keep = flat.bool()
    hole = padding_before_a_token(keep)
    if hole is not None:
        raise ValueError(
            f"batch['attention_mask'] has a 0 (padding) at position {hole[0]}, before a 1 (a token) at position "
            f"{hole[1]}; a packed row may be padded only at its end (right padding). Left-padded or holed rows are "
            "not packs: drop those zeros, and mark document boundaries with position_ids or document_ids"
        )
    return keep


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


@dataclass(frozen=True)
class PackFingerprint:
    """What every rank of a CP group must agree on for one pack (compared by one all-reduce)."""

    padded_length: int
    sequence_length: int
    document_ids: int  # checksums
    input_ids: int  # checksum of input_ids (hidden size for inputs_embeds)
    label_count: int  # targets of the whole pack
    layout: int


@dataclass(frozen=True)
class ShardInfo:
    """What a pre-sharded local batch (e.g. from a DataLoader worker) carries about its full pack."""

    layout: Layout
    fingerprint: PackFingerprint  # same on every rank of the group for the same pack
    cp_rank: int
    cp_size: int
    token_ids: tuple[int, int] | None = None  # (smallest, largest) id of the padded pack's input_ids; None: inputs_embeds
    targets: HostTargets | None = None  # where the shard has targets (host), with labels


def _local_labels(labels: torch.Tensor, loss_mask: torch.Tensor | None, layout: Layout, slots: torch.Tensor,
                  device: torch.device) -> tuple[dict[str, Any], int, HostTargets]:
    """The rank's label keys, the pack's target count N and the shard's targets on the host: labels masked
    by `loss_mask`, shifted on the global padded pack (`shifted_labels`), then sliced to the rank's `slots`."""
    lab = labels.reshape(-1).long().cpu()
    if loss_mask is not None:
        lab = torch.where(loss_mask.reshape(-1).cpu().bool(), lab, torch.full_like(lab, IGNORE_INDEX))
    shifted = shifted_labels(_pad_seq(lab, layout.padded_seq_len, IGNORE_INDEX, dim=0), layout.document_ids)
    global_targets = int((shifted != IGNORE_INDEX).sum())
    host_shifted = shifted[slots]
    local_shifted = host_shifted.unsqueeze(0).to(device)
    local = {"labels": local_shifted, "shift_labels": local_shifted, "loss_mask": local_shifted != IGNORE_INDEX,
             # I2: each rank's loss is (sum of its token losses) * G / N, so the mean over CP ranks is the non-CP loss.
             # A 0-d tensor, as the Trainer passes it: a Python number would be a constant in compiled graphs.
             "num_items_in_batch": torch.tensor(max(global_targets, 1) / layout.cp_size, dtype=torch.float32, device=device)}
    return local, global_targets, HostTargets.of(host_shifted, IGNORE_INDEX)


def local_rows(values: torch.Tensor, info: ShardInfo, fill=0) -> torch.Tensor:
    """A per-position row of the full pack (`[n]`: its first n positions, n at most the padded length) as
    the rank's shard `[1, L]`, laid out as `shard_batch` laid out the pack that `info` describes;
    positions past n get `fill`. For streams a caller computes on the full pack (e.g. per-target weights)."""
    layout = info.layout
    if values.ndim != 1 or values.numel() > layout.padded_seq_len:
        raise ValueError(f"values must be [n] with n <= {layout.padded_seq_len} (the padded pack); got shape "
                         f"{tuple(values.shape)}")
    padded = _pad_seq(values, layout.padded_seq_len, fill, dim=0)
    return padded[layout.slot_positions[info.cp_rank].to(padded.device)].unsqueeze(0)


def layout_kernel_cost(config: CPConfig) -> KernelCost:
    """The cost model the balanced layout uses: `config.kernel_cost`, else the named kernel's
    calibrated cost (`KernelRecord.cost`), else the default. `auto` resolves per device and
    dtype, which the host-side shard step does not know, so it takes the default. Every rank
    derives the same value from the same config (the layout is part of the pack fingerprint)."""
    if config.kernel_cost is not None:
        return config.kernel_cost
    if config.attn_backend != "auto":
        cost = get_kernel(config.attn_backend).cost
        if cost is not None:
            return cost
    return DEFAULT_KERNEL_COST


def _host_token_ids(primary_key: str, primary: torch.Tensor):
    """(The pack's one host copy of its `input_ids`, for its checksum; their (min, max)), or (None, None)
    for `inputs_embeds`: the id checks ride on the copy the step makes anyway."""
    if primary_key != "input_ids":
        return None, None
    host_ids = primary.reshape(-1).cpu()
    return host_ids, token_id_range(host_ids)


_HOST_ROWS = ("input_ids", "document_ids", "position_ids", "labels", "attention_mask")
_MASK_ROWS = ("attention_mask", "loss_mask")


def _host_rows(batch: dict, seq_len: int, device: torch.device, loss_mask) -> dict[str, torch.Tensor]:
    """The `[1, S]` integer rows the planning reads (ids, document ids, positions, labels, masks) on the host,
    copied together: one device-to-host copy (one host-device sync) a step, not one per row. A row of
    another shape, dtype or device is left out: it is read where it is checked, and its check names it."""
    rows = {key: batch.get(key) for key in _HOST_ROWS}
    rows["loss_mask"] = batch.get("loss_mask") if loss_mask is None else loss_mask
    kept = {key: t for key, t in rows.items() if _host_row_fits(key, t, seq_len, device)}
    if not kept:
        return {}
    stacked = torch.stack([t.reshape(-1).long() for t in kept.values()]).cpu()
    return {key: row.unsqueeze(0) for key, row in zip(kept, stacked)}


def _host_row_fits(key: str, t, seq_len: int, device: torch.device) -> bool:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != (1, seq_len) or t.device != device:
        return False
    integer = not (t.dtype.is_floating_point or t.dtype.is_complex)
    return integer and (t.dtype != torch.bool or key in _MASK_ROWS)


def _with_padding_id(token_ids: tuple[int, int], padding_token_id: int) -> tuple[int, int]:
    if padding_token_id < 0:
        raise ValueError(f"padding_token_id must be a non-negative token id; got {padding_token_id}")
    return min(token_ids[0], padding_token_id), max(token_ids[1], padding_token_id)


def shard_batch(
    batch: dict,
    cp_size: int,
    cp_rank: int,
    loss_mask: torch.Tensor | None = None,
    padding_token_id: int = 0,
    shard_primary: bool = True,
    config: CPConfig | None = None,
) -> dict:
    """Pure shard step (no process group): the local batch of rank `cp_rank` of `cp_size`.

    `config`'s layout settings (default: the process default, `configure_cp`) pick the layout
    (`plan_layout`), as in `make_cp_blockdiag_batch_and_ctx`. The result carries a
    `ShardInfo` under `SHARD_KEY`, so `make_cp_blockdiag_batch_and_ctx` accepts it as is;
    this is what lets a collator shard inside DataLoader worker processes.
    """
    if not isinstance(batch, dict) and not hasattr(batch, "keys"):
        raise TypeError(f"batch must be a dict of tensors; got {type(batch).__name__}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be in [0, cp_size={cp_size}); got {cp_rank}")
    primary_key, primary = _primary(batch)
    seq_len, device = primary.shape[1], primary.device
    host = _host_rows(batch, seq_len, device, loss_mask)
    host_ids, token_ids = _host_token_ids(primary_key, host.get(primary_key, primary))
    ids = document_ids_of({**batch, **host}, seq_len)
    labels = _row(batch, "labels", seq_len)
    if labels is not None:
        _check_integer("labels", labels)
    if loss_mask is None:
        loss_mask = batch.get("loss_mask")
    if loss_mask is not None:
        loss_mask = _row({"loss_mask": loss_mask}, "loss_mask", seq_len)
        if labels is None:
            raise ValueError("loss_mask was given without labels")
    config = default_config() if config is None else config
    if not isinstance(config, CPConfig):
        raise TypeError(f"config must be a CPConfig or None; got {type(config).__name__}")
    layout = plan_layout(ids, cp_size, config.layout, tolerance=config.balance_tolerance,
                         kernel_cost=layout_kernel_cost(config))
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

    global_targets, targets = 0, None
    if labels is not None:
        label_keys, global_targets, targets = _local_labels(host.get("labels", labels), host.get("loss_mask", loss_mask),
                                                            layout, slots, device)
        local.update(label_keys)
    local["use_cache"] = False
    primary_sum = primary.shape[-1] if host_ids is None else checksum(host_ids)
    if token_ids is not None and s_pad > seq_len:  # the padding the step added is fed to the embeddings too
        token_ids = _with_padding_id(token_ids, padding_token_id)
    fingerprint = PackFingerprint(
        s_pad, seq_len, checksum(padded_ids), primary_sum, global_targets, checksum(layout.slot_positions)
    )
    local[SHARD_KEY] = ShardInfo(layout, fingerprint, cp_rank, cp_size, token_ids, targets)
    return local

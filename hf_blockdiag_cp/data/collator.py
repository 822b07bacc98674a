"""Packing collator: the documents of one pack in, one fixed-size packed row out.

The output follows Hugging Face's packed convention (what `DataCollatorWithFlattening`
emits) plus `document_ids`, padded to exactly `max_tokens` so every pack has one shape
(compile caches stay warm). With `cp_rank` set it also runs the pure shard step, so the
sharding happens in DataLoader worker processes; the collator holds only plain settings
(no process group), so it pickles.

Choosing *which* documents form a pack is the sampler's job (`hf_blockdiag_cp.data`).
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Sequence

import torch

from ..comm.notice import warn_once
from ..config import CPConfig
from ..step.shard import IGNORE_INDEX, shard_batch
from .packing import OVERSIZE_POLICIES, OversizeCount, oversize_policy

__all__ = ["OVERSIZE_POLICIES", "BlockdiagCPCollator"]

logger = logging.getLogger(__name__)
_COLLATORS = itertools.count()  # each collator's own key for its split warning


def warn_split_documents(count: OversizeCount, total: int, max_tokens: int) -> None:
    """A WARNING (once per run for the same numbers, on rank 0) that `count` of `total` documents are
    cut into pack-sized pieces (`oversize="split"`)."""
    warn_once(logger, ("split documents", count, total, max_tokens), (
        f"blockdiag_cp: {count.documents} of {total} documents ({count.tokens} tokens) are longer than "
        f"max_tokens={max_tokens} and are split into pieces of at most {max_tokens} tokens; each piece is trained as "
        "its own document (no attention across a cut). Pass oversize='raise' to refuse them instead, or raise max_tokens"
    ))


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return value


def _token_row(example_index: int, key: str, value) -> torch.Tensor:
    """A document's `input_ids` or `labels` as a 1-D int64 CPU tensor."""
    try:
        row = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"examples[{example_index}][{key!r}] must be a list or 1-D tensor of token ids; {exc}") from None
    if row.ndim != 1:
        raise ValueError(f"examples[{example_index}][{key!r}] must be 1-D; got shape {tuple(row.shape)}")
    if row.numel() and (row.dtype.is_floating_point or row.dtype.is_complex or row.dtype == torch.bool):
        raise ValueError(f"examples[{example_index}][{key!r}] must hold integer token ids; got dtype {row.dtype}")
    return row.to(device="cpu", dtype=torch.long)


class BlockdiagCPCollator:
    """Collate the documents of ONE pack into `input_ids`, `labels`, `position_ids`, `document_ids` [1, max_tokens].

    - `labels` are unshifted (the shard step shifts them per document); an example without
      `labels` is trained on all its tokens; padding is -100.
    - `position_ids` restart at 0 for every document (and for the padding run).
    - `document_ids` are 1-based in pack order; 0 marks padding.
    - A document longer than `max_tokens` never fits one pack, so a call raises ValueError naming it
      (with either `oversize`, and without a split warning first). Splitting is the sampler's:
      `PackedBatchSampler` (`packed_dataloader`) with `oversize="split"` cuts such documents into
      `max_tokens`-sized pieces, gives each piece its own pack and counts them; `documents()` cuts
      them alone (and warns at the first one).
    - `cp_rank` set: return `shard_batch(pack, cp_size, cp_rank)`, this rank's local batch,
      which `make_cp_blockdiag_batch_and_ctx` accepts as is, laid out by `cp_config`'s layout
      (default: contiguous chunks).

    Keys other than `input_ids` and `labels` are ignored.
    """

    def __init__(
        self,
        max_tokens: int,
        pad_token_id: int = 0,
        cp_size: int = 1,
        cp_rank: int | None = None,
        oversize: str = "split",
        cp_config: CPConfig | None = None,
    ):
        _positive_int("max_tokens", max_tokens)
        self._split_notice = ("collator split", next(_COLLATORS))  # kept when pickled into DataLoader workers
        if cp_config is not None and not isinstance(cp_config, CPConfig):
            raise TypeError(f"cp_config must be a CPConfig or None; got {type(cp_config).__name__}")
        _positive_int("cp_size", cp_size)
        if max_tokens % (2 * cp_size):
            raise ValueError(
                f"max_tokens must be a multiple of 2*cp_size = {2 * cp_size} (so packs shard evenly); got {max_tokens}"
            )
        if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
            raise ValueError(f"pad_token_id must be a non-negative integer; got {pad_token_id!r}")
        if cp_rank is not None and (isinstance(cp_rank, bool) or not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size):
            raise ValueError(f"cp_rank must be None or an integer in [0, cp_size={cp_size}); got {cp_rank!r}")
        self.oversize = oversize_policy(oversize)
        self.max_tokens = max_tokens
        self.pad_token_id = pad_token_id
        self.cp_config = cp_config
        self.cp_size = cp_size
        self.cp_rank = cp_rank

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(max_tokens={self.max_tokens}, pad_token_id={self.pad_token_id}, "
            f"cp_size={self.cp_size}, cp_rank={self.cp_rank}, oversize={self.oversize!r})"
        )

    def documents(self, examples: Sequence[dict], *, split: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`(input_ids, labels)` per document of the pack, oversized examples split (or rejected).
        `split=False` (what `pack` passes): an oversized example raises whatever `oversize` says, since
        its pieces could never fit the one pack (`_cannot_fit`)."""
        if isinstance(examples, dict) or not isinstance(examples, Sequence):
            raise TypeError(f"examples must be a list of dicts (the documents of one pack); got {type(examples).__name__}")
        if not examples:
            raise ValueError("examples is empty: a pack needs at least one document")
        docs = []
        for i, example in enumerate(examples):
            if not hasattr(example, "keys") or "input_ids" not in example:
                raise ValueError(f"examples[{i}] must be a dict with 'input_ids'; got {type(example).__name__}")
            ids = _token_row(i, "input_ids", example["input_ids"])
            if bool((ids < 0).any()):
                raise ValueError(f"examples[{i}]['input_ids'] must be non-negative token ids")
            labels = example.get("labels")
            labels = ids if labels is None else _token_row(i, "labels", labels)
            if labels.numel() != ids.numel():
                raise ValueError(
                    f"examples[{i}]['labels'] has {labels.numel()} entries; expected {ids.numel()} (one per input_ids token)"
                )
            if ids.numel() > self.max_tokens:
                if not split:
                    raise self._cannot_fit(i, ids.numel())
                self._oversized(i, ids.numel())
            for start in range(0, ids.numel(), self.max_tokens):
                docs.append((ids[start : start + self.max_tokens], labels[start : start + self.max_tokens]))
        return docs

    def _oversized(self, index: int, length: int) -> None:
        """Raise (oversize="raise") or warn at this collator's first split (rank 0; a sampler counts them all)."""
        if self.oversize == "raise":
            raise ValueError(
                f"examples[{index}] has {length} tokens, more than max_tokens={self.max_tokens} (oversize='raise'); "
                "raise max_tokens, filter long documents out, or pass oversize='split'"
            )
        warn_once(logger, self._split_notice, (
            f"blockdiag_cp: examples[{index}] has {length} tokens, more than max_tokens={self.max_tokens}: it is split "
            "into pieces, each trained as its own document (warned once; PackedBatchSampler counts every split "
            "document); pass oversize='raise' to refuse such documents"
        ))

    def _cannot_fit(self, index: int, length: int) -> ValueError:
        """The error of `pack` for an example longer than the pack: split or not, it cannot fit ONE pack, so
        it is refused before any split warning (the sampler is what gives each piece its own pack)."""
        if self.oversize == "raise":
            return ValueError(
                f"examples[{index}] has {length} tokens, more than max_tokens={self.max_tokens} (oversize='raise'); "
                "raise max_tokens, filter long documents out, or pass oversize='split'"
            )
        return ValueError(
            f"examples[{index}] has {length} tokens, more than max_tokens={self.max_tokens}: a call collates ONE pack, "
            "and the pieces of a split document never fit one (oversize='split' splits documents in "
            "hf_blockdiag_cp.PackedBatchSampler / packed_dataloader, which give each piece its own pack). Collate "
            "through packed_dataloader, raise max_tokens, or cut the document first"
        )

    def pack(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        """The full pack (not sharded): tensors [1, max_tokens]. An example longer than `max_tokens`
        raises ValueError naming it (whatever `oversize` says: its pieces would not fit one pack)."""
        docs = self.documents(examples, split=False)
        total = sum(ids.numel() for ids, _ in docs)
        if total > self.max_tokens:
            raise ValueError(
                f"the {len(examples)} examples hold {total} tokens, more than max_tokens={self.max_tokens}: a call "
                "collates ONE pack (each piece of a split document counts). Choose the documents of each pack with "
                "hf_blockdiag_cp.PackedBatchSampler / packed_dataloader"
            )
        pad = self.max_tokens - total
        lengths = [ids.numel() for ids, _ in docs] + [pad]
        input_ids = torch.cat([ids for ids, _ in docs] + [torch.full((pad,), self.pad_token_id, dtype=torch.long)])
        labels = torch.cat([lab for _, lab in docs] + [torch.full((pad,), IGNORE_INDEX, dtype=torch.long)])
        positions = torch.cat([torch.arange(n) for n in lengths])
        doc_ids = torch.repeat_interleave(torch.arange(1, len(docs) + 1), torch.tensor(lengths[:-1], dtype=torch.long))
        doc_ids = torch.cat([doc_ids, torch.zeros(pad, dtype=torch.long)])
        return {
            "input_ids": input_ids.unsqueeze(0),
            "labels": labels.unsqueeze(0),
            "position_ids": positions.unsqueeze(0),
            "document_ids": doc_ids.unsqueeze(0),
        }

    def shard(self, full: dict[str, torch.Tensor]) -> dict[str, Any]:
        """A full pack (`pack`) as this collator's CP rank's local batch (as is without a `cp_rank`)."""
        if self.cp_rank is None:
            return full
        config = self.cp_config if self.cp_config is not None else CPConfig()  # default: contiguous chunks
        return shard_batch(full, self.cp_size, self.cp_rank, padding_token_id=self.pad_token_id, config=config)

    def __call__(self, examples: Sequence[dict]) -> dict[str, Any]:
        return self.shard(self.pack(examples))

"""Packed batches for the parity tests: named document layouts, for any CP size."""

from __future__ import annotations

import torch
from transformers import DataCollatorWithFlattening

from reference import make_docs

LAYOUTS = ("straddle", "span_all", "padding_rank", "single_tokens", "single_doc", "collator")


def layout_lengths(name: str, world_size: int) -> tuple[list[int], int]:
    """Document lengths and the number of padding tokens (document id 0) at the end of the pack."""
    g = world_size
    if name in ("straddle", "collator"):
        return [5, 7, 3, 9, 4], 0
    if name == "span_all":  # one document over every rank (three or more when G >= 3)
        return [2, 8 * g + 1, 3], 0
    if name == "padding_rank":  # 3G real tokens then 3G padding: the last rank holds only padding
        return [g, 2 * g], 3 * g
    if name == "single_tokens":
        return [1, 3, 1, 1, 5, 1, 2, 1, 4, 1], 0
    if name == "single_doc":
        return [4 * g + 3], 0
    raise ValueError(name)


def make_pack(name: str, world_size: int, seed: int = 1, pad_token_id: int = 0):
    """(documents, packed batch in Hugging Face's flattened convention)."""
    lengths, n_pad = layout_lengths(name, world_size)
    docs = make_docs(lengths, seed)
    if name == "collator":
        batch = DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d.tolist()} for d in docs])
        return docs, dict(batch)
    ids = torch.cat(docs + [torch.full((n_pad,), pad_token_id)])[None]
    labels = ids.clone()
    labels[0, ids.shape[1] - n_pad:] = -100
    batch = {"input_ids": ids, "labels": labels}
    if n_pad:
        doc_ids = torch.cat([torch.full((n,), i + 1) for i, n in enumerate(lengths)] + [torch.zeros(n_pad, dtype=torch.long)])
        batch["document_ids"] = doc_ids[None]
    else:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    return docs, batch

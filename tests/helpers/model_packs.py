"""Packs of the model-coverage tests: per family, the documents, the packed batch, the
per-document extra inputs of the reference and whether the primary input is sharded; Qwen2-VL
text-image-text packs; and the stock model run on a whole pack (the reference for packs whose
RoPE choice is pack-wide)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.model_zoo import IMAGE_GRID, LONGROPE_ORIGINAL_CONTEXT, mrope_positions, vl_image_docs
from helpers.packs import make_pack
from helpers.reference import make_docs


def pack_from_docs(docs, extra_rows=None):
    ids = torch.cat(docs)[None]
    batch = {"input_ids": ids, "labels": ids.clone(), "document_ids": document_ids_from_lengths([d.numel() for d in docs])[None]}
    if extra_rows is not None:
        batch.update(extra_rows)
    return batch


def family_pack(family: str, world_size: int, mixed_longrope: bool = False, model=None):
    """(docs, packed batch, per-document extra reference inputs, shard_primary)."""
    if family == "phi3":
        # Every document is longer than the original context (LongRoPE's long factors for each
        # of them run alone), and at G = 4 rank 0 holds only positions 0..7 of the first one:
        # its own max(position_ids) would pick the short factors.
        lengths = [3, 12, 5, 9] if mixed_longrope else [9, 12, 11]
        assert max(lengths) > LONGROPE_ORIGINAL_CONTEXT
        docs = make_docs(lengths, seed=3)
        return docs, pack_from_docs(docs), None, True
    if family == "qwen2_vl":
        docs = make_docs([5, 7, 3, 9, 4], seed=2)
        positions = torch.cat([mrope_positions(d.numel()) for d in docs], dim=-1)
        extra = [{"position_ids": mrope_positions(d.numel())} for d in docs]
        return docs, pack_from_docs(docs, {"position_ids": positions}), extra, False
    if family == "qwen2_vl_image":
        return vl_image_pack(model)
    docs, batch = make_pack("straddle", world_size)
    return docs, batch, None, True


def vl_image_pack(model):
    """Text-image-text documents. The pack's 3-D positions are every document's stock
    `get_rope_index`, concatenated (what a user's collator does); the reference instead lets
    the stock model compute them from mm_token_type_ids, document by document."""
    items = vl_image_docs()
    grid = torch.tensor([IMAGE_GRID])
    rope_index = model.model.get_rope_index
    positions = torch.cat([rope_index(ids[None], types[None], image_grid_thw=grid)[0] for ids, types, _ in items], dim=-1)
    docs = [ids for ids, _, _ in items]
    batch = pack_from_docs(docs, {
        "position_ids": positions,
        "pixel_values": torch.cat([px for _, _, px in items]),
        "image_grid_thw": grid.repeat(len(items), 1),
    })
    extra = [{"pixel_values": px, "image_grid_thw": grid, "mm_token_type_ids": types[None]} for _, types, px in items]
    return docs, batch, extra, False


def packed_stock_reference(ref, docs):
    """The stock model (eager) on the whole pack with restarting position ids: what a non-CP
    packed run computes, including its pack-wide dynamic-RoPE choice."""
    ref.zero_grad(set_to_none=True)
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(d.numel()) for d in docs])[None]
    logits = ref(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    total, count, start = 0.0, 0, 0
    for d in docs:
        n = d.numel()
        total = total + F.cross_entropy(logits[start : start + n - 1].float(), d[1:], reduction="sum")
        count, start = count + n - 1, start + n
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}

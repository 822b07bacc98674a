"""Packed batches for the parity tests: named document layouts, for any CP size (defined in
`helpers.reference`, next to the reference that runs them), and the long pack of the token-mixer
tests."""

import torch

from hf_blockdiag_cp.planning import document_ids_from_lengths
from helpers.reference import LAYOUTS, layout_lengths, make_docs, make_pack  # noqa: F401 (re-exported)

LOCAL = 64  # rows per rank of the long pack


def long_pack(world_size: int):
    """1-token documents, then one document over three ranks (G >= 3, 148 tokens: three chunks of 64 of
    the delta rule; both ranks at G = 2, 116 tokens), short documents, then 3 padding tokens; `LOCAL`
    rows per rank."""
    total = LOCAL * world_size
    long_doc = min(2 * LOCAL + 20, total - 12)
    lengths = [1, 3, long_doc, 1]
    rest = total - 3 - sum(lengths)
    lengths += [12] * (rest // 12) + ([rest % 12] if rest % 12 else [])
    docs = make_docs(lengths, seed=4)
    ids = torch.cat(docs + [torch.zeros(3, dtype=torch.long)])[None]
    labels = ids.clone()
    labels[0, -3:] = -100
    return docs, {"input_ids": ids, "labels": labels, "document_ids": document_ids_from_lengths(lengths, ids.shape[1])[None]}

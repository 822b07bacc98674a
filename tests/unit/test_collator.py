"""The packing collator, fed by the packed sampler: every document token lands exactly once,
boundaries and padding are right, labels never cross a document after the library's shift,
sharded outputs reassemble the full pack, and the collator works in DataLoader workers."""

from __future__ import annotations

import logging
import pickle
from collections import Counter

import datasets
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_blockdiag_cp.config import CPConfig
from hf_blockdiag_cp.planning import PAIR_COUNT
from hf_blockdiag_cp.step import shard_batch
from hf_blockdiag_cp.data.collator import BlockdiagCPCollator
from hf_blockdiag_cp.data import PackedBatchSampler, packed_dataloader

IGNORE = -100
PAD = 0


def make_docs(n: int, max_len: int, seed: int = 0, with_labels: bool = True) -> list[dict]:
    """Documents whose tokens are globally unique (so a token identifies its document and place).

    Every third document has labels with its first tokens masked (a prompt), others none.
    """
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    docs, next_token = [], 1
    for i, n_tok in enumerate(lengths):
        ids = list(range(next_token, next_token + n_tok))
        next_token += n_tok
        doc = {"input_ids": ids}
        if with_labels and i % 3 == 0:
            doc["labels"] = [IGNORE if j < n_tok // 3 else t for j, t in enumerate(ids)]
        docs.append(doc)
    return docs


def reference_shift(pack_docs: list[tuple[list[int], list[int]]], total: int) -> list[int]:
    """Per document: position p predicts label p+1; the last token of a document and padding predict nothing."""
    out = []
    for _, labels in pack_docs:
        out += labels[1:] + [IGNORE]
    return out + [IGNORE] * (total - len(out))


def doc_runs(document_ids: torch.Tensor) -> list[tuple[int, int, int]]:
    """(id, start, stop) of every run of equal ids."""
    ids = document_ids.reshape(-1).tolist()
    runs, start = [], 0
    for p in range(1, len(ids) + 1):
        if p == len(ids) or ids[p] != ids[start]:
            runs.append((ids[start], start, p))
            start = p
    return runs


def expected_pieces(docs: list[dict], max_tokens: int) -> dict[int, tuple[list[int], list[int]]]:
    """First token of every piece -> (input_ids, labels) of that piece (oversized documents split)."""
    pieces = {}
    for doc in docs:
        ids = doc["input_ids"]
        labels = doc.get("labels", ids)
        for s in range(0, len(ids), max_tokens):
            pieces[ids[s]] = (ids[s : s + max_tokens], labels[s : s + max_tokens])
    return pieces


def check_pack(pack: dict, pieces: dict, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Assert shape, boundaries, positions and padding of one full pack; return its documents."""
    for key in ("input_ids", "labels", "position_ids", "document_ids"):
        assert pack[key].shape == (1, max_tokens), key
        assert pack[key].dtype == torch.long, key
    ids, labels, pos = (pack[k].reshape(-1).tolist() for k in ("input_ids", "labels", "position_ids"))
    runs = doc_runs(pack["document_ids"])
    real = [r for r in runs if r[0] != 0]
    assert [r[0] for r in real] == list(range(1, len(real) + 1)), "document ids must be 1..n in pack order"
    pads = [r for r in runs if r[0] == 0]
    assert len(pads) <= 1 and (not pads or pads[0][2] == max_tokens), "padding only at the tail"
    out = []
    for doc_id, start, stop in runs:
        assert pos[start:stop] == list(range(stop - start)), "position_ids restart per document"
        if doc_id == 0:
            assert ids[start:stop] == [PAD] * (stop - start)
            assert labels[start:stop] == [IGNORE] * (stop - start)
            continue
        piece = pieces[ids[start]]
        assert (ids[start:stop], labels[start:stop]) == piece, "a document must be one whole input piece"
        out.append(piece)
    return out


@pytest.mark.parametrize("source", ["list", "datasets"])
def test_epoch_covers_every_token_once_with_boundaries_labels_and_efficiency(source):
    max_tokens = 64
    docs = make_docs(300, 150, seed=1)  # some longer than max_tokens: split into pieces
    dataset = docs if source == "list" else datasets.Dataset.from_list(
        [{"input_ids": d["input_ids"], "labels": d.get("labels", d["input_ids"])} for d in docs]
    )
    buffer_size = 100
    loader = packed_dataloader(dataset, max_tokens, buffer_size=buffer_size, seed=3)
    pieces = expected_pieces(docs, max_tokens)
    seen = Counter()
    n_packs = real = half_full = 0
    for pack in loader:
        pack_docs = check_pack(pack, pieces, max_tokens)
        shifted = shard_batch(pack, 1, 0)["shift_labels"].reshape(-1).tolist()
        assert shifted == reference_shift(pack_docs, max_tokens), "labels crossed a document boundary"
        seen.update(t for ids, _ in pack_docs for t in ids)
        pack_real = int((pack["document_ids"] > 0).sum())
        real += pack_real
        half_full += 2 * pack_real <= max_tokens
        n_packs += 1
    all_tokens = [t for d in docs for t in d["input_ids"]]
    assert seen == Counter(all_tokens), "every token of every document exactly once per epoch"
    assert any(len(d["input_ids"]) > max_tokens for d in docs)
    stats = loader.packing_stats
    assert (stats.packs, stats.real_tokens, stats.pack_tokens) == (n_packs, real, n_packs * max_tokens)
    assert stats.efficiency == pytest.approx(len(all_tokens) / (n_packs * max_tokens))
    # Each buffer is packed by first-fit decreasing, which leaves at most one pack at most half full.
    assert half_full <= -(-len(docs) // buffer_size), half_full


def test_lists_and_tensors_give_the_same_pack_without_labels_meaning_all_tokens():
    collator = BlockdiagCPCollator(16, pad_token_id=7)
    as_lists = collator([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5], "labels": [IGNORE, 5]}])
    as_tensors = collator(
        [{"input_ids": torch.tensor([1, 2, 3])}, {"input_ids": torch.tensor([4, 5]), "labels": torch.tensor([IGNORE, 5])}]
    )
    for key in as_lists:
        assert torch.equal(as_lists[key], as_tensors[key]), key
    assert as_lists["input_ids"].tolist() == [[1, 2, 3, 4, 5] + [7] * 11]
    assert as_lists["labels"].tolist() == [[1, 2, 3, IGNORE, 5] + [IGNORE] * 11]
    assert as_lists["position_ids"].tolist() == [[0, 1, 2, 0, 1] + list(range(11))]
    assert as_lists["document_ids"].tolist() == [[1, 1, 1, 2, 2] + [0] * 11]


def test_exactly_full_pack_has_no_padding_and_empty_documents_are_skipped():
    pack = BlockdiagCPCollator(8)([{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": []}, {"input_ids": [6, 7, 8]}])
    assert pack["document_ids"].tolist() == [[1, 1, 1, 1, 1, 2, 2, 2]]


def test_oversize_split_and_raise(caplog):
    long_doc = {"input_ids": list(range(1, 21))}
    for spelling in ("raise", "reject"):  # "reject": the earlier spelling
        with pytest.raises(ValueError, match=r"examples\[1\] has 20 tokens, more than max_tokens=8 \(oversize='raise'\)"):
            BlockdiagCPCollator(8, oversize=spelling)([{"input_ids": [1]}, long_doc])
    splitter = BlockdiagCPCollator(8, oversize="split")
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        pieces = splitter.documents([long_doc])
    assert [r.levelno for r in caplog.records if "examples[0] has 20 tokens, more than max_tokens=8: it is split" in
            r.getMessage()] == [logging.WARNING], caplog.text
    assert [p[0].tolist() for p in pieces] == [list(range(1, 9)), list(range(9, 17)), list(range(17, 21))]
    # Collating it raises (its pieces never fit one pack), saying where splitting happens.
    with pytest.raises(ValueError, match=r"examples\[0\] has 20 tokens, more than max_tokens=8: a call collates ONE "
                                         r"pack.*PackedBatchSampler"):
        splitter([long_doc])
    # The sampler gives each piece its own pack (the short remainder may share one).
    sampler = PackedBatchSampler([20, 3], 8, shuffle=False)
    loader = packed_dataloader([long_doc, {"input_ids": [30, 31, 32]}], 8, shuffle=False)
    assert len(sampler) == len(loader) == 3
    packs = [p["input_ids"].tolist()[0] for p in loader]
    assert packs == [list(range(1, 9)), list(range(9, 17)), [17, 18, 19, 20, 30, 31, 32, 0]]
    with pytest.raises(ValueError, match=r"document 0 has 20 tokens, more than max_tokens=8 \(oversize='raise'; "
                                         r"2 of 3 documents are longer\)"):
        PackedBatchSampler([20, 3, 9], 8, oversize="raise")


def test_the_collator_warns_at_its_first_split_only(caplog):
    collator = BlockdiagCPCollator(8)
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        collator.documents([{"input_ids": list(range(1, 12))}])
        collator.documents([{"input_ids": list(range(1, 30))}, {"input_ids": list(range(1, 10))}])
    assert len([r for r in caplog.records if "it is split" in r.getMessage()]) == 1, caplog.text


def test_split_documents_warn_once_per_run_with_their_count_and_tokens(caplog):
    """Lengths used by no other test, so this process has not warned about them yet."""
    lengths = [5, 41, 17, 16, 17, 3, 90]
    over = [n for n in lengths if n > 16]
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        sampler = PackedBatchSampler(lengths, 16, seed=1)
        again = PackedBatchSampler(lengths, 16, seed=2)  # e.g. a second dataloader over the same data
        for epoch in range(2):
            sampler.set_epoch(epoch)
            list(sampler)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    expected = (f"blockdiag_cp: {len(over)} of {len(lengths)} documents ({sum(over)} tokens) are longer than "
                "max_tokens=16 and are split")
    assert [m for m in messages if "max_tokens=16" in m] == [m for m in messages if m.startswith(expected)], messages
    assert len([m for m in messages if m.startswith(expected)]) == 1, messages
    assert (sampler.oversized.documents, sampler.oversized.tokens) == (again.oversized.documents, again.oversized.tokens)
    assert (sampler.oversized.documents, sampler.oversized.tokens) == (len(over), sum(over))
    # Each split document's pieces hold exactly its tokens: full pieces, then the remainder.
    pieces = [item for pack in sampler.epoch_packs() for item in pack if not isinstance(item, int)]
    assert sorted((p.index, p.start, p.stop) for p in pieces) == sorted(
        (i, s, min(s + 16, n)) for i, n in enumerate(lengths) if n > 16 for s in range(0, n, 16)
    )


def test_too_many_documents_for_one_pack():
    with pytest.raises(ValueError, match=r"the 2 examples hold 10 tokens, more than max_tokens=8"):
        BlockdiagCPCollator(8)([{"input_ids": [1] * 5}, {"input_ids": [2] * 5}])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": 12, "cp_size": 4}, r"max_tokens must be a multiple of 2\*cp_size = 8"),
        ({"max_tokens": 16, "cp_size": 2, "cp_rank": 2}, r"cp_rank must be None or an integer in \[0, cp_size=2\)"),
        ({"max_tokens": 16, "oversize": "truncate"}, "oversize must be one of 'split', 'raise'"),
        ({"max_tokens": 16, "pad_token_id": -1}, "pad_token_id must be a non-negative integer"),
        ({"max_tokens": 16, "cp_size": 0}, "cp_size must be a positive integer"),
    ],
)
def test_invalid_arguments_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlockdiagCPCollator(**kwargs)


@pytest.mark.parametrize(
    "examples, message",
    [
        ([], "examples is empty"),
        ([{"labels": [1]}], r"examples\[0\] must be a dict with 'input_ids'"),
        ([{"input_ids": [1, 2]}, {"input_ids": [1, 2], "labels": [1]}], r"examples\[1\]\['labels'\] has 1 entries; expected 2"),
        ([{"input_ids": [[1, 2]]}], r"examples\[0\]\['input_ids'\] must be 1-D"),
        ([{"input_ids": [1.5, 2.0]}], r"examples\[0\]\['input_ids'\] must hold integer token ids"),
        ([{"input_ids": [1, -3]}], r"examples\[0\]\['input_ids'\] must be non-negative"),
    ],
)
def test_malformed_examples_name_the_field(examples, message):
    with pytest.raises(ValueError, match=message):
        BlockdiagCPCollator(16)(examples)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), cp_size=st.integers(1, 4), layout=st.sampled_from(["contiguous", "balanced"]))
def test_sharded_outputs_reassemble_the_full_pack(seed, cp_size, layout):
    max_tokens = 48
    docs = make_docs(12, 20, seed=seed)
    fits = [sum(len(d["input_ids"]) for d in docs[:n]) <= max_tokens for n in range(1, len(docs) + 1)]
    examples = docs[: fits.index(False) if False in fits else len(docs)]  # the documents of one pack
    # PAIR_COUNT: a balanced layout permutes even packs shorter than one kernel tile.
    config = CPConfig(layout=layout, kernel_cost=PAIR_COUNT)
    full = BlockdiagCPCollator(max_tokens)(examples)
    pack_docs = [(d["input_ids"], d.get("labels", d["input_ids"])) for d in examples]
    want_shift = torch.tensor(reference_shift(pack_docs, max_tokens))
    got = {key: torch.full((max_tokens,), -1) for key in ("input_ids", "position_ids", "document_ids", "labels")}
    targets = 0
    for rank in range(cp_size):
        local = BlockdiagCPCollator(max_tokens, cp_size=cp_size, cp_rank=rank, cp_config=config)(examples)
        positions = local["blockdiag_cp_shard"].layout.token_indices[rank]
        assert bool((positions >= 0).all()), "max_tokens is a multiple of 2*cp_size: no layout padding"
        for key in got:
            got[key][positions] = local[key].reshape(-1)
        targets += int(local["loss_mask"].sum())
        assert local["num_items_in_batch"] * cp_size == int((want_shift != IGNORE).sum())
    for key in ("input_ids", "position_ids", "document_ids"):
        assert torch.equal(got[key], full[key].reshape(-1)), key
    assert torch.equal(got["labels"], want_shift), "sharded labels are the per-document shift of the full pack"
    assert targets == int((want_shift != IGNORE).sum())


def test_collator_pickles_and_shards_in_worker_processes():
    max_tokens, cp_size = 32, 2
    docs = make_docs(40, 30, seed=5)
    collator = BlockdiagCPCollator(max_tokens, cp_size=cp_size, cp_rank=1)
    clone = pickle.loads(pickle.dumps(collator))
    out, out_clone = collator(docs[:1]), clone(docs[:1])
    assert torch.equal(out["input_ids"], out_clone["input_ids"])
    assert out["blockdiag_cp_shard"].fingerprint == out_clone["blockdiag_cp_shard"].fingerprint

    def run(num_workers):
        loader = packed_dataloader(docs, max_tokens, cp_size=cp_size, cp_rank=1, num_workers=num_workers, seed=2)
        return list(loader)

    in_process, in_workers = run(0), run(2)
    volume = -(-sum(len(d["input_ids"]) for d in docs) // max_tokens)  # every token lands in some pack
    assert volume > 2, "more packs than workers, so both workers collate"
    assert len(in_process) == len(in_workers) >= volume
    for a, b in zip(in_process, in_workers):
        assert a.keys() == b.keys()
        for key in ("input_ids", "position_ids", "document_ids", "labels", "shift_labels"):
            assert torch.equal(a[key], b[key]), key
        assert a["blockdiag_cp_shard"].fingerprint == b["blockdiag_cp_shard"].fingerprint
        assert torch.equal(a["blockdiag_cp_shard"].layout.slot_positions, b["blockdiag_cp_shard"].layout.slot_positions)


@pytest.mark.parametrize("shard_primary", [True, False])
@pytest.mark.parametrize("strategy", ["contiguous", "balanced"])
def test_token_side_streams_are_padded_and_sharded_with_the_primary(shard_primary, strategy):
    """mm_token_type_ids / token_type_ids travel with input_ids: padded to the layout's length with 0,
    and on every rank the same positions as input_ids (or the whole padded pack without sharding)."""
    cp_size, seq_len = 3, 13  # 13 tokens over 3 ranks: the layout pads
    ids = torch.arange(1, seq_len + 1)[None]
    types = (torch.arange(seq_len) % 3 == 1).long()[None]
    batch = {"input_ids": ids, "position_ids": torch.tensor([list(range(6)) + list(range(7))]),
             "mm_token_type_ids": types, "token_type_ids": 1 - types}
    for rank in range(cp_size):
        local = shard_batch(batch, cp_size, rank, shard_primary=shard_primary, config=CPConfig(layout=strategy))
        layout = local["blockdiag_cp_shard"].layout
        rows = layout.slot_positions[rank] if shard_primary else torch.arange(layout.padded_seq_len)
        padded_types = torch.cat([types[0], torch.zeros(layout.padded_seq_len - seq_len, dtype=torch.long)])
        assert layout.padded_seq_len > seq_len
        assert torch.equal(local["mm_token_type_ids"][0], padded_types[rows])
        real = rows < seq_len
        assert torch.equal(local["token_type_ids"][0][real], 1 - padded_types[rows][real])
        assert local["input_ids"].shape[-1] == local["mm_token_type_ids"].shape[-1]

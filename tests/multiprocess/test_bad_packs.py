"""Malformed packs are refused with a ValueError that names the field, through the pure shard step
and through the shard step of a real 2-rank gloo group (every rank raises; nothing hangs).

Document ids are 1-based and padding (0) may only follow the last real token, so a 0-based
pack can never be mistaken for a padded one; the same rule holds whichever field the ids
come from (`document_ids`, `cu_seq_lens_q`), and an `attention_mask` may only pad the end (its
errors name the mask, not document ids)."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import hf_blockdiag_cp as bdcp

IDS = torch.arange(1, 9)[None]  # input ids of an 8-token pack

MALFORMED = {
    "zero-based document ids": ({"document_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]])}, "document_ids"),
    "leading padding": ({"document_ids": torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]])}, "document_ids"),
    "interior padding": ({"document_ids": torch.tensor([[1, 1, 1, 0, 0, 2, 2, 2]])}, "document_ids"),
    "attention_mask hole": (
        {"position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]), "attention_mask": torch.tensor([[1, 1, 0, 1, 1, 1, 1, 1]])},
        r"attention_mask'\] has a 0 \(padding\) at position 2, before a 1 \(a token\) at position 7",
    ),
    "left-padded attention_mask": (
        {"attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])},
        r"attention_mask'\] has a 0 \(padding\) at position 0, before a 1 \(a token\) at position 7",
    ),
    "attention_mask not 0/1": ({"attention_mask": torch.tensor([[1, 1, 2, 1, 1, 1, 0, 0]])}, r"attention_mask'\] must hold only 1"),
    "interleaved documents": ({"document_ids": torch.tensor([[1, 1, 2, 2, 1, 1, 3, 3]])}, "document_ids"),
    # Ids the embedding would refuse with torch's own words (`indices` dtype, "index out of range in self").
    "float input_ids": ({"input_ids": IDS.float()}, r"batch\['input_ids'\] must hold integer ids; got dtype torch\.float32"),
    "float labels": ({"labels": IDS.double()}, r"batch\['labels'\] must hold integer ids; got dtype torch\.float64"),
    "negative input_ids": ({"input_ids": IDS - 3}, r"batch\['input_ids'\] holds a negative token id \(-2\)"),
    # document_ids and position_ids that mark other documents (before: document_ids won, silently).
    "document_ids split where position_ids continue": (
        {"document_ids": torch.tensor([[1, 1, 1, 1, 2, 2, 2, 2]]), "position_ids": torch.arange(8)[None]},
        r"batch\['document_ids'\] and batch\['position_ids'\] disagree at position 4: by document_ids a new "
        r"document starts, but position_ids continue by \+1",
    ),
    "position_ids restart inside a document": (
        {"document_ids": torch.tensor([[1] * 8]), "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])},
        r"batch\['document_ids'\] and batch\['position_ids'\] disagree at position 4: by document_ids the same "
        r"document goes on, but position_ids do not continue by \+1",
    ),
}


def _batch(extra: dict) -> dict:
    return {"input_ids": IDS.clone(), "labels": IDS.clone(), **extra}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_shard_batch_refuses(name):
    extra, field = MALFORMED[name]
    with pytest.raises(ValueError, match=field) as raised:
        bdcp.shard_batch(_batch(extra), 2, 0)
    if "attention_mask" in extra:
        assert "document id" not in str(raised.value), raised.value
    with pytest.raises(ValueError, match=field):
        bdcp.make_cp_blockdiag_batch_and_ctx(None, None, _batch(extra))


def test_agreeing_document_ids_and_position_ids_are_accepted():
    """Padding (document id 0) may hold any positions; mRoPE's 3-D positions mark no documents."""
    local = bdcp.shard_batch(_batch({"document_ids": torch.tensor([[1, 1, 1, 2, 2, 0, 0, 0]]),
                                     "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}), 1, 0)
    assert local["document_ids"].tolist() == [[1, 1, 1, 2, 2, 0, 0, 0]]
    bdcp.shard_batch(_batch({"document_ids": torch.tensor([[1] * 4 + [2] * 4]),
                             "position_ids": torch.arange(8)[None, None].expand(3, 1, 8)}), 2, 0)


def test_padding_at_the_end_is_accepted():
    local = bdcp.shard_batch(_batch({"document_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 0, 0]])}), 2, 1)
    assert local["document_ids"].tolist() == [[2, 2, 0, 0]]
    assert int(local["num_items_in_batch"] * 2) == 4  # 2 + 2 targets inside the two documents, none in padding
    masked = bdcp.shard_batch(_batch({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
                                      "attention_mask": torch.tensor([[1, 1, 1, 1, 1, 1, 0, 0]])}), 2, 0)
    assert masked["document_ids"].tolist() == [[1, 1, 1, 2]]


def test_row_without_boundaries_is_one_document_and_says_so(caplog):
    from hf_blockdiag_cp.comm.notice import forget
    from hf_blockdiag_cp.step.shard import ONE_DOCUMENT_NOTICE

    forget(ONE_DOCUMENT_NOTICE)  # the message is given once per process
    with caplog.at_level(logging.INFO, logger="hf_blockdiag_cp.step.shard"):
        local = bdcp.shard_batch(_batch({}), 1, 0)
    assert local["document_ids"].tolist() == [[1] * 8]
    assert int(local["num_items_in_batch"]) == 7
    assert [r.levelno for r in caplog.records if "treated as ONE document" in r.getMessage()] == [logging.WARNING]


def malformed_case(rank, world_size, group, name):
    extra, field = MALFORMED[name]
    try:
        bdcp.make_cp_blockdiag_batch_and_ctx(group, None, _batch(extra))
    except ValueError as exc:
        return re.search(field, str(exc)) is not None
    return False


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_every_rank_raises(gloo, name):
    assert gloo(2).run(malformed_case, name=name) == [True, True]


def past_the_embeddings_case(rank, world_size, group):
    """A token id the model has no embedding row for, on rank 1 only (the ranks' packs differ then too)."""
    from helpers.trainer import tiny_model

    model = tiny_model()
    rows = model.get_input_embeddings().num_embeddings
    ids = IDS.clone() if rank == 0 else IDS + rows - 5
    try:
        bdcp.make_cp_blockdiag_batch_and_ctx(group, None, {"input_ids": ids, "labels": IDS.clone()}, model=model)
    except (ValueError, RuntimeError) as exc:
        return str(exc)
    return None


def test_a_token_id_past_the_embeddings_raises_on_every_rank(gloo):
    """The rank that holds it names the id and the embeddings' size (not torch's "index out of range in
    self"); its peer raises that a peer rejected its batch. Nobody reaches the forward."""
    first, second = gloo(2).run(past_the_embeddings_case)
    assert first is not None and "another rank of the CP group rejected its batch" in first, first
    assert second is not None and re.search(r"batch\['input_ids'\] holds token id \d+, but the model's input "
                                            r"embeddings have \d+ rows", second), second

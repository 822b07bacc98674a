"""Bad input to the example scripts, through their data and model loading functions (no launcher
needed: each case fails, or is quiet, before any process group): a model folder without tokenizer
files, a dataset that its own filter empties, an empty data file, the demo's split warning about its
own corpus, and examples/README.md naming every `--tiny-arch`."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from hf_blockdiag_cp.data import PackedBatchSampler, dataset_lengths
from helpers.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def _train_packed():
    return load_script(EXAMPLES / "train_packed.py", "train_packed_example")


def test_a_model_folder_without_tokenizer_files_is_named(tmp_path):
    """Transformers builds an empty tokenizer for such a folder (GPT-2: one special token): every text
    became [], and the run ended 25 s later saying to lower --packs-per-step."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    example = _train_packed()
    with pytest.raises(ValueError) as raised:
        example.load_tokenizer(example.parse_args(["--model", str(tmp_path)]))
    message = str(raised.value)
    assert re.search(r"its tokenizer \(GPT2Tokenizer, 1 tokens\) has no vocabulary: it turns text into no token", message)
    assert "--byte-tokens" in message and "\n" not in message, message
    assert example.load_tokenizer(example.parse_args(["--model", str(tmp_path), "--byte-tokens"])) is None


def test_a_dataset_that_the_filter_empties_is_named(tmp_path):
    texts = tmp_path / "blank.jsonl"
    texts.write_text("\n".join(json.dumps({"text": t}) for t in ("", None, "")) + "\n")
    example = _train_packed()
    with pytest.raises(ValueError, match=r"every one of the 3 texts of column 'text' tokenized to no token, and "
                                         r"documents without a token are dropped: no document is left"):
        example.load_training_data(example.parse_args(["--dataset", str(texts)]))
    trainer_example = load_script(EXAMPLES / "trainer_packed.py", "trainer_packed_example")
    with pytest.raises(ValueError, match=r"every one of the 3 rows of column 'text' is empty"):
        trainer_example.load_training_data(trainer_example.parse_args(["--dataset", str(texts)]))
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    from hf_blockdiag_cp.integrations.scripts import dataset_error

    assert dataset_error(example.parse_args(["--dataset", str(empty)])) == (
        f"--dataset {str(empty)!r}: the file is empty (no document to train on)")


def test_the_demo_does_not_warn_about_splitting_its_own_corpus(caplog):
    """The default run warned that 2,031 of 6,619 documents are split: its own corpus at its own pack
    size. The demo now cuts the corpus to `--max-tokens` itself; a user's `--dataset` still gets the warning."""
    example = _train_packed()
    args = example.parse_args([])
    dataset, _, _ = example.load_training_data(args)
    lengths = dataset_lengths(dataset)
    assert max(lengths) <= args.max_tokens
    with caplog.at_level(logging.WARNING, logger="hf_blockdiag_cp"):
        PackedBatchSampler(lengths, args.max_tokens, seed=args.seed, drop_last=True)
    assert not [r for r in caplog.records if "split" in r.getMessage()], caplog.text


def test_the_examples_readme_names_every_tiny_arch():
    readme = (EXAMPLES / "README.md").read_text()
    hybrids = [arch for arch in _train_packed().TINY_ARCHS if arch != "llama"]
    assert [arch for arch in hybrids if f"--tiny-arch {arch}" not in readme] == []

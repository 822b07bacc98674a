"""The pure parts of the main job (examples/train_packed.py): the launcher command-line parsing
(`requested_cpu_processes`) and the embedded corpus. The job itself runs end to end in
e2e/test_train_example.py."""

from __future__ import annotations

import pytest

from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.integrations.accelerate import requested_cpu_processes


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["python", "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "4", "train.py"], 4),
        (["accelerate", "launch", "--num-processes=3", "--cpu", "train.py", "--steps", "2"], 3),
        (["accelerate", "launch", "--cpu", "train.py"], None),
    ],
)
def test_requested_cpu_processes(argv, expected):
    assert requested_cpu_processes(argv) == expected


def test_requested_cpu_processes_rejects_garbage():
    with pytest.raises(ValueError, match="--num_processes must be an integer"):
        requested_cpu_processes(["accelerate", "launch", "--num_processes", "two"])


def test_corpus_is_lossless_deterministic_and_heavy_tailed():
    docs = corpus.documents()
    root = corpus.stdlib_root()
    by_file: dict[str, list[bytes]] = {}
    for doc in docs:
        by_file.setdefault(doc.source.rsplit(":", 1)[0], []).append(doc.text)
    assert list(by_file) == sorted(by_file), "files must come in sorted order"
    for name in list(by_file)[::25]:  # units concatenate back to the file (blank-only units dropped)
        assert b"".join(by_file[name]).strip() == (root / name).read_bytes().strip(), name
    dataset = corpus.load_corpus(max_documents=200)
    assert dataset.num_rows == 200
    for i in (0, 57, 199):
        ids = dataset[i]["input_ids"]
        assert 1 <= min(ids) and max(ids) < corpus.VOCAB_SIZE
        assert corpus.decode_bytes(ids) == docs[i].text
    lengths = sorted(len(d.text) for d in docs)
    median = lengths[len(lengths) // 2]
    assert lengths[-1] > 100 * median, "expected a heavy tail"


def test_corpus_rejects_unknown_unit():
    with pytest.raises(ValueError, match="unit must be one of"):
        corpus.documents(unit="paragraph")

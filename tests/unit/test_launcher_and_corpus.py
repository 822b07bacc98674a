"""The pure parts of the main job (examples/train_packed.py): how a worker reads its launch from the
environment (`launched_world_size`, `launch_error`, `init_distributed` in a world smaller than
`cp_size`) and the embedded corpus. The job itself, and
real launches by torchrun and accelerate, run end to end in e2e/test_train_example.py."""

from __future__ import annotations

import pytest
import torch.distributed

from hf_blockdiag_cp.data import corpus
from hf_blockdiag_cp.integrations.accelerate import init_distributed, launch_error, launched_world_size

_LAUNCH_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU", "MASTER_ADDR")


@pytest.fixture
def bare_env(monkeypatch):
    """An environment with none of the launchers' variables (as under plain `python script.py`)."""
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, 1),
        ({"WORLD_SIZE": "4", "PMI_SIZE": "8"}, 4),  # torchrun's variable wins
        ({"OMPI_COMM_WORLD_SIZE": "3"}, 3),  # Open MPI (accelerate launch --mpirun_hostfile)
        ({"PMI_SIZE": "6"}, 6),  # Intel MPI / MPICH
    ],
)
def test_launched_world_size(bare_env, env, expected):
    for name, value in env.items():
        bare_env.setenv(name, value)
    assert launched_world_size() == expected


def test_launch_error_only_for_a_one_process_accelerate_launch(bare_env):
    argv = ["examples/train_packed.py", "--steps", "2"]
    assert launch_error(argv) is None  # plain python
    bare_env.setenv("ACCELERATE_USE_CPU", "True")
    assert launch_error(argv) is None  # accelerate launch --cpu of one process: no MASTER_ADDR
    bare_env.setenv("MASTER_ADDR", "127.0.0.1")
    reason = launch_error(argv)  # accelerate launch --cpu --num_processes 2: one process, no world size
    assert "`torchrun --standalone --nproc-per-node N examples/train_packed.py --steps 2`" in reason
    assert "\n" not in reason
    bare_env.setenv("WORLD_SIZE", "2")
    assert launch_error(argv) is None  # a worker of torchrun (what accelerate launch runs on GPUs)


def test_one_process_with_cp_size_2_names_the_launch(bare_env):
    """`python train.py` with cp_size=2: the launcher started fewer processes than one CP group needs;
    the error says so and gives the torchrun command of this script, before any process group."""
    bare_env.setattr("sys.argv", ["train.py", "--steps", "2"])
    with pytest.raises(ValueError) as info:
        init_distributed(cp_size=2)
    message = str(info.value)
    assert "the launcher started fewer processes (1) than the CP size" in message, message
    assert "`torchrun --standalone --nproc-per-node 2 train.py --steps 2`" in message, message
    assert init_distributed(cp_size=1).coords.cp_size == 1  # one process, cp = 1: no error
    assert not torch.distributed.is_initialized()  # and no process group (build_dp_cp_mesh starts one for its mesh)


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

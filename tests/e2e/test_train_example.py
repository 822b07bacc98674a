"""The main job end to end: `torchrun --standalone --nproc-per-node 2 train_packed.py` (cp=2; a run of
the e2e tests' shared launch, `helpers.launch`), the example copied alone into an empty folder and
run from there, logs the same per-step losses as one process, and both equal an independent
reference: the stock eager model run on every document of the step's packs separately, updated by
plain SGD (Adam and clipping would hide a wrong gradient scale; SGD does not). Both example scripts
reject a bad argument (sizes, kernel, exchange and layout names), or a one-process `accelerate
launch` of a multi-process CPU run, with one line in every worker before any collective, and end
every worker with one line when the kernel asked for cannot run. A failure under each real launcher
runs once (torchrun: the kernel that cannot run, after the process group is up, the shared launch's
last run; accelerate launch: the one-process launch; a lone `python` rank: test_sft_example.py); the
other cases run the script's `__main__` in the test's process under the launcher's environment
(`run_in_process`: no interpreter to start per case), each rank of a 2-process world alone. The main
job's log names the kernel, exchange and layout it ran. The pure parts (the launch environment and
the embedded corpus) are in unit/test_launcher_and_corpus.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from hf_blockdiag_cp.data.corpus import decode_bytes
from hf_blockdiag_cp.kernels import kernel_names
from hf_blockdiag_cp.kernels.attention.fa4 import available as fa4_available
from hf_blockdiag_cp.step.state import log_choices
from helpers.launch import Run
from helpers.scripts import assert_left_alone, load_script, run_in_process, torchrun_env

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_packed.py"
STEPS, PACKS_PER_STEP, MAX_TOKENS, LR = 3, 2, 512, 0.3
ARGS = [
    "--steps", str(STEPS), "--packs-per-step", str(PACKS_PER_STEP), "--max-tokens", str(MAX_TOKENS),
    "--optimizer", "sgd", "--lr", str(LR), "--max-grad-norm", "0", "--seed", "0",
]
TOL = 1e-4
RUN_TIMEOUT = 300
CASES = {"llama": ("llama", False), "qwen3_5-overlap-keys": ("qwen3_5", "keys")}  # id: (--tiny-arch, --overlap)


def _args(arch: str, overlap) -> list[str]:
    return [*ARGS, "--tiny-arch", arch, *(["--overlap", overlap] if overlap else [])]


# `torchrun --standalone --nproc-per-node 2 train_packed.py` (cp = 2), the example copied alone.
CP2_RUNS = {case: Run(f"train_packed-{case}", EXAMPLE, (*_args(*CASES[case]), "--output-dir", "out"), alone=True)
            for case in CASES}


def _example_module():
    return load_script(EXAMPLE, "train_packed_example")


def reference_losses(steps: int, args: list[str] = ARGS) -> list[float]:
    """Per-step token-weighted mean loss of the stock eager model on each document alone, plain SGD."""
    from hf_blockdiag_cp.data import PackedBatchSampler, PackedExamples, dataset_lengths

    example = _example_module()
    args = example.parse_args(args)
    dataset, _, vocab = example.load_training_data(args)
    model = example.build_model(args, vocab)
    model.set_attn_implementation("eager")
    packs = PackedBatchSampler(dataset_lengths(dataset), MAX_TOKENS, seed=args.seed, drop_last=True).epoch_packs()
    examples = PackedExamples(dataset)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        total, targets = 0.0, 0
        for pack in packs[step * PACKS_PER_STEP : (step + 1) * PACKS_PER_STEP]:
            for item in pack:
                ids = torch.as_tensor(examples[item]["input_ids"], dtype=torch.long)
                if ids.numel() < 2:
                    continue
                logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
                total = total + F.cross_entropy(logits.float(), ids[1:], reduction="sum")
                targets += ids.numel() - 1
        loss = total / targets
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.launched(run)) for case, run in CP2_RUNS.items()])
def test_cp2_run_matches_one_process_and_reference(launch, tmp_path, monkeypatch, capsys, caplog, case):
    """Also for the tiny Qwen3.5 hybrid (`--tiny-arch qwen3_5`): its gated delta-rule layers under CP,
    with `--overlap keys` on its full-attention layers' all-gather (overlapped with attention split by
    keys; the hybrid without overlap is tests/multiprocess/test_hybrid_parity.py's). The other tiny
    hybrids, Nemotron-H's Mamba2 layers by state passing and LFM2's short convolutions with their halo
    passed between ranks, are exact against the stock model per document at G = 1-4 in
    tests/multiprocess/test_state_passing_parity.py::test_matches_per_document_reference. The cp = 2
    run is the shared launch's (`helpers.launch`); the one-process run (`python train_packed.py`)
    runs in this process meanwhile."""
    arch, overlap = CASES[case]
    args, one_dir = _args(arch, overlap), tmp_path / "one"
    log_choices.cache_clear()  # its log lines reach pytest's handlers (caplog), and are said once per process
    status, out, err = run_in_process(monkeypatch, capsys, EXAMPLE, [*args, "--output-dir", str(one_dir)], {},
                                      process_group=True)
    assert status in (None, 0), (out + err)[-3000:]
    one_log = out + err + caplog.text
    reference = reference_losses(STEPS, args)
    two = launch.result(CP2_RUNS[case])
    two.assert_ok("torchrun --standalone --nproc-per-node 2, train_packed.py copied alone")

    assert_left_alone(two.cwd / EXAMPLE.name)
    two_dir = two.cwd / "out"
    single = json.loads((one_dir / "metrics.json").read_text())
    cp2 = json.loads((two_dir / "metrics.json").read_text())
    assert (single["cp_size"], single["dp_size"]) == (1, 1)
    assert (cp2["cp_size"], cp2["dp_size"], cp2["world_size"]) == (2, 1, 2), "torchrun did not start 2 CP ranks"
    assert len(single["losses"]) == len(cp2["losses"]) == STEPS
    assert cp2["tokens_per_second"] > 0 and 0 < cp2["packing_efficiency"] <= 1
    assert (two_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    said = "blockdiag_cp runs kernel dense (attn_backend='auto'), K/V exchange allgather{} (kv_exchange='allgather'), " \
           "layout contiguous"  # on CPU `auto` runs dense; said once, by the main rank
    for what, text, overlapped in (("one process", one_log, False), ("cp = 2", two.text, overlap)):  # one process:
        overlapped = f" overlapped with attention (split by {overlap})" if overlapped else ""  # no exchange to overlap
        assert text.count(said.format(overlapped)) == 1, what
    for step, (ref, a, b) in enumerate(zip(reference, single["losses"], cp2["losses"]), start=1):
        assert abs(a - ref) <= TOL * abs(ref), f"step {step}: 1-process loss {a} vs reference {ref}"
        assert abs(b - ref) <= TOL * abs(ref), f"step {step}: cp=2 loss {b} vs reference {ref}"


def _output_lines(run: subprocess.CompletedProcess) -> list[str]:
    return (run.stdout + run.stderr).strip().splitlines()


@pytest.mark.parametrize(
    "script, args, expected",
    [
        ("trainer_packed.py", ["--max-tokens", "1001"], "--max-tokens=1001 must be a multiple of 2*cp=4"),
        ("train_packed.py", ["--cp-size", "1", "--packs-per-step", "3"],
         "--packs-per-step=3 must be divisible by dp=2 (processes 2 / cp 1)"),
        ("trainer_packed.py", ["--cp-size", "3"], "--cp-size=3 must be a positive divisor of the number of processes (2)"),
        ("train_packed.py", ["--attn-backend", "bogus"], "--attn-backend='bogus' is not a kernel; accepted: auto, "),
        ("train_packed.py", ["--cp-size", "0"], "--cp-size=0 must be a positive divisor of the number of processes (2)"),
        ("train_packed.py", ["--dataset", "README.md"], "--dataset 'README.md': unknown file type '.md'; expected one of "),
        ("trainer_packed.py", ["--attn-backend", "bogus"], "--attn-backend='bogus' is not a kernel; accepted: auto, "),
        ("train_packed.py", ["--kv-exchange", "ring"], "--kv-exchange='ring' is not a K/V exchange; accepted: auto, "),
        ("trainer_packed.py", ["--layout", "zigzag"], "--layout='zigzag' is not a layout; accepted: contiguous, "),
    ],
)
def test_argument_errors_name_the_flag(script, args, expected):
    """The reason the launch check gives for each bad value on 2 processes, in process (the exit on
    every rank is the next test's, once per kind of check)."""
    from hf_blockdiag_cp.integrations.scripts import argument_error

    example = load_script(ROOT / "examples" / script, script.removesuffix(".py") + "_example")
    reason = argument_error(example.parse_args(args), 2)
    assert reason is not None and reason.startswith(expected), reason


BOGUS_BACKEND = "--attn-backend='bogus' is not a kernel; accepted: auto, " + ", ".join(kernel_names())
FA4_UNAVAILABLE = ("attn_backend='fa4' cannot run here: flash-attn-4 (flash_attn.cute) does not import in this "
                   "environment: not installed (the [fa4] extra)")


def _check_one_line_exit(status, out: str, err: str, expected: str, what, exact: bool = False) -> None:
    """Exit status 2, the output ending with `error: <expected>` (`exact`) or `error: <expected...>`,
    the only `error:` line, and no traceback."""
    lines = (out + err).strip().splitlines()
    assert status == 2, (what, status, lines[-5:])
    assert lines[-1] == f"error: {expected}" if exact else lines[-1].startswith(f"error: {expected}"), (what, lines[-5:])
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err, (what, lines)


@pytest.mark.parametrize(
    "script, rank, args, expected",
    [
        ("train_packed.py", 0, ["--max-tokens", "1001"], "--max-tokens=1001 must be a multiple of 2*cp=4"),
        ("trainer_packed.py", 1, ["--steps", "0"], "--steps must be positive; got 0"),
        ("trainer_packed.py", 0, ["--dataset", "missing/data.jsonl"], "--dataset 'missing/data.jsonl': no such file"),
        ("train_packed.py", 1, ["--overlap", "--kv-exchange", "heads"],
         "--overlap=queries with --kv-exchange='heads' --attn-backend='auto': overlap='queries' needs a kv_exchange "
         "that can overlap attention"),
        ("trainer_packed.py", 0, ["--attn-backend", "bogus"], BOGUS_BACKEND),  # both ranks: torchrun's two workers
        ("trainer_packed.py", 1, ["--attn-backend", "bogus"], BOGUS_BACKEND),
        ("train_packed.py", 0, ["--attn-backend", "bogus"], BOGUS_BACKEND),
        ("train_packed.py", 1, ["--attn-backend", "bogus"], BOGUS_BACKEND),
    ],
)
def test_bad_argument_ends_each_rank_with_one_line_before_any_collective(monkeypatch, capsys, script, rank, args,
                                                                         expected):
    """One rank of a 2-process world, alone, as torchrun would start it (its `__main__` block run in
    this process under torchrun's variables): had it reached the process group it would wait for its
    missing peer until the timeout (here reaching `init_process_group` fails the test). It must
    instead exit 2 at once, its output ending with the one-line reason and holding no traceback. One
    case per kind of check (sizes, argparse ranges, the data file, the CPConfig fields), over both
    scripts and ranks, the kernel name on both ranks of both. Launched failures: sft_trl.py's lone
    rank (test_sft_example.py), the one-process accelerate launch and torchrun's workers of
    trainer_packed.py (below)."""
    status, out, err = run_in_process(monkeypatch, capsys, ROOT / "examples" / script, args, torchrun_env(rank))
    _check_one_line_exit(status, out, err, expected, (script, rank), exact=expected == BOGUS_BACKEND)
    assert not torch.distributed.is_initialized()


# What accelerate's simple launcher (`accelerate launch --cpu --num_processes 2`, no MPI) exports to the one
# process it starts (accelerate.utils.launch.prepare_simple_launcher_cmd_env): no world size.
ACCELERATE_CPU_ENV = {"ACCELERATE_USE_CPU": "True", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("script, launched", [("train_packed.py", True), ("trainer_packed.py", False)],
                         ids=["train_packed.py-accelerate", "trainer_packed.py-in-process"])
def test_one_process_accelerate_cpu_launch_names_torchrun(monkeypatch, capsys, script, launched):
    """`accelerate launch --cpu --num_processes 2` without MPI starts the script once, without a
    world size: the script must stop with the torchrun command to use instead, not train alone.
    train_packed.py under the real launcher; trainer_packed.py in this process under the variables
    that launcher exports."""
    path = str(ROOT / "examples" / script)
    if launched:
        launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        env.pop("WORLD_SIZE", None)
        run = subprocess.run([*launch, path, "--steps", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=RUN_TIMEOUT)
        failed, lines = run.returncode != 0, _output_lines(run)
    else:
        status, out, err = run_in_process(monkeypatch, capsys, Path(path), ["--steps", "1"], ACCELERATE_CPU_ENV)
        failed, lines = status not in (0, None), (out + err).strip().splitlines()
    errors = [line for line in lines if line.startswith("error:")]
    assert failed
    assert len(errors) == 1, lines[-10:]
    assert f"`torchrun --standalone --nproc-per-node N {path} --steps 1`" in errors[0], errors


FA4_ARGS = ("--attn-backend", "fa4", "--steps", "1")
# trainer_packed.py under torchrun asking for fa4: the suite's launched torchrun failure, the shared launch's last run.
FA4_RUN = Run("trainer_packed-fa4", ROOT / "examples" / "trainer_packed.py", (*FA4_ARGS, "--output-dir", "out"),
              ends_launch=True)


@pytest.mark.parametrize("script", ["train_packed.py", "sft_trl.py"])
def test_unavailable_kernel_ends_the_process_with_one_line(monkeypatch, capsys, script, tmp_path):
    """`--attn-backend fa4` where flash-attn-4 does not import: known, so the launch check lets it
    pass, and the first attention call finds it cannot run. One process (`python script`) says so in
    one `error:` line and exits 2, without a traceback: its `__main__` run in this process, which must
    end at its `os._exit(2)`. torchrun's workers: the next test."""
    if fa4_available():
        pytest.skip("flash-attn-4 imports here")
    if script == "sft_trl.py":
        pytest.importorskip("trl")
    args = [*FA4_ARGS, "--output-dir", str(tmp_path)]
    status, out, err = run_in_process(monkeypatch, capsys, ROOT / "examples" / script, args, {}, process_group=True)
    lines = (out + err).strip().splitlines()  # (here the progress bar's finaliser may still print after it)
    assert status == 2 and [line for line in lines if line.startswith("error:")] == [f"error: {FA4_UNAVAILABLE}"], \
        (status, lines[-20:])
    assert "Traceback" not in err and "raise ValueError" not in err, lines


@pytest.mark.skipif(fa4_available(), reason="flash-attn-4 imports here")
@pytest.mark.launched(FA4_RUN)
def test_unavailable_kernel_ends_the_torchrun_workers_with_one_line(launch):
    """trainer_packed.py under torchrun with `--attn-backend fa4`: its workers fail after the process
    group is up. Every worker that gets to print says so in one `error:` line and exits 2 (torchrun
    reports the first), without a traceback; the one left is torchrun's own report."""
    returncode, torchrun, run = launch.ending(FA4_RUN)
    lines = [line for log in run.logs for line in log.strip().splitlines()]
    errors = [line for line in lines if line.startswith("error:")]
    assert returncode != 0 and errors, (returncode, lines[-20:], torchrun[-3000:])
    assert set(errors) == {f"error: {FA4_UNAVAILABLE}"}, lines[-20:]
    assert "exitcode  : 2" in torchrun, torchrun[-3000:]
    assert torchrun.count("Traceback (most recent call last)") <= 1 and "raise ValueError" not in torchrun, torchrun
    assert not any("Traceback" in log or "raise ValueError" in log for log in run.logs), run.logs


def test_local_data_files_load_by_their_suffix(tmp_path):
    """`--dataset` with a local file: the examples read it with the `datasets` builder of its suffix
    (`integrations.scripts.load_raw_dataset`), and the Trainer example turns its text into byte tokens."""
    texts = ["first document", "second, longer document", "3"]
    files = {"docs.jsonl": "\n".join(json.dumps({"text": t}) for t in texts) + "\n",
             "docs.csv": "text\n" + "\n".join(f'"{t}"' for t in texts) + "\n",
             "docs.txt": "\n".join(texts) + "\n"}
    from hf_blockdiag_cp.integrations.scripts import load_raw_dataset

    for name, content in files.items():
        (tmp_path / name).write_text(content)
        assert load_raw_dataset(str(tmp_path / name))["text"] == texts, name
    trainer_example = load_script(ROOT / "examples" / "trainer_packed.py", "trainer_packed_example")
    args = trainer_example.parse_args(["--dataset", str(tmp_path / "docs.jsonl")])
    data = trainer_example.load_training_data(args)
    assert [decode_bytes(ids).decode() for ids in data["input_ids"]] == texts

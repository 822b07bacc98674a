"""The main job end to end: `accelerate launch --cpu --num_processes 2 examples/train_packed.py` (cp=2)
logs the same per-step losses as one process, and both equal an independent reference: the
stock eager model run on every document of the step's packs separately, updated by plain
SGD (Adam and clipping would hide a wrong gradient scale; SGD does not). The pure parts (the
launcher command-line parsing and the embedded corpus) are in unit/test_launcher_and_corpus.py."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_packed.py"
STEPS, PACKS_PER_STEP, MAX_TOKENS, LR = 3, 2, 512, 0.3
ARGS = [
    "--steps", str(STEPS), "--packs-per-step", str(PACKS_PER_STEP), "--max-tokens", str(MAX_TOKENS),
    "--optimizer", "sgd", "--lr", str(LR), "--max-grad-norm", "0", "--seed", "0",
]
TOL = 1e-4
RUN_TIMEOUT = 300


def _example_module():
    spec = importlib.util.spec_from_file_location("train_packed_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    # One thread per process: CI shares 2 cores, and oversubscribed OpenMP threads spin (10x slower here).
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, log: Path, what: str) -> None:
    try:
        rc = proc.wait(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{what} did not finish in {RUN_TIMEOUT}s; log tail:\n{log.read_text()[-3000:]}")
    assert rc == 0, f"{what} exited with {rc}; log tail:\n{log.read_text()[-3000:]}"


def reference_losses(steps: int) -> list[float]:
    """Per-step token-weighted mean loss of the stock eager model on each document alone, plain SGD."""
    from hf_blockdiag_cp.data import PackedBatchSampler, PackedExamples, dataset_lengths

    example = _example_module()
    args = example.parse_args(ARGS)
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


def test_cp2_run_matches_one_process_and_reference(tmp_path):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    one = _start([sys.executable, str(EXAMPLE), *ARGS, "--output-dir", str(one_dir)], tmp_path / "one.log")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    two = _start([*launch, str(EXAMPLE), *ARGS, "--output-dir", str(two_dir)], tmp_path / "two.log")
    try:
        reference = reference_losses(STEPS)
    finally:
        _finish(one, tmp_path / "one.log", "1-process run")
        _finish(two, tmp_path / "two.log", "accelerate launch --cpu --num_processes 2")

    single = json.loads((one_dir / "metrics.json").read_text())
    cp2 = json.loads((two_dir / "metrics.json").read_text())
    assert (single["cp_size"], single["dp_size"]) == (1, 1)
    assert (cp2["cp_size"], cp2["dp_size"], cp2["world_size"]) == (2, 1, 2), "accelerate launch did not start 2 CP ranks"
    assert len(single["losses"]) == len(cp2["losses"]) == STEPS
    assert cp2["tokens_per_second"] > 0 and 0 < cp2["packing_efficiency"] <= 1
    assert (two_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for step, (ref, a, b) in enumerate(zip(reference, single["losses"], cp2["losses"]), start=1):
        assert abs(a - ref) <= TOL * abs(ref), f"step {step}: 1-process loss {a} vs reference {ref}"
        assert abs(b - ref) <= TOL * abs(ref), f"step {step}: cp=2 loss {b} vs reference {ref}"


@pytest.mark.parametrize("script", ["train_packed.py", "trainer_packed.py"])
def test_bad_argument_ends_with_the_reason_before_any_worker(script):
    """`accelerate launch --cpu --num_processes 2 <example> --max-tokens 1001`: the arguments are checked
    before workers start, and the one-line reason is the last line of output, with a non-zero exit
    (after accelerate's own CalledProcessError traceback)."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2"]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    run = subprocess.run([*launch, str(ROOT / "examples" / script), "--max-tokens", "1001"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=RUN_TIMEOUT)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode != 0
    assert lines[-1] == "error: --max-tokens=1001 must be a multiple of 2*cp=4", lines[-5:]
    assert "torch.distributed.run" not in run.stdout + run.stderr  # no worker was launched

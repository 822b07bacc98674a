"""`examples/sft_trl.py` end to end: TRL's packed SFT under block-diagonal CP launched by
`torchrun --standalone --nproc-per-node 2` (cp = 2; the example copied alone into an empty folder
and run from there) logs the same per-step losses and the same
sharded eval loss as one process (cp = 1) on the same packs (plain SGD, no clipping: a gradient
scale error would show). The exactness against the stock model per document and against TRL's
stock SFTTrainer is in multiprocess/test_trl_sft.py. A bad argument ends each rank with one line
before any collective."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from helpers.launch import Run  # noqa: E402
from helpers.scripts import (  # noqa: E402
    ROOT, assert_left_alone, load_script, run_in_process, script_env, torchrun_env,
)

EXAMPLE = ROOT / "examples" / "sft_trl.py"
STEPS = 3
ARGS = [
    "--steps", str(STEPS), "--packs-per-step", "2", "--max-length", "256", "--examples", "400", "--eval",
    "--eval-examples", "60", "--optimizer", "sgd", "--lr", "0.3", "--max-grad-norm", "0", "--seed", "0",
]
TOL = 1e-4
CP2_RUN = Run("sft_trl", EXAMPLE, (*ARGS, "--output-dir", "out"), alone=True)  # torchrun's 2 processes, copied alone


@pytest.mark.launched(CP2_RUN)
def test_cp2_sft_run_matches_one_process(launch, tmp_path, monkeypatch, capsys):
    """The cp = 2 run is the shared launch's (`helpers.launch`); the one-process run (`python
    sft_trl.py`) runs in this process meanwhile."""
    one_dir = tmp_path / "one"
    status, out, err = run_in_process(monkeypatch, capsys, EXAMPLE, [*ARGS, "--output-dir", str(one_dir)], {},
                                      process_group=True)
    assert status in (None, 0), (out + err)[-3000:]
    two = launch.result(CP2_RUN)
    two.assert_ok("torchrun --standalone --nproc-per-node 2, sft_trl.py copied alone")
    assert_left_alone(two.cwd / EXAMPLE.name)
    two_dir = two.cwd / "out"
    single = json.loads((one_dir / "metrics.json").read_text())
    cp2 = json.loads((two_dir / "metrics.json").read_text())
    assert (single["cp_size"], cp2["cp_size"], cp2["world_size"]) == (1, 2, 2), "torchrun did not start 2 CP ranks"
    assert len(single["losses"]) == len(cp2["losses"]) == STEPS
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    for step, (a, b) in enumerate(zip(single["losses"], cp2["losses"]), start=1):
        assert abs(a - b) <= TOL * abs(a), f"step {step}: cp=2 loss {b} vs 1 process {a}"
    assert abs(single["eval_loss"] - cp2["eval_loss"]) <= TOL * single["eval_loss"]
    assert single["eval_tokens"] == cp2["eval_tokens"] > 0


@pytest.mark.parametrize(
    "world_size, args, expected",
    [
        (2, ["--max-length", "250"], "--max-length=250 must be a multiple of 2*cp=4"),
        (2, ["--cp-size", "1", "--packs-per-step", "3"], "--packs-per-step=3 must be divisible by dp=2"),
        (2, ["--cp-size", "3"], "--cp-size=3 must be a positive divisor of the number of processes (2)"),
        (1, ["--attn-backend", "bogus"], "--attn-backend='bogus' is not a kernel; accepted: auto, "),
        (1, ["--kv-exchange", "bogus"], "--kv-exchange='bogus' is not a K/V exchange; accepted: auto, "),
        (1, ["--dataset", "missing/sft.jsonl"], "--dataset 'missing/sft.jsonl': no such file"),
        (4, ["--cp-size", "2", "--max-length", "260"], None),
    ],
)
def test_argument_errors_name_the_flag(world_size, args, expected):
    example = load_script(EXAMPLE, "sft_trl_example")
    reason = example.argument_error(example.parse_args(args), world_size)
    assert reason == expected if expected is None else reason.startswith(expected), reason


def test_bad_argument_ends_each_rank_with_one_line():
    """Rank 1 of a 2-process world, started alone: it must exit 2 with the one-line reason, not wait for its peer."""
    env = script_env(**torchrun_env(1))
    run = subprocess.run([sys.executable, str(EXAMPLE), "--max-length", "250"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    lines = (run.stdout + run.stderr).strip().splitlines()
    assert run.returncode == 2, lines[-5:]
    assert lines[-1] == "error: --max-length=250 must be a multiple of 2*cp=4", lines[-5:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in run.stderr, lines

"""`examples/train_grpo.py` end to end: TRL's GRPO with its log-probs under block-diagonal CP, launched by
`torchrun --standalone --nproc-per-node 2` (the example copied alone into an empty folder and run from
there), logs the same per-step losses and TRL metrics with two CP
ranks (cp = 2) as with two data-parallel ranks (cp = 1): each rank samples its own completions in
both runs, as TRL does at that world size, so the generations are the same and only CP differs (plain
SGD, no clipping: a gradient scale error would show). Exactness against TRL's own trainer is in
multiprocess/test_trl_rl.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

from helpers.launch import Run  # noqa: E402
from helpers.scripts import ROOT, assert_left_alone, load_script  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_grpo.py"
STEPS = 5
ARGS = ["--steps", str(STEPS), "--optimizer", "sgd", "--lr", "0.05", "--max-grad-norm", "0", "--seed", "0",
        "--max-completion-length", "24", "--prompts", "32", "--completions-per-rank", "4"]
LOSS_TOL = 1e-5  # relative, fp32
METRIC_TOL = 1e-5  # absolute, relative to the value's magnitude where that is above 1
# The example copied alone, run by torchrun's 2 processes with 2 data-parallel ranks and with 2 CP ranks.
RUNS = {cp: Run(f"train_grpo-cp{cp}", EXAMPLE, (*ARGS, "--cp-size", str(cp), "--output-dir", "out"), alone=True)
        for cp in (1, 2)}


@pytest.mark.launched(*RUNS.values())
def test_cp2_grpo_run_matches_two_data_parallel_ranks(launch):
    metrics = {}
    for cp, run in RUNS.items():
        result = launch.result(run)
        result.assert_ok(f"torchrun --nproc-per-node 2 train_grpo.py --cp-size {cp}, copied alone")
        assert_left_alone(result.cwd / EXAMPLE.name)
        metrics[cp] = json.loads((result.cwd / "out" / "metrics.json").read_text())
    dp2, cp2 = metrics[1], metrics[2]
    assert (dp2["dp_size"], cp2["cp_size"], cp2["dp_size"]) == (2, 2, 1), (dp2, cp2)
    assert len(dp2["losses"]) == len(cp2["losses"]) == STEPS
    assert any(loss != 0 for loss in cp2["losses"]), "every loss is 0: the rewards gave no advantage"
    for step, (a, b) in enumerate(zip(dp2["losses"], cp2["losses"]), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(a) + 1e-9, f"step {step}: cp=2 loss {b} vs dp=2 {a}"
    for name, values in dp2["trl"].items():
        for step, (a, b) in enumerate(zip(values, cp2["trl"][name]), start=1):
            assert abs(a - b) <= METRIC_TOL * max(1.0, abs(a)), f"step {step}: {name} cp=2 {b} vs dp=2 {a}"
    assert {"reward", "kl", "entropy", "completions/mean_length"} <= set(cp2["trl"]), sorted(cp2["trl"])


@pytest.mark.parametrize(
    "world_size, args, expected",
    [
        (2, ["--cp-size", "3"], "--cp-size 3 must divide the number of processes (2)"),
        (3, ["--completions-per-rank", "3"], "--completions-per-rank 3 x 3 processes must be a multiple of"),
        (1, ["--attn-backend", "bogus"], "--attn-backend='bogus' is not a kernel; accepted: auto, "),
        (4, ["--cp-size", "2"], None),
    ],
)
def test_argument_errors_name_the_flag(world_size, args, expected):
    example = load_script(EXAMPLE, "train_grpo_example")
    reason = example.argument_error(example.parse_args(args), world_size)
    assert reason == expected if expected is None else reason.startswith(expected), reason

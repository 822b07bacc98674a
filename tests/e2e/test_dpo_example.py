"""`examples/train_dpo.py` end to end: TRL's DPO on packed pairs under block-diagonal CP launched by
`torchrun --standalone --nproc-per-node 2` (cp = 2; the example copied alone into an empty folder and
run from there) logs the same per-step losses as one process
(cp = 1) on the same packs (plain SGD, no clipping: a gradient scale error would show), and its
sharded `evaluate()` after training equals TRL's stock `DPOTrainer.evaluate()` (the stock eager
model with the trained weights the run saved, the same initial reference, every eval pair in one
padded batch, no CP). Per-family and per-loss-type exactness against TRL is in
multiprocess/test_trl_dpo.py. A bad argument ends the run with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from helpers.launch import Run  # noqa: E402
from helpers.scripts import ROOT, assert_left_alone, load_script, run_in_process  # noqa: E402

EXAMPLE = ROOT / "examples" / "train_dpo.py"
STEPS = 10
ARGS = [
    "--steps", str(STEPS), "--packs-per-step", "2", "--max-length", "128", "--max-tokens", "512", "--examples", "120",
    "--eval", "--eval-examples", "12", "--optimizer", "sgd", "--lr", "0.02", "--max-grad-norm", "0", "--seed", "0",
]
LOSS_TOL = 1e-5  # relative, fp32
METRIC_TOL = 1e-5  # absolute, relative to the value's magnitude where that is above 1
EVAL_METRICS = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/accuracies",
                "eval_rewards/margins", "eval_logps/chosen", "eval_logps/rejected", "eval_logits/chosen",
                "eval_logits/rejected", "eval_entropy", "eval_mean_token_accuracy")
CP2_RUN = Run("train_dpo", EXAMPLE, (*ARGS, "--output-dir", "out"), alone=True)  # torchrun's 2 processes, copied alone


def stock_evaluate(model_dir, output_dir) -> dict:
    """TRL's DPOTrainer.evaluate run the stock way on the example's eval pairs: the eager model with the
    weights the run saved, the example's initial policy as the reference, one padded batch, no CP."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer

    example = load_script(EXAMPLE, "train_dpo_example")
    args = example.parse_args(ARGS + ["--output-dir", str(output_dir)])
    _, eval_pairs = example.load_data(args)
    reference, tokenizer = example.build_model_and_tokenizer(args, attn_implementation="eager")
    trained = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    config = example.dpo_config(args, 1, 1)
    config.per_device_eval_batch_size = len(eval_pairs)
    trainer = DPOTrainer(model=trained, ref_model=reference, args=config, train_dataset=eval_pairs,  # required, unused
                         eval_dataset=eval_pairs, processing_class=tokenizer)
    return trainer.evaluate()


def side_by_side(launch, tmp_path, monkeypatch, capsys) -> tuple[dict, dict, Path]:
    """metrics.json of the one-process run (`python train_dpo.py`, cp = 1, in this process, while the
    shared launch runs) and of torchrun's two ranks (cp = 2), and the folder the latter wrote."""
    status, stdout, stderr = run_in_process(monkeypatch, capsys, EXAMPLE, [*ARGS, "--output-dir", str(tmp_path / "cp1")],
                                            {}, process_group=True)
    assert status in (None, 0), (stdout + stderr)[-3000:]
    two = launch.result(CP2_RUN)
    two.assert_ok("torchrun --standalone --nproc-per-node 2, train_dpo.py copied alone")
    assert_left_alone(two.cwd / EXAMPLE.name)
    single, cp2 = (json.loads((out / "metrics.json").read_text()) for out in (tmp_path / "cp1", two.cwd / "out"))
    return single, cp2, two.cwd / "out"


@pytest.mark.launched(CP2_RUN)
def test_cp2_dpo_run_matches_one_process_and_stock_evaluate(launch, tmp_path, monkeypatch, capsys):
    single, cp2, cp2_out = side_by_side(launch, tmp_path, monkeypatch, capsys)
    sizes = (single["cp_size"], cp2["cp_size"], cp2["dp_size"], cp2["world_size"])
    assert sizes == (1, 2, 1, 2), f"(cp of one process, cp, dp, world of torchrun's) = {sizes}: not 2 CP ranks"
    assert len(single["losses"]) == len(cp2["losses"]) == STEPS
    assert single["losses"][-1] < single["losses"][0], single["losses"]
    for step, (a, b) in enumerate(zip(single["losses"], cp2["losses"]), start=1):
        assert abs(a - b) <= LOSS_TOL * abs(a), f"step {step}: cp=2 loss {b} vs 1 process {a}"
    assert len(cp2["trl"]["rewards/margins"]) == STEPS and cp2["trl"]["rewards/margins"][-1] > 0, cp2["trl"]

    stock = stock_evaluate(cp2_out, tmp_path / "stock")
    for name in EVAL_METRICS:
        bound = METRIC_TOL * max(1.0, abs(stock[name]))
        assert abs(cp2[name] - stock[name]) <= bound, f"{name}: cp=2 {cp2[name]} vs stock DPOTrainer {stock[name]}"
    assert stock["eval_rewards/margins"] > 0, "training left the eval margins at zero: the comparison shows little"


@pytest.mark.parametrize(
    "world_size, args, expected",
    [
        (2, ["--max-tokens", "250"], "--max-tokens=250 must be a multiple of 2*cp=4"),
        (2, ["--cp-size", "1", "--packs-per-step", "3"], "--packs-per-step=3 must be divisible by dp=2"),
        (2, ["--cp-size", "3"], "--cp-size=3 must be a positive divisor of the number of processes (2)"),
        (1, ["--attn-backend", "bogus"], "--attn-backend='bogus' is not a kernel; accepted: auto, "),
        (1, ["--loss-type", "sigmoid", "bogus"], "argument --loss-type: invalid choice: 'bogus'"),  # while parsing
        (1, ["--max-tokens", "0"], "--max-tokens must be positive; got 0"),  # while parsing
        (4, ["--cp-size", "2", "--max-length", "130"], None),  # the default pack size is a multiple of 2*cp
        (3, ["--max-tokens", "600"], None),
    ],
)
def test_argument_errors_name_the_flag(world_size, args, expected, capsys):
    """The reason of `argument_error` (checked against the world size before any collective), or the one
    `error:` line and status 2 of the parser."""
    example = load_script(EXAMPLE, "train_dpo_example")
    try:
        reason = example.argument_error(example.parse_args(args), world_size)
    except SystemExit as exc:
        assert exc.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        reason = err.removeprefix("error: ")
    assert reason == expected if expected is None else reason.startswith(expected), reason


def test_pair_longer_than_the_pack_ends_with_the_library_error(tmp_path, monkeypatch, capsys):
    """Pairs of up to 2 * 128 tokens in packs of 64: the trainer refuses the first such pair, naming
    max_tokens, and the run ends with that one line (status 2, no traceback)."""
    args = ["--max-length", "128", "--max-tokens", "64", "--examples", "8", "--steps", "1",
            "--output-dir", str(tmp_path)]
    status, out, err = run_in_process(monkeypatch, capsys, EXAMPLE, args, {}, process_group=True)
    lines = err.strip().splitlines()
    assert status == 2, (out + err)[-3000:]
    assert lines[-1].startswith("error: ") and "more than max_tokens=64, the pack size" in lines[-1], lines[-3:]
    assert sum(line.startswith("error:") for line in lines) == 1 and "Traceback" not in err, lines[-5:]

"""Each example script runs when copied alone into an empty folder (it imports only the library and its
dependencies, no sibling script, and reads no repository file), and examples/README.md gives every
script a command line. The run copied alone is the one its end-to-end test has in the shared torchrun
launch (`helpers.launch.Run(..., alone=True)`), except for trainer_packed.py, whose only other launch
is a failure: here its smallest run, one optimizer step on 2 CP ranks, writes a `metrics.json` with
one finite loss."""

from __future__ import annotations

import json
import math
import re

import pytest

from helpers.launch import Run
from helpers.scripts import ROOT, assert_left_alone

EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests" / "e2e"
EXAMPLE = ROOT / "examples" / "trainer_packed.py"
# The test file that launches each example copied alone.
RUN_ALONE_IN = {
    "train_packed.py": "test_train_example.py",  # cp = 2
    "sft_trl.py": "test_sft_example.py",  # cp = 2
    "train_dpo.py": "test_dpo_example.py",  # cp = 2
    "train_grpo.py": "test_grpo_example.py",  # cp = 1 and cp = 2
    "trainer_packed.py": "test_examples_alone.py",  # below, cp = 2
}
TRAINER_RUN = Run("trainer_packed", EXAMPLE, ("--steps", "1", "--packs-per-step", "1", "--max-tokens", "256",
                                              "--output-dir", "out"), alone=True)


def test_every_example_runs_copied_alone_somewhere_and_is_named_in_the_readme():
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == sorted(RUN_ALONE_IN), f"examples/ holds {scripts}; copied alone are run {sorted(RUN_ALONE_IN)}"
    readme = (EXAMPLES / "README.md").read_text()
    for name, test_file in RUN_ALONE_IN.items():
        assert f"examples/{name} " in readme and f"## `{name}`" in readme, f"examples/README.md does not show {name}"
        text = (TESTS / test_file).read_text()
        launched = re.search(rf'^EXAMPLE = ROOT / "examples" / "{re.escape(name)}"$', text, flags=re.M)
        run_alone = re.search(r"\bRun\([^,]+, EXAMPLE, .*?\balone=True\)", text, flags=re.S)
        assert launched and run_alone and "pytest.mark.launched(" in text and "assert_left_alone(" in text, \
            (name, test_file)


@pytest.mark.launched(TRAINER_RUN)
def test_trainer_example_runs_copied_alone(launch):
    result = launch.result(TRAINER_RUN)
    result.assert_ok("torchrun --standalone --nproc-per-node 2 trainer_packed.py, copied alone")
    assert_left_alone(result.cwd / EXAMPLE.name)
    metrics = json.loads((result.cwd / "out" / "metrics.json").read_text())
    assert (metrics["cp_size"], metrics["world_size"]) == (2, 2), metrics
    assert len(metrics["losses"]) == 1 and math.isfinite(metrics["losses"][0]), metrics["losses"]

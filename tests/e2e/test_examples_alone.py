"""Each example script runs when copied alone into an empty folder (it imports only the library and its
dependencies, no sibling script, and reads no repository file), and examples/README.md gives every
script a command line. The run copied alone is the one its end-to-end test launches already
(`helpers.scripts.copied_alone`): no launch is spent on it alone, except for trainer_packed.py, whose
only launch elsewhere is a failure; here its smallest run, one process, one optimizer step, writes a
`metrics.json` with one finite loss."""

from __future__ import annotations

import json
import math
import re
import sys

from helpers.scripts import ROOT, assert_left_alone, copied_alone, finish, start

EXAMPLES = ROOT / "examples"
TESTS = ROOT / "tests" / "e2e"
EXAMPLE = ROOT / "examples" / "trainer_packed.py"
# The test file that launches each example copied alone.
RUN_ALONE_IN = {
    "train_packed.py": "test_train_example.py",  # torchrun, cp = 2
    "sft_trl.py": "test_sft_example.py",  # torchrun, cp = 2
    "train_dpo.py": "test_dpo_example.py",  # torchrun, cp = 2
    "train_grpo.py": "test_grpo_example.py",  # torchrun, cp = 1 and cp = 2
    "trainer_packed.py": "test_examples_alone.py",  # below, one process
}


def test_every_example_runs_copied_alone_somewhere_and_is_named_in_the_readme():
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == sorted(RUN_ALONE_IN), f"examples/ holds {scripts}; copied alone are run {sorted(RUN_ALONE_IN)}"
    readme = (EXAMPLES / "README.md").read_text()
    for name, test_file in RUN_ALONE_IN.items():
        assert f"examples/{name} " in readme and f"## `{name}`" in readme, f"examples/README.md does not show {name}"
        text = (TESTS / test_file).read_text()
        launched = re.search(rf'^EXAMPLE = ROOT / "examples" / "{re.escape(name)}"$', text, flags=re.M)
        assert launched and "copied_alone(EXAMPLE.name" in text and "assert_left_alone(" in text, (name, test_file)


def test_trainer_example_runs_copied_alone(tmp_path):
    script = copied_alone(EXAMPLE.name, tmp_path / "alone")
    log = tmp_path / "run.log"
    args = ["--steps", "1", "--packs-per-step", "1", "--max-tokens", "256", "--output-dir", "out"]
    finish(start([sys.executable, script.name, *args], log, cwd=script.parent), log, f"{script.name} copied alone")
    assert_left_alone(script)
    losses = json.loads((script.parent / "out" / "metrics.json").read_text())["losses"]
    assert len(losses) == 1 and math.isfinite(losses[0]), losses

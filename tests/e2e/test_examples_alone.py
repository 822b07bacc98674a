"""Each example script runs when copied alone into an empty folder (it imports only the library and its
dependencies, no sibling script): its smallest run, one process, one optimizer step, writes a
`metrics.json` with one finite loss. The five run at once (one thread each). examples/README.md gives
every script a command line."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest

from helpers.scripts import ROOT, finish, script_env

EXAMPLES = ROOT / "examples"
SMALLEST = {
    "train_packed.py": ["--steps", "1", "--packs-per-step", "1", "--max-tokens", "256"],
    "trainer_packed.py": ["--steps", "1", "--packs-per-step", "1", "--max-tokens", "256"],
    "sft_trl.py": ["--steps", "1", "--packs-per-step", "1", "--max-length", "128", "--examples", "40"],
    "train_dpo.py": ["--steps", "1", "--packs-per-step", "1", "--max-length", "128", "--examples", "8"],
    "train_grpo.py": ["--steps", "1", "--prompts", "8", "--completions-per-rank", "4", "--max-completion-length", "8"],
}
NEEDS_TRL = ("sft_trl.py", "train_dpo.py", "train_grpo.py")


def test_every_example_is_run_here_and_named_in_the_readme():
    scripts = sorted(path.name for path in EXAMPLES.glob("*.py"))
    assert scripts == sorted(SMALLEST), f"examples/ holds {scripts}; this test runs {sorted(SMALLEST)}"
    readme = (EXAMPLES / "README.md").read_text()
    for name in scripts:
        assert f"examples/{name} " in readme and f"## `{name}`" in readme, f"examples/README.md does not show {name}"


def test_each_example_runs_copied_alone(tmp_path):
    pytest.importorskip("trl")
    runs = {}
    for name, args in SMALLEST.items():
        folder = tmp_path / name.removesuffix(".py")
        folder.mkdir()
        shutil.copy(EXAMPLES / name, folder / name)
        log = tmp_path / f"{name}.log"
        proc = subprocess.Popen([sys.executable, name, *args, "--output-dir", "out"], cwd=folder, env=script_env(),
                                stdout=log.open("w"), stderr=subprocess.STDOUT)
        runs[name] = (folder, log, proc)
    for name, (folder, log, proc) in runs.items():
        finish(proc, log, f"{name} copied alone into an empty folder")
        assert sorted(p.name for p in folder.iterdir()) == sorted([name, "out"]), sorted(folder.iterdir())
        losses = json.loads((folder / "out" / "metrics.json").read_text())["losses"]
        assert len(losses) == 1 and math.isfinite(losses[0]), (name, losses)

"""README.md's "## The two commands" block holds exactly two command lines, and `.ci/run` runs
those very lines and fails on any non-zero exit, pytest's 5 (no test collected) included."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CI_RUN = ROOT / ".ci" / "run"


def two_commands(readme: str) -> list[str]:
    """The lines of the first ```bash block after the "## The two commands" heading."""
    section = readme.split("\n## The two commands\n", 1)[1]
    block = section.split("```bash\n", 1)[1].split("\n```", 1)[0]
    return block.splitlines()


def test_readme_two_commands_install_run_and_test():
    first, second = two_commands((ROOT / "README.md").read_text())
    install, _, job = first.partition(" && ")
    assert install == 'python -m pip install torch==2.13.0 -e ".[dev]"', "the first line installs torch and the library"
    assert job.startswith("torchrun --standalone --nproc-per-node 2 examples/train_packed.py "), job
    assert "--output-dir out/train_packed" in job
    assert second == "python -m pytest -q tests"


def test_ci_runs_the_readme_lines():
    printed = subprocess.run(["bash", str(CI_RUN), "--print"], capture_output=True, text=True, check=True).stdout
    assert printed.splitlines() == two_commands((ROOT / "README.md").read_text())


def _ci_run_with(tmp_path: Path, first: str, second: str) -> subprocess.CompletedProcess:
    """`.ci/run` copied into an otherwise empty tree whose README's two commands are `first`, `second`."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(CI_RUN, tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(f"# x\n\n## The two commands\n\n```bash\n{first}\n{second}\n```\n\n## Next\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_nothing.py").write_text('"""Holds no test."""\n')
    return subprocess.run(["bash", str(tmp_path / ".ci" / "run")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_ci_fails_when_no_test_ran(tmp_path):
    run = _ci_run_with(tmp_path, "true", "python -m pytest -q -p no:cacheprovider tests")
    assert run.returncode == 5, run.stdout + run.stderr  # pytest: no tests collected


def test_ci_stops_at_a_failing_first_command(tmp_path):
    run = _ci_run_with(tmp_path, "true && false", "touch ran-tests")
    assert run.returncode == 1 and not (tmp_path / "ran-tests").exists(), run.stdout + run.stderr

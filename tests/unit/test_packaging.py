"""The installed package: pyproject's explicit package list names every package folder, and the
repository's top-level model_patches/ folder is importable only inside the library's namespace."""

from __future__ import annotations

import importlib.util

from pathlib import Path

import pytest

import hf_blockdiag_cp

REPO = Path(hf_blockdiag_cp.__file__).parent.parent


def test_pyproject_lists_every_package_folder():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(pyproject["packages"])
    folders = {"hf_blockdiag_cp." + ".".join(p.parent.relative_to(REPO / "hf_blockdiag_cp").parts)
               for p in (REPO / "hf_blockdiag_cp").rglob("__init__.py")}
    folders = {name.rstrip(".") for name in folders} | {"hf_blockdiag_cp.model_patches"}
    assert listed == folders
    assert pyproject["package-dir"] == {"hf_blockdiag_cp.model_patches": "model_patches"}


def test_model_patches_is_not_a_top_level_package():
    import hf_blockdiag_cp.model_patches as patches

    assert Path(patches.__file__).resolve().parent == (REPO / "model_patches").resolve()
    spec = importlib.util.find_spec("model_patches")
    # Only a checkout on sys.path (the repository root as the working directory) shows the folder itself.
    assert spec is None or Path(spec.origin).parent == REPO / "model_patches" and str(REPO) in _sys_path()


def _sys_path() -> list[str]:
    import sys

    return [str(Path(p or ".").resolve()) for p in sys.path]

"""Running the example scripts from the e2e tests: start one in the background with a log, wait
for it (failing the test with the log's tail), a free port for a lone rank's launch environment,
and a script loaded as a module (for its pure functions)."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def script_env(**extra: str) -> dict:
    """One thread per process: CI shares 2 cores, and oversubscribed OpenMP threads spin (10x slower here)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=script_env(), stdout=log.open("w"), stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, what: str, timeout: float = 300) -> None:
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"{what} did not finish in {timeout}s; log tail:\n{log.read_text()[-3000:]}")
    assert rc == 0, f"{what} exited with {rc}; log tail:\n{log.read_text()[-3000:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_script(path: Path, name: str):
    """The script at `path` imported as module `name` (its folder on sys.path meanwhile: scripts import their siblings)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))

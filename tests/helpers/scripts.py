"""Running the example scripts from the e2e tests: the environment of a launched script, an example
copied alone into an empty folder (to run it from there), a free port and torchrun's variables for a
lone rank, a script loaded as a module (for its pure functions), and a script's `__main__` run inside
the test's process under a launcher's environment (for its error paths: no interpreter to start).
The torchrun launch that runs them: `helpers.launch`."""

from __future__ import annotations

import importlib.util
import logging
import os
import runpy
import shutil
import socket
import sys
from pathlib import Path

import torch

# Imported at collection, so that their log handlers (transformers', datasets') write to the session's
# stderr, not to the captured stream of the first in-process run (closed after its test).
import datasets  # noqa: F401
import hf_blockdiag_cp  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]


def script_env(**extra: str) -> dict:
    """One thread per process: CI shares 2 cores, and oversubscribed OpenMP threads spin (10x slower here)."""
    return dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1", **extra)


TORCHRUN_2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def copied_alone(name: str, folder: Path) -> Path:
    """examples/`name` copied into `folder`, created empty: run from there (cwd `folder`, the script by
    its name), it has no sibling script to import and no repository file to read."""
    folder.mkdir()
    shutil.copy(ROOT / "examples" / name, folder / name)
    return folder / name


def assert_left_alone(script: Path, outputs: str = "out") -> None:
    """After a run of a `copied_alone` script: its folder holds the script and its `outputs` folder only."""
    held = sorted(p.name for p in script.parent.iterdir())
    assert held == sorted([script.name, outputs]), f"{script.parent} holds {held}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(rank: int, world_size: int = 2) -> dict[str, str]:
    """What torchrun exports to `rank` of a `world_size`-process world (the peers are never started)."""
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def load_script(path: Path, name: str):
    """The script at `path` imported as module `name`, its folder on sys.path meanwhile, as `python
    script` has it (the benchmarks import their siblings; the examples import none, which
    e2e/test_examples_alone.py checks)."""
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


# What the launchers export (torchrun, MPI, accelerate's simple launcher); cleared before a run in process.
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE", "ACCELERATE_USE_CPU")


class ProcessExit(BaseException):
    """`os._exit(code)` called by a script run in process (see `run_in_process`)."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _no_process_group(*args, **kwargs):
    raise AssertionError("the script reached init_process_group: a lone rank would wait there for its peers")


def run_in_process(monkeypatch, capsys, script: Path, args: list[str], env: dict[str, str],
                   process_group: bool = False) -> tuple[int | str | None, str, str]:
    """`python script args` in this process: the script's `__main__` block (runpy) with `sys.argv`
    and the launcher variables as the launcher `env` sets them; `(exit status, stdout, stderr)`.

    The status is what `sys.exit` or `os._exit` was given (the process would end there; here it
    raises). `process_group=False`: reaching `torch.distributed.init_process_group` fails the run
    (the real process, a rank without its peers, would hang there); True: a world of one may start
    its in-memory group, destroyed afterwards. The global RNG, the logging setup the script changes
    and the process group are restored, so later tests see this process as it was."""
    import torch.distributed as dist

    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(sys, "argv", [str(script), *args])
    monkeypatch.syspath_prepend(str(script.parent))  # as `python script` has it: the benchmarks import siblings

    def exit_now(code):
        raise ProcessExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    if not process_group:
        monkeypatch.setattr(dist, "init_process_group", _no_process_group)
    assert not dist.is_initialized(), "a process group is already up in the test process"
    root, library = logging.getLogger(), logging.getLogger("hf_blockdiag_cp")
    saved = root.handlers[:], root.level, library.level
    capsys.readouterr()
    status, threads = None, torch.get_num_threads()
    torch.set_num_threads(1)  # as under `script_env`'s OMP_NUM_THREADS=1
    try:
        with torch.random.fork_rng(devices=[]):
            runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        status = exc.code
    except ProcessExit as exc:
        status = exc.code
    finally:
        torch.set_num_threads(threads)
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        library.setLevel(saved[2])
        if dist.is_initialized():  # the script's own cleanup did not run (it failed)
            dist.destroy_process_group()
    out = capsys.readouterr()
    return status, out.out, out.err

"""What each rank of the e2e tests' shared torchrun launch runs (`helpers.launch`): the planned scripts
one after the other, each as `python script args` would run it (its `__main__` by runpy, its folder
first on sys.path, its own working folder and argv), its output in a log of its own per rank, then
the process left as a fresh one would be for the next (no process group, accelerate's state reset,
the environment, logging and the library's once-per-process log restored).

A run's result goes to `rank<r>.status` in its folder: `{"status": <exit status or "raised">,
"error": "<type>: <message>"}`. A run planned to raise on every rank (`raises`) records its error
and the launch goes on; any other failure ends this worker (status 1), and torchrun ends its peers."""

from __future__ import annotations

import gc
import json
import logging
import os
import runpy
import sys
import traceback
from pathlib import Path


def _run_environ(index: int, environ: dict) -> dict:
    """torchrun's variables for run `index`: the first as torchrun set them (its process group meets
    on the agent's store), each later one with a rendezvous of its own, a port rank 0 picked, passed
    on through that store. A process group made again on the agent's store would read the keys the
    last run's group left there and connect to its closed sockets."""
    if index == 0:
        return environ
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(environ["MASTER_ADDR"], int(environ["MASTER_PORT"]), is_master=False,
                          timeout=timedelta(seconds=300))
    key = f"e2e-launch/run{index}/port"
    if environ["RANK"] == "0":
        with socket.socket() as s:
            s.bind((environ["MASTER_ADDR"], 0))
            port = s.getsockname()[1]
        store.set(key, str(port))
    port = store.get(key).decode()
    return dict(environ, MASTER_PORT=port, TORCHELASTIC_USE_AGENT_STORE="False")


def _fresh_process(logging_state: tuple) -> None:
    """Undo what a run leaves in the process that a run in a new interpreter would not find."""
    import torch.distributed as dist
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    from hf_blockdiag_cp.step.state import log_choices

    if dist.is_initialized():
        dist.destroy_process_group()  # every group, the default one included
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    log_choices.cache_clear()  # "said once per process"
    root, library = logging.getLogger(), logging.getLogger("hf_blockdiag_cp")
    handlers, root_level, library_level, transformers_level = logging_state
    root.handlers[:] = handlers
    root.setLevel(root_level)
    library.setLevel(library_level)
    transformers.utils.logging.set_verbosity(transformers_level)
    gc.collect()


def _run(run: dict, path: list[str], environ: dict) -> dict:
    """`python script args` from the run's folder under `environ`: its status record."""
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(run["cwd"])
    sys.argv = [run["script"], *run["args"]]
    sys.path[:] = [str(Path(run["script"]).parent), *path]  # as `python script` has it
    try:
        runpy.run_path(run["script"], run_name="__main__")
    except SystemExit as exc:
        return {"status": 0 if exc.code is None else exc.code}
    except Exception as exc:  # noqa: BLE001 -- recorded for the test
        if not run["raises"]:
            traceback.print_exc()
        return {"status": "raised", "error": f"{type(exc).__name__}: {exc}"}
    return {"status": 0}


def _redirect(stdout: int, stderr: int) -> None:
    """Point file descriptors 1 and 2 (Python's streams and what C code writes alike) at these."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)


def main(plan_path: str) -> None:
    import accelerate  # noqa: F401 -- every run imports them: imported once, before the first
    import torch  # noqa: F401
    import transformers

    import hf_blockdiag_cp  # noqa: F401

    rank = os.environ["RANK"]
    environ, path = dict(os.environ), sys.path[1:]  # sys.path[0]: this file's folder, no run's
    logging_state = (logging.getLogger().handlers[:], logging.getLogger().level,
                     logging.getLogger("hf_blockdiag_cp").level, transformers.utils.logging.get_verbosity())
    console = os.dup(1), os.dup(2)
    for index, run in enumerate(json.loads(Path(plan_path).read_text())):
        run_environ = _run_environ(index, environ)
        folder = Path(run["folder"])
        with open(folder / f"rank{rank}.log", "w") as log:
            _redirect(log.fileno(), log.fileno())
            try:
                result = _run(run, path, run_environ)
            finally:
                _redirect(*console)
        partial = folder / f"rank{rank}.partial"
        partial.write_text(json.dumps(result))
        partial.replace(folder / f"rank{rank}.status")  # whole, or not there
        if result["status"] != 0 and not run["raises"]:
            print(f"rank {rank}: run {run['name']} ended with {result}; ending the launch", file=sys.stderr, flush=True)
            os._exit(1)
        _fresh_process(logging_state)


if __name__ == "__main__":
    main(sys.argv[1])

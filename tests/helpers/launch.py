"""One torchrun launch of 2 processes for the e2e tests' script runs under torchrun: each launched
interpreter costs seconds of imports, so the examples, the README's blocks and the multi-GPU
benchmark run one after the other in the same two workers (`launch_driver.py`), each in a fresh
state (no process group, accelerate's state reset), while the tests' one-process comparison runs go
on in the test process. A run may raise on every rank (the error is its result) or, last, end the
workers (a failure under torchrun).

A test names its runs with `@pytest.mark.launched(RUN, ...)` and reads them from the session's
`launch` fixture (tests/e2e/conftest.py): `launch.result(RUN)` waits for that run. The launch holds
the runs of the selected tests only, in the tests' order (a run that ends the workers itself, a
failure under torchrun, last), so `-k` selecting one test launches only its runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from helpers.scripts import ROOT, TORCHRUN_2, copied_alone, script_env

DRIVER = Path(__file__).with_name("launch_driver.py")
RUN_TIMEOUT = 300  # seconds a run may take once started


@dataclass(frozen=True)
class Run:
    """A script run by both ranks: `script args` from the run's folder, or with `alone` the script
    copied alone into `<folder>/alone` and run from there (its outputs go there too; see
    `helpers.scripts.copied_alone`). `script` may instead write the script into the run's folder and
    return its path. `raises`: every rank raises (the test reads the error) and the launch goes on.
    `ends_launch`: the run ends the workers itself, so it runs last."""

    name: str
    script: Path | Callable[[Path], Path]
    args: tuple[str, ...] = ()
    alone: bool = False
    raises: bool = False
    ends_launch: bool = False


@dataclass(frozen=True)
class Result:
    """A finished run: its folder, where it ran, each rank's status record and log."""

    folder: Path
    cwd: Path
    statuses: tuple[dict, ...]
    logs: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.logs)

    def assert_ok(self, what: str) -> None:
        failed = [rank for rank, status in enumerate(self.statuses) if status.get("status") != 0]
        assert not failed, "\n".join(f"{what}, rank {rank}: {self.statuses[rank]}; its log's tail:\n"
                                     f"{self.logs[rank][-3000:]}" for rank in failed)


class Launch:
    """The session's launch of `runs` (started at once, under `base`)."""

    def __init__(self, runs: list[Run], base: Path):
        self.runs, self.base, self.folders, self.seen = {run.name: run for run in runs}, base, {}, {}
        self.log, self.proc, self.error = base / "launch.log", None, None
        try:
            plan = [self._prepare(run) for run in runs]
        except Exception:  # noqa: BLE001 -- the tests that read a run fail with it, the others run
            self.error = traceback.format_exc()
            return
        (base / "plan.json").write_text(json.dumps(plan, indent=1))
        if not runs:
            return
        self.proc = subprocess.Popen([*TORCHRUN_2, str(DRIVER), str(base / "plan.json")], cwd=ROOT, env=script_env(),
                                     stdout=self.log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)

    def _prepare(self, run: Run) -> dict:
        """The run's folder, with the script copied or written there: its entry in the plan."""
        folder = self.base / run.name
        folder.mkdir()
        if run.alone:
            script = copied_alone(Path(run.script).name, folder / "alone")
        else:
            script = run.script(folder) if callable(run.script) else Path(run.script)
        cwd = script.parent if run.alone else folder
        self.folders[run.name] = (folder, cwd)
        return dict(name=run.name, script=str(script), args=list(run.args), cwd=str(cwd), folder=str(folder),
                    raises=run.raises)

    def _started(self, run: Run) -> None:
        import pytest

        if self.error is not None:
            pytest.fail(f"the launch's runs could not be prepared:\n{self.error}")
        assert run.name in self.runs, f"run {run.name!r} is not in the launch: mark its test launched({run.name})"

    def _statuses(self, folder: Path) -> list[dict] | None:
        paths = [folder / f"rank{rank}.status" for rank in (0, 1)]
        return [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None

    def _result(self, name: str, statuses: list[dict]) -> Result:
        folder, cwd = self.folders[name]
        logs = tuple((folder / f"rank{rank}.log").read_text() if (folder / f"rank{rank}.log").exists() else ""
                     for rank in (0, 1))
        return Result(folder, cwd, tuple(statuses), logs)

    def result(self, run: Run, timeout: float = RUN_TIMEOUT) -> Result:
        """Wait for `run` to finish on both ranks (at most `timeout` seconds after it started)."""
        import pytest

        self._started(run)
        folder = self.folders[run.name][0]
        while True:
            statuses = self._statuses(folder)
            if statuses is not None:
                return self._result(run.name, statuses)
            if self.proc.poll() is not None:
                statuses = self._statuses(folder)  # written just before the end
                if statuses is not None:
                    return self._result(run.name, statuses)
                pytest.fail(f"the launch ended ({self.proc.returncode}) before run {run.name} finished; launch log "
                            f"tail:\n{self.log.read_text()[-3000:]}\nrun log tails:\n"
                            + "\n".join(log[-2000:] for log in self._result(run.name, [{}, {}]).logs))
            self._check_time(run, timeout)
            time.sleep(0.1)

    def _check_time(self, run: Run, timeout: float) -> None:
        """Fail (and end the launch) once `run` has run `timeout` seconds, counted from when it was first
        seen started."""
        import pytest

        if (self.folders[run.name][0] / "rank0.log").exists():
            self.seen.setdefault(run.name, time.monotonic())
        if run.name in self.seen and time.monotonic() - self.seen[run.name] > timeout:
            self.stop()
            pytest.fail(f"run {run.name} did not finish in {timeout}s; the launch is ended. Run log tails:\n"
                        + "\n".join(log[-2000:] for log in self._result(run.name, [{}, {}]).logs))

    def ending(self, run: Run, timeout: float = RUN_TIMEOUT) -> tuple[int, str, Result]:
        """Wait for the launch that `run` (`ends_launch`) ends: (torchrun's exit status, its own output,
        the run's logs; a rank that ended inside the run has no status: `{}`)."""
        self._started(run)
        assert run.ends_launch, run
        while self.proc.poll() is None:
            self._check_time(run, timeout)
            time.sleep(0.1)
        statuses = [json.loads(p.read_text()) if p.exists() else {}
                    for p in (self.folders[run.name][0] / f"rank{rank}.status" for rank in (0, 1))]
        return self.proc.returncode, self.log.read_text(), self._result(run.name, statuses)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # torchrun and its workers: the session it leads
            self.proc.wait()


def planned_runs(items) -> list[Run]:
    """The runs the selected test items name (`pytest.mark.launched`), each once, in the items'
    order; those of a test that skips by a `skipif` mark left out; a run that ends the launch last."""
    runs: dict[str, Run] = {}
    for item in items:
        if any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")):
            continue
        for mark in item.iter_markers("launched"):
            for run in mark.args:
                assert runs.get(run.name, run) == run, f"two runs named {run.name}"
                runs[run.name] = run
    ordered = sorted(runs.values(), key=lambda run: run.ends_launch)
    assert sum(run.ends_launch for run in ordered) <= 1, "more than one run ends the launch"
    return ordered


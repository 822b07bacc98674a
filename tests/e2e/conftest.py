"""The e2e tests' shared torchrun launch (`helpers.launch`): a test marked `launched(RUN, ...)` reads
its runs from the session's `launch` fixture, which starts one launch of the selected tests' runs at
the first e2e test (the tests before theirs run meanwhile), or none when no selected test has a run."""

import pytest

from helpers.launch import Launch, planned_runs


def pytest_configure(config):
    config.addinivalue_line("markers", "launched(*runs): the helpers.launch.Run objects the test reads from the "
                            "shared torchrun launch (the `launch` fixture)")


@pytest.fixture(scope="session", autouse=True)
def launch(request, tmp_path_factory):
    runs = planned_runs(request.session.items)
    shared = Launch(runs, tmp_path_factory.mktemp("launch"))
    yield shared
    shared.stop()

"""Test configuration: `tests/` on sys.path (shared helpers are `helpers.<module>`), a layer
marker per test from its folder (`unit`, `multiprocess`, `gpu`, `e2e`; see pyproject.toml and
docs/testing.md), one OpenMP thread per process, Triton autotuning kept on disk, and the
session-wide `gloo` fixture."""

import gc
import os
import sys
from pathlib import Path

# One thread in the test process too (before torch is imported), as in every pool worker and launched
# script: on CI's 2 cores a second OpenMP thread spins against them, and the tiny ops gain nothing
# from it (the unit tests ran in 65 s instead of 70-100 s here). An explicit OMP_NUM_THREADS wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton's autotuning choices on disk: fla's kernels (GPU tests) autotune for minutes on first use, and
# every gloo rank process and later run would tune them again.
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import pytest  # noqa: E402

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, os.fspath(TESTS))

from helpers.dist_pool import GlooPool  # noqa: E402

LAYERS = ("unit", "multiprocess", "gpu", "e2e")

_POOLS: dict[int, GlooPool] = {}


def pytest_collection_modifyitems(config, items):
    """Mark every test with its layer, the folder under tests/ that holds it (so `-m "not e2e"`
    works); unit tests must not start process groups."""
    misplaced = []
    for item in items:
        try:
            layer = Path(item.path).resolve().relative_to(TESTS).parts[0]
        except ValueError:  # not under tests/
            continue
        if layer not in LAYERS:
            continue
        item.add_marker(getattr(pytest.mark, layer))
        if layer == "unit" and "gloo" in getattr(item, "fixturenames", ()):
            misplaced.append(item.nodeid)
    if misplaced:
        raise pytest.UsageError(f"unit tests must not use the gloo fixture (move them to multiprocess/): {misplaced}")


def pytest_collection_finish(session):
    """Freeze what collection imported (torch, transformers, TRL, the test modules): it lives for the
    session, and the Trainer's and accelerate's gc.collect() calls would walk it each time."""
    gc.freeze()


@pytest.fixture(scope="session")
def gloo():
    """`gloo(world_size)` returns a live pool of that many ranks, shared by the whole session."""

    def get(world_size: int) -> GlooPool:
        pool = _POOLS.get(world_size)
        if pool is None or not pool.alive():
            pool = _POOLS[world_size] = GlooPool(world_size)
        return pool

    yield get
    for pool in _POOLS.values():
        pool.close()

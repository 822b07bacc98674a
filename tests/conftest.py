import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dist_pool import GlooPool  # noqa: E402

_POOLS: dict[int, GlooPool] = {}


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

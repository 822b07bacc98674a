"""Registering an exchange for the length of a test: `registered_exchange(record)` adds the
record, then restores the registry as it was (records, spellings and order), also when the test
fails. Multi-rank cases call it on every rank: each process has its own registry. And
`heads_refusal`: why an exchange cannot run the tiny test models' attention at a CP size (a
head-parallel exchange needs the query heads divisible by G)."""

from __future__ import annotations

import contextlib

from hf_blockdiag_cp.planning import ExchangeRecord, exchange_names, exchange_records, get_exchange, register_exchange, unregister_exchange
from helpers.reference import COMMON_CONFIG

TINY_HEADS = (COMMON_CONFIG["num_attention_heads"], COMMON_CONFIG["num_key_value_heads"])


@contextlib.contextmanager
def registered_exchange(record: ExchangeRecord):
    before = exchange_records()
    register_exchange(record)
    try:
        yield record
    finally:
        for name in exchange_names():
            unregister_exchange(name)
        for previous in before:
            register_exchange(previous)


def heads_refusal(name: str, world_size: int, heads: tuple[int, int] = TINY_HEADS) -> str | None:
    """Why exchange `name` cannot run attention of `heads` (query, kv; default: the tiny test
    models') over `world_size` ranks, or None if it can."""
    return get_exchange(name).heads_reason(*heads, world_size)


def exchanges_for(world_size: int, heads: tuple[int, int] = TINY_HEADS) -> tuple[str, ...]:
    """The registered exchanges that can run attention of `heads` over `world_size` ranks."""
    return tuple(name for name in exchange_names() if heads_refusal(name, world_size, heads) is None)

"""Registering a K/V exchange for the length of a test: `registered_exchange(record)` adds the
record, then restores the registry as it was (records, spellings and order), also when the test
fails. Multi-rank cases call it on every rank: each process has its own registry."""

from __future__ import annotations

import contextlib

from hf_blockdiag_cp.planning import ExchangeRecord, exchange_names, exchange_records, register_exchange, unregister_exchange


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

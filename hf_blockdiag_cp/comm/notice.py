"""Warnings about what a run does differently from what was asked: once per run, on rank 0.

A fallback (a named exchange that cannot serve a pack, a row without document boundaries, a
kernel without a verified log-sum-exp, documents split at the pack size) happens alike on every
rank and usually at every step; logged per rank and per step it would drown the log. So each
distinct notice (its `key`) is logged once per process at WARNING, and only by the run's rank 0.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

_SEEN: set = set()


def run_rank() -> int:
    """This process's rank in the run: the default process group's, else the launcher's `RANK`
    (DataLoader workers, or before the group starts), else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0


def warn_once(logger: logging.Logger, key, message: str, level: int = logging.WARNING) -> bool:
    """Log `message` on `logger` (at WARNING, or `level`) the first time this process sees `key`, on rank 0
    only. Returns whether it was logged."""
    if key in _SEEN:
        return False
    _SEEN.add(key)
    if run_rank() != 0:
        return False
    logger.log(level, message)
    return True


def forget(key) -> None:
    """Let `key`'s notice be logged again (a second run in the same process, e.g. a notebook)."""
    _SEEN.discard(key)

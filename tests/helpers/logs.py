"""The messages the library logs (the `hf_blockdiag_cp` loggers) inside a block, in a pool worker or here."""

from __future__ import annotations

import contextlib
import logging


class _Collect(logging.Handler):
    def __init__(self, level: int, messages: list[str]):
        super().__init__(level)
        self.messages = messages

    def emit(self, record):
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def library_logs(level: int = logging.WARNING):
    """Yield a list that receives every message logged at `level` or above on the `hf_blockdiag_cp` loggers
    until the block ends (the loggers' level lowered to `level` meanwhile if needed)."""
    messages: list[str] = []
    logger = logging.getLogger("hf_blockdiag_cp")
    handler, previous = _Collect(level, messages), logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)

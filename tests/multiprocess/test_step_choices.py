"""What a step ran is said once: the kernel, K/V exchange and layout that a CP step ran (what
`auto` chose) are logged at INFO on the `hf_blockdiag_cp` loggers once per distinct choice, not
per layer or step, on a real 2-rank gloo group. On CPU `auto` runs the `dense` kernel (the only
kernel with a CPU backward; docs/kernels.md)."""

from __future__ import annotations

import logging

import hf_blockdiag_cp as bdcp
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from helpers.reference import build_models, make_pack


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def choices_case(rank, world_size, group):
    from hf_blockdiag_cp.step import state

    state.log_choices.cache_clear()  # the pool's process may have run these choices in an earlier case
    _, model = build_models("llama")  # two attention layers
    enable_activation_checkpointing(model, use_reentrant=False)  # recompute calls too
    logger = logging.getLogger("hf_blockdiag_cp")
    records, level = _Records(), logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    ran = []
    try:
        _, batch = make_pack("straddle", world_size)
        for exchange in ("auto", "auto", "allgather", "auto"):
            config = bdcp.CPConfig(attn_backend="auto", kv_exchange=exchange, layout="balanced")
            train_ctx, local, _ = bdcp.make_cp_blockdiag_batch_and_ctx(group, None, dict(batch), config=config, model=model)
            with train_ctx() as step:
                model(**local).loss.backward()
            ran.append((exchange, step.kv_exchange, step.attention_calls))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return [m for m in records.messages if m.startswith("blockdiag_cp runs")], ran


def test_auto_choices_are_logged_once_per_distinct_choice(gloo):
    for rank, (messages, ran) in enumerate(gloo(2).run(choices_case, timeout=180)):
        assert all(calls >= 4 for _, _, calls in ran), ran  # 2 layers, forward and recompute: many calls per step
        auto_exchange = ran[0][1]
        assert {r[1] for r in ran if r[0] == "auto"} == {auto_exchange}, ran  # one pack: one choice
        expected = [
            f"blockdiag_cp runs kernel dense (attn_backend='auto'), K/V exchange {auto_exchange} (kv_exchange='auto'), "
            "layout balanced",
            "blockdiag_cp runs kernel dense (attn_backend='auto'), K/V exchange allgather (kv_exchange='allgather'), "
            "layout balanced",
        ]
        assert messages == expected, f"rank {rank}: {messages}"

"""The Trainer integration's parts that need no process group: `BlockdiagCPCallback`'s setup
check of the activation-checkpointing mode, `TokenMeter`'s metrics and `PackingOptions`' oversize
policy. The Trainer runs themselves are in multiprocess/test_trainer.py."""

from __future__ import annotations

import pytest

from hf_blockdiag_cp.integrations.trainer import BlockdiagCPCallback, PackingOptions, TokenMeter
from hf_blockdiag_cp.compat.transformers import enable_activation_checkpointing
from helpers.trainer import tiny_model


def test_callback_checks_activation_checkpointing_mode():
    callback = BlockdiagCPCallback(cp_size=1)
    model = tiny_model()
    callback.check_setup(model, world_size=1)
    enable_activation_checkpointing(model, use_reentrant=False)
    callback.check_setup(model, world_size=1)
    enable_activation_checkpointing(model, use_reentrant=True)
    with pytest.raises(ValueError, match="reentrant activation checkpointing"):
        callback.check_setup(model, world_size=1)
    with pytest.raises(ValueError, match="cp_size must be a positive integer"):
        BlockdiagCPCallback(cp_size=0)


def test_token_meter_metrics():
    meter = TokenMeter(world_size=2)
    assert meter.pop() == {}
    meter.add([30, 10], 48)
    meter.add([6, 2], 16)
    metrics = meter.pop()
    assert metrics["cp_real_tokens_rank0"] == 36 and metrics["cp_real_tokens_rank1"] == 12
    assert metrics["cp_packing_efficiency"] == pytest.approx(48 / 64)
    assert metrics["cp_rank_imbalance"] == pytest.approx(36 / 24)
    assert metrics["cp_tokens_per_second"] > 0
    assert meter.pop() == {}  # a new window


def test_packing_options_hold_one_oversize_policy():
    assert PackingOptions(16).oversize == "split"
    assert PackingOptions(16, oversize="reject").oversize == PackingOptions(16, oversize="raise").oversize == "raise"
    with pytest.raises(ValueError, match="oversize must be one of 'split', 'raise'; got 'truncate'"):
        PackingOptions(16, oversize="truncate")

"""Transformers `Trainer` integration: packed data per DP replica, one CP shard step per micro-batch.

`BlockdiagCPTrainer` (= `BlockdiagCPTrainerMixin` + `transformers.Trainer`) packs and shards
the training data itself and wraps forward and backward in the step context (`training`);
its `evaluate` / `predict` run every eval pack through the shard step under CP (`evaluation`).
`BlockdiagCPCallback` checks the setup at `on_train_begin` and meters tokens for the logs
(`callback`). The setup checks, packing options and CP mesh resolution are in `setup`.
"""

from .callback import BlockdiagCPCallback, TokenMeter
from .setup import PackingOptions, activation_checkpointing_reentrant
from .training import BlockdiagCPTrainer, BlockdiagCPTrainerMixin

__all__ = [
    "BlockdiagCPCallback",
    "BlockdiagCPTrainer",
    "BlockdiagCPTrainerMixin",
    "PackingOptions",
    "TokenMeter",
    "activation_checkpointing_reentrant",
]
